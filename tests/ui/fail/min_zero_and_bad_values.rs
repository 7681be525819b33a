use oomguard::oom_retry;

#[oom_retry(min = 0, remember = 1, persist = "", max_retries = "3")]
fn step() -> Result<(), oomguard::Error> {
    Ok(())
}

fn main() {}
