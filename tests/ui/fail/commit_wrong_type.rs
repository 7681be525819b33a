use oomguard::{oom_retry, BatchPlan, Error};

// The commit returns the function's return type.
#[oom_retry(plan = plan, commit = |loss: f32| loss)]
fn step(plan: &BatchPlan) -> Result<f32, Error> {
    Ok(plan.batch() as f32)
}

fn main() {}
