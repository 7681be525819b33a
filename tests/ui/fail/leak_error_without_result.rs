use oomguard::leak_check;

#[leak_check(action = error)]
fn step() -> u32 {
    1
}

fn main() {}
