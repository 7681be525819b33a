use oomguard::{memory_budget, oom_retry, BatchPlan, Error};

// Two budgets under #[oom_retry]: rejected (one would be dropped).
#[oom_retry(plan = plan)]
#[memory_budget("1 GiB")]
#[memory_budget("2 GiB")]
fn two_budgets(plan: &BatchPlan) -> Result<usize, Error> {
    Ok(plan.batch())
}

// Two retry loops on one function: rejected (they would nest).
#[oom_retry]
#[oom_retry]
fn two_retries() -> Result<(), Error> {
    Ok(())
}

fn main() {}
