//! Edge shapes (issue 15): `_` parameters, parameters named like the generated identifiers,
//! `Result` aliases, a renamed facade in either attribute order, expression bodies without
//! warnings.
#![deny(warnings)]

extern crate oomguard as og;

use og::{leak_check, memory_budget, no_grad, oom_retry, BatchPlan, Error};

type StepResult<T> = Result<T, Error>;

#[oom_retry(plan = plan)]
fn underscore(_: u32, plan: &BatchPlan, _: &mut Vec<u8>) -> StepResult<usize> {
    Ok(plan.batch())
}

#[oom_retry(plan = __oomguard_plan0, commit = |v| Ok(v + __oomguard_value))]
#[leak_check(action = error)]
fn generated_names(
    __oomguard_retry: u32,
    __oomguard_plan0: &BatchPlan,
    __oomguard_out: &mut u32,
    __oomguard_value: usize,
) -> Result<usize, Error> {
    *__oomguard_out += __oomguard_retry;
    Ok(__oomguard_plan0.batch())
}

#[oom_retry(crate = "og")]
#[memory_budget("1 GiB", crate = "og")]
fn renamed_below() -> Result<(), Error> {
    Ok(())
}

#[memory_budget("1 GiB")]
#[og::oom_retry(crate = "og")]
fn renamed_above() -> Result<(), Error> {
    Ok(())
}

#[no_grad(crate = "og")]
fn expression_body() -> Result<u32, Error> {
    Ok(1)
}

#[memory_budget("1 MiB", crate = "og")]
#[leak_check(crate = "og")]
fn expression_body_guards() -> u32 {
    2
}

fn main() {
    let plan = BatchPlan::whole(3).unwrap();
    assert_eq!(underscore(1, &plan, &mut Vec::new()).unwrap(), 3);
    let mut out = 0;
    assert_eq!(generated_names(2, &plan, &mut out, 4).unwrap(), 7);
    assert_eq!(out, 2);
    renamed_below().unwrap();
    renamed_above().unwrap();
    assert_eq!(expression_body().unwrap() + expression_body_guards(), 3);
}
