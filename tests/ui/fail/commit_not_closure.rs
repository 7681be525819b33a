use oomguard::{oom_retry, BatchPlan, Error};

fn apply(_loss: f32) -> Result<f32, Error> {
    Ok(0.0)
}

#[oom_retry(plan = plan, commit = apply)]
fn path_commit(plan: &BatchPlan) -> Result<f32, Error> {
    Ok(plan.batch() as f32)
}

#[oom_retry(plan = plan, commit = |a, b| Ok(a + b))]
fn two_params(plan: &BatchPlan) -> Result<f32, Error> {
    Ok(plan.batch() as f32)
}

#[oom_retry(plan = plan, commit = || Ok(1.0))]
fn no_param(plan: &BatchPlan) -> Result<f32, Error> {
    Ok(plan.batch() as f32)
}

fn main() {}
