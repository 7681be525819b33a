use oomguard::{leak_check, memory_budget, oom_retry, Error};

// An option named without its value says so (it said "unknown option `action`").
#[leak_check(action)]
fn a() {}

#[memory_budget(fraction)]
fn b() {}

// A misspelt option is one error, not two ("needs a budget" too).
#[memory_budget(fracton = 0.9)]
fn c() {}

// Literals as rustc reads them: a suffix is a type, and the value fits it.
#[oom_retry(max_retries = 300u8)]
fn d(n: usize) -> Result<usize, Error> {
    Ok(n)
}

#[oom_retry(min = 2xyz, batch = n)]
fn e(n: usize) -> Result<usize, Error> {
    Ok(n)
}

#[memory_budget(fraction = 0.5xyz)]
fn f() {}

fn main() {}
