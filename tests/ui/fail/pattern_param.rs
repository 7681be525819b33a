use oomguard::oom_retry;

#[oom_retry]
fn step((a, b): (u32, u32)) -> Result<u32, oomguard::Error> {
    Ok(a + b)
}

fn main() {}
