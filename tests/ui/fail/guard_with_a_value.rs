use oomguard::{no_grad, oom_retry, Error};

// Under #[oom_retry] a guard's `= value` was accepted and ignored.
#[oom_retry]
#[no_grad = "please not"]
fn step(n: usize) -> Result<usize, Error> {
    Ok(n)
}

fn main() {}
