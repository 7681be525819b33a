//! The guards' glue: what `#[no_grad]`, `#[memory_budget]` and `#[leak_check]` expand to, on
//! synchronous bodies (a guard value held for the call) and async ones (guards applied on each
//! poll).

use std::future::Future;

use crate::guard::{self, GuardSet, LeakAction, LeakReport, Scoped, ThreadBudget, ThreadLeakCheck};
use crate::retry::IsOom;
use crate::{ByteSize, Error};

/// `#[no_grad]`: grad mode off until dropped.
#[inline]
pub fn no_grad() -> crate::guard::GradGuard {
    crate::guard::no_grad()
}

/// The budget of `#[memory_budget]`.
#[derive(Clone, Copy, Debug)]
pub enum BudgetLimit {
    /// A number of bytes.
    Bytes(u64),
    /// A fraction of each device's capacity, in (0, 1] (checked by the macro).
    Fraction(f64),
}

/// What `#[memory_budget(bytes = EXPR)]` accepts: integers and [`ByteSize`].
#[diagnostic::on_unimplemented(
    message = "`bytes = ...` takes an integer number of bytes or a `ByteSize`, not `{Self}`"
)]
pub trait BudgetBytes {
    /// The number of bytes (negative numbers are 0; numbers past `u64::MAX` are `u64::MAX`,
    /// a budget no allocation reaches).
    fn budget_bytes(self) -> u64;
}
macro_rules! budget_ints {
    ($($t:ty),*) => {$(
        impl BudgetBytes for $t {
            fn budget_bytes(self) -> u64 {
                #[allow(unused_comparisons)] // (unsigned types are never negative)
                let negative = self < 0;
                u64::try_from(self).unwrap_or(if negative { 0 } else { u64::MAX })
            }
        }
    )*};
}
budget_ints!(u8, u16, u32, u64, u128, usize, i8, i16, i32, i64, i128, isize);
impl BudgetBytes for ByteSize {
    fn budget_bytes(self) -> u64 {
        self.bytes()
    }
}

/// `bytes = EXPR` of `#[memory_budget]`.
pub fn budget_bytes(b: impl BudgetBytes) -> u64 {
    b.budget_bytes()
}

/// `#[memory_budget]`: a budget over this thread's allocations on every device, opened where
/// the attribute is (the caller's location).
#[track_caller]
pub fn budget(limit: BudgetLimit) -> Option<ThreadBudget> {
    match limit {
        BudgetLimit::Bytes(n) => Some(guard::thread_budget(ByteSize(n))),
        // The macro checked the range; a value outside it would mean no budget.
        BudgetLimit::Fraction(f) => guard::thread_budget_fraction(f).ok(),
    }
}

/// `#[leak_check]`: a leak check over this thread's allocations on every device, opened where
/// the attribute is (the caller's location) and naming the function. With `#[memory_budget]` on
/// the same function, `budget` makes the check's scope the budget too (one scope: they cover
/// the same allocations).
#[track_caller]
pub fn leak_check(
    action: LeakAction,
    allow: u64,
    function: &'static str,
    budget: Option<BudgetLimit>,
) -> ThreadLeakCheck {
    let check = match budget {
        None => guard::thread_leak_check(),
        Some(BudgetLimit::Bytes(n)) => guard::thread_leak_check_with_budget(ByteSize(n)),
        Some(BudgetLimit::Fraction(f)) => match guard::thread_leak_check_with_budget_fraction(f) {
            Ok(c) => c,
            // The macro checked the range; a value outside it would mean no budget.
            Err(_) => guard::thread_leak_check(),
        },
    };
    check.on_leak(action).allow(ByteSize(allow)).named(function)
}

/// `#[leak_check(action = error)]`: a leak becomes the function's `Err` (its own error wins).
pub fn leak_result<T, E: From<Error>>(check: ThreadLeakCheck, out: Result<T, E>) -> Result<T, E> {
    leak_result_of(check.finish(), out)
}

/// As [`leak_result`], for the outcome of an async body.
pub fn leak_result_of<T, E: From<Error>>(
    leak: Result<(), LeakReport>,
    out: Result<T, E>,
) -> Result<T, E> {
    match (leak, out) {
        (Err(report), Ok(_)) => Err(E::from(Error::Leak(report))),
        (_, out) => out,
    }
}

