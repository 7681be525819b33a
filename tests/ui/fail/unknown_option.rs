use oomguard::oom_retry;

#[oom_retry(bogus = 1)]
fn step() -> Result<(), oomguard::Error> {
    Ok(())
}

fn main() {}
