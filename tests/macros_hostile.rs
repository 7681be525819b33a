//! What a hostile pass of the attribute macros found (2026-11-29): each case compiled and
//! computed something other than what was written. Compile-time refusals from the same pass
//! are in `tests/ui/fail` (`guard_on_impl_future`, `guard_with_a_value`,
//! `options_without_values`).

use oomguard::retry::last_report;
use oomguard::{leak_check, memory_budget, no_grad, oom_retry, ByteSize, Device, Error};

const MIB: usize = 1 << 20;

/// `bytes = 4 << 30` is 4 GiB: untyped integer literals fell back to `i32` through the budget's
/// generic conversion, so this was a budget of 0 bytes (and `5 << 30` one of 1 GiB).
#[memory_budget(bytes = 4 << 30)]
fn within_four_gib(dev: &Device, bytes: usize) -> Result<(), Error> {
    dev.alloc::<u8>(bytes)?;
    Ok(())
}

#[test]
fn a_budget_of_untyped_literals_is_what_was_written() {
    let dev = Device::sim(ByteSize::gib(16));
    within_four_gib(&dev, MIB).unwrap();
    within_four_gib(&dev, 3 << 30).unwrap();
    match within_four_gib(&dev, 5 << 30) {
        Err(Error::BudgetExceeded(b)) => assert_eq!(b.limit, 4 << 30, "{b}"),
        other => panic!("expected the 4 GiB budget to refuse 5 GiB, got {other:?}"),
    }
}

/// A buffer made in the function's last expression is gone when the function returns: the
/// check reported it as a leak (the expression's temporaries were dropped after the check).
#[leak_check]
fn rows_of_a_temporary(dev: &Device, rows: usize) -> Result<usize, Error> {
    Ok(dev.alloc::<u8>(rows * MIB)?.len() / MIB)
}

#[leak_check(action = warn)]
fn unit_body(dev: &Device) {
    let _kept_until_the_end = dev.alloc::<u8>(10);
}

#[test]
fn temporaries_of_the_last_expression_are_not_leaks() {
    let dev = Device::sim(ByteSize::mib(64));
    assert_eq!(rows_of_a_temporary(&dev, 2).unwrap(), 2);
    unit_body(&dev);
    assert_eq!(dev.stats().allocated_bytes.all.current, 0);
}

/// Plans are remembered per generic instance: a trait's default method under two `Self` types
/// shared one plan, so `Small` (which fits 64 rows) evaluated 16 of them, as `Big` had to.
trait Model {
    const MIB_A_ROW: usize;
    fn dev(&self) -> &Device;

    #[oom_retry(batch = rows)]
    #[no_grad]
    fn eval(&self, rows: usize) -> Result<usize, Error> {
        self.dev().alloc::<u8>(rows * Self::MIB_A_ROW * MIB)?;
        Ok(rows)
    }
}

struct Big(Device);
struct Small(Device);

impl Model for Big {
    const MIB_A_ROW: usize = 4;
    fn dev(&self) -> &Device {
        &self.0
    }
}

impl Model for Small {
    const MIB_A_ROW: usize = 1;
    fn dev(&self) -> &Device {
        &self.0
    }
}

#[oom_retry(batch = rows)]
#[no_grad]
fn eval_k<const K: usize>(dev: &Device, rows: usize) -> Result<usize, Error> {
    dev.alloc::<u8>(rows * K * MIB)?;
    Ok(rows)
}

#[test]
fn self_types_and_const_generics_are_instances_of_their_own() {
    let dev = Device::sim(ByteSize::mib(100));
    assert_eq!(Big(dev.clone()).eval(64).unwrap(), 16);
    assert_eq!(Small(dev.clone()).eval(64).unwrap(), 64);
    let r = last_report().unwrap();
    assert!(!r.from_memory && r.retries() == 0, "{r}");
    assert_eq!(eval_k::<4>(&dev, 64).unwrap(), 16);
    assert_eq!(eval_k::<1>(&dev, 64).unwrap(), 64);
    assert!(!last_report().unwrap().from_memory);
}

/// A commit that mutates a by-value parameter: the macro took the parameter's `mut` away.
#[oom_retry(commit = |n| { log.push(n); Ok(log.len()) })]
fn logged(mut log: Vec<usize>, n: usize) -> Result<usize, Error> {
    Ok(n)
}

#[test]
fn a_commit_may_mutate_a_parameter() {
    assert_eq!(logged(vec![7], 5).unwrap(), 2);
}
