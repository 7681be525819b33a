use oomguard::leak_check;

#[leak_check(action = explode, allow = "1 MiB")]
fn step() {}

fn main() {}
