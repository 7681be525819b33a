use oomguard::oom_retry;

#[oom_retry(plan = plan)]
fn step(plan: usize) -> Result<usize, oomguard::Error> {
    Ok(plan)
}

fn main() {}
