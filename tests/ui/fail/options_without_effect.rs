use oomguard::{memory_budget, oom_retry, Error};

// `min` without `batch` or `plan` has nothing to bound.
#[oom_retry(min = 4)]
fn min_alone() -> Result<(), Error> {
    Ok(())
}

// `persist` with `remember = false` would save nothing.
#[oom_retry(remember = false, persist = "plans.json")]
fn persist_nothing() -> Result<(), Error> {
    Ok(())
}

#[memory_budget("0")]
fn zero_budget() {}

#[memory_budget(bytes = 0)]
fn zero_bytes() {}

fn main() {}
