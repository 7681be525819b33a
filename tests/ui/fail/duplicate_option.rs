use oomguard::oom_retry;

#[oom_retry(max_retries = 1, max_retries = 2)]
fn step() -> Result<(), oomguard::Error> {
    Ok(())
}

fn main() {}