/// [`leak_result`] for the attempt of an `#[oom_retry]` function: a leak also wins over the
/// attempt's out-of-memory error. Retried, that error would vanish and the leak with it (an
/// attempt that keeps memory alive changed what lasts: a rerun would keep more).
pub fn leak_result_retried<T, E: From<Error> + IsOom>(
    check: ThreadLeakCheck,
    out: Result<T, E>,
) -> Result<T, E> {
    leak_result_of_retried(check.finish(), out)
}

/// As [`leak_result_retried`], for the outcome of an async body.
pub fn leak_result_of_retried<T, E: From<Error> + IsOom>(
    leak: Result<(), LeakReport>,
    out: Result<T, E>,
) -> Result<T, E> {
    match (leak, out) {
        (Err(report), Err(e)) if e.is_oom() => Err(E::from(Error::Leak(report))),
        (leak, out) => leak_result_of(leak, out),
    }
}

/// The guards of an async body.
#[derive(Debug)]
pub struct GuardSpec {
    /// `#[no_grad]`
    pub no_grad: bool,
    /// `#[memory_budget]`
    pub budget: Option<BudgetLimit>,
    /// `#[leak_check]`: its action and allowance.
    pub leak: Option<(LeakAction, u64)>,
    /// The function's name (for the leak report).
    pub function: &'static str,
}

/// An async body with its guards applied on each poll.
#[track_caller]
pub fn guarded<T, F: Future<Output = T>>(spec: GuardSpec, fut: F) -> Scoped<F> {
    let mut set = GuardSet::new().named(spec.function);
    if spec.no_grad {
        set = set.no_grad();
    }
    match spec.budget {
        Some(BudgetLimit::Bytes(n)) => set = set.budget(n),
        Some(BudgetLimit::Fraction(f)) => {
            set = match set.budget_fraction(f) {
                Ok(s) => s,
                Err(_) => GuardSet::new().named(spec.function),
            }
        }
        None => {}
    }
    if let Some((action, allow)) = spec.leak {
        set = set.leak_check(action, allow);
    }
    set.scope(fut)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Device;

    fn leak() -> LeakReport {
        let dev = Device::sim(ByteSize::mib(4));
        let check = guard::thread_leak_check().named("leaky");
        let kept = dev.alloc::<u8>(4096).unwrap();
        let report = check.finish().unwrap_err();
        drop(kept);
        report
    }

    fn oom() -> Error {
        Device::sim(ByteSize::mib(1))
            .alloc::<u8>(2 << 20)
            .unwrap_err()
    }

    #[test]
    fn a_leak_fails_a_successful_call_and_not_a_failed_one() {
        let out: Result<u8, Error> = leak_result_of(Err(leak()), Ok(1));
        assert!(matches!(out, Err(Error::Leak(_))));
        let own = Error::InvalidArgument("own".into());
        let out: Result<u8, Error> = leak_result_of(Err(leak()), Err(own));
        assert!(matches!(out, Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn in_a_retried_attempt_a_leak_wins_over_an_out_of_memory() {
        let out: Result<u8, Error> = leak_result_of_retried(Err(leak()), Err(oom()));
        assert!(matches!(out, Err(Error::Leak(_))));
        // not over another error, and no leak leaves the out-of-memory as it is
        let own = Error::InvalidArgument("own".into());
        let out: Result<u8, Error> = leak_result_of_retried(Err(leak()), Err(own));
        assert!(matches!(out, Err(Error::InvalidArgument(_))));
        let out: Result<u8, Error> = leak_result_of_retried(Ok(()), Err(oom()));
        assert!(out.unwrap_err().is_oom());
    }

    #[test]
    fn budget_bytes_take_integers_and_sizes() {
        assert_eq!(budget_bytes(-5_i32), 0);
        assert_eq!(budget_bytes(ByteSize::kib(2)), 2048);
        assert_eq!(budget_bytes(7_u8), 7);
        // past 64 bits: no limit, not a budget of 0 bytes (found by a hostile pass)
        assert_eq!(budget_bytes(1_u128 << 64), u64::MAX);
        assert_eq!(budget_bytes(i128::MIN), 0);
    }

    #[test]
    fn a_budget_refuses_beyond_its_bytes() {
        let dev = Device::sim(ByteSize::mib(64));
        let _b = budget(BudgetLimit::Bytes(1 << 20)).unwrap();
        assert!(dev.alloc::<u8>(512 << 10).is_ok());
        assert!(matches!(
            dev.alloc::<u8>(2 << 20),
            Err(Error::BudgetExceeded(_))
        ));
    }
}
