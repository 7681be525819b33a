//! What a memory budget's refusal says: the budget's limit in the error, and a count of its
//! own in `memory_summary` (the allocator's `OOMs` keeps PyTorch's meaning).

use oomguard_runtime::guard::{thread_budget, thread_budget_fraction};
use oomguard_runtime::retry::RetryEngine;
use oomguard_runtime::{ByteSize, Device, Error};

const MIB: u64 = 1 << 20;

fn budget_error(e: Error) -> oomguard_runtime::BudgetExceeded {
    match e {
        Error::BudgetExceeded(b) => b,
        other => panic!("not a budget's refusal: {other}"),
    }
}

/// A refusal names the limit of the budget that refused, whichever kind it is: a budget's
/// limit is known whenever it refuses (a scope without a limit never refuses), so the limit
/// is never reported as 0. This held before too (checked, not a fix): the error path was
/// reached only with a limit.
#[test]
fn a_refusal_names_the_limit_of_the_budget_that_refused() {
    let dev = Device::sim(ByteSize::mib(64));
    // a scope without a limit (a peak scope) below a byte budget
    let _peak = dev.peak_scope();
    {
        let _b = dev.thread_budget(ByteSize::mib(8));
        let e = budget_error(dev.alloc::<u8>(16 << 20).unwrap_err());
        assert_eq!((e.requested, e.limit), (16 * MIB, 8 * MIB), "{e}");
    }
    {
        let _b = thread_budget(ByteSize::mib(4));
        let e = budget_error(dev.alloc::<u8>(5 << 20).unwrap_err());
        assert_eq!(e.limit, 4 * MIB, "{e}");
    }
    {
        let _b = thread_budget_fraction(0.25).unwrap();
        let e = budget_error(dev.alloc::<u8>(17 << 20).unwrap_err());
        assert_eq!(e.limit, 16 * MIB, "{e}");
    }
}

/// A budget refused two allocations that the retry engine's report counts as out-of-memory;
/// the summary says so on a line of its own, and `OOMs` stays the allocator's count (0 here:
/// the allocator never failed). Before: the table said only `OOMs: 0`.
#[test]
fn the_summary_counts_budget_refusals() {
    let dev = Device::sim(ByteSize::mib(64));
    let _budget = dev.thread_budget(ByteSize::mib(6));
    let out = RetryEngine::new()
        .run(
            &dev,
            16,
            |plan| {
                for c in plan.chunks() {
                    dev.alloc::<u8>(c.len() << 20)?;
                }
                Ok::<_, Error>(())
            },
            |()| (),
        )
        .unwrap();
    let ooms = out.report.attempts.len();
    assert_eq!(ooms, 2, "{}", out.report); // 16 rows, 2 × 8 refused; 4 × 4 fit
    assert_eq!(dev.stats().num_ooms, 0);
    assert_eq!(dev.budget_refusals(), ooms as u64);
    let s = dev.memory_summary();
    assert!(s.contains("OOMs: 0"), "{s}");
    assert!(s.contains(&format!("budget refusals: {ooms} ")), "{s}");
    assert!(s.contains("not counted in OOMs"), "{s}");
    // every line keeps the table's width
    assert!(s.lines().all(|l| l.chars().count() == 93), "{s}");
    dev.reset_accumulated_memory_stats();
    assert_eq!(dev.budget_refusals(), 0);
    assert!(dev.memory_summary().contains("budget refusals: 0 "));
}

/// A fraction was kept in millionths: 4e-7 of an 80 GiB card (about 34 KiB) became a budget of
/// 0 bytes that refused everything (found by a hostile pass of the API). Now kept to 2^-53; a
/// fraction smaller than that is an error, not a budget of 0.
#[test]
fn a_small_fraction_is_a_small_budget_not_zero() {
    let dev = Device::sim(ByteSize::gib(80));
    {
        let _b = thread_budget_fraction(4e-7).unwrap();
        let _fits = dev.alloc::<u8>(1024).unwrap();
        let e = budget_error(dev.alloc::<u8>(64 << 10).unwrap_err());
        let expected = (4e-7 * (80u64 << 30) as f64) as u64;
        assert!(e.limit.abs_diff(expected) <= 1, "{e}");
    }
    let e = thread_budget_fraction(1e-300).unwrap_err();
    assert!(e.to_string().contains("below 2^-53"), "{e}");
}

/// A refusal says where the budget that refused was opened (the guard's call), so that among
/// nested budgets the one to raise is known: here the outer, tighter one refuses a request the
/// inner one would allow. Before, the error named only the sizes.
#[test]
fn a_refusal_names_where_its_budget_was_opened() {
    let dev = Device::sim(ByteSize::mib(64));
    let outer_line = line!() + 1;
    let _outer = dev.thread_budget(ByteSize::mib(8));
    let inner_line = line!() + 1;
    let _inner = thread_budget(ByteSize::mib(32));
    let e = budget_error(dev.alloc::<u8>(16 << 20).unwrap_err());
    let at = e.opened_at.expect("the refusing budget's site");
    assert_eq!((at.file(), at.line()), (file!(), outer_line), "{e}");
    assert_ne!(at.line(), inner_line, "{e}");
    let text = e.to_string();
    assert!(
        text.ends_with(&format!(
            "budget already in use (the budget opened at {}:{outer_line}:{})",
            file!(),
            at.column()
        )),
        "{text}"
    );
    // the inner budget refuses what passes the outer one's room but not its own
    drop(_outer);
    let e = budget_error(dev.alloc::<u8>(33 << 20).unwrap_err());
    assert_eq!(e.opened_at.map(|a| a.line()), Some(inner_line), "{e}");
}

/// A device-wide budget opened through `dyn MemorySource` names its caller too (the trait's
/// method is `#[track_caller]`), not a line inside oomguard.
#[test]
fn a_source_budget_refusal_names_its_caller() {
    use oomguard_runtime::MemorySource;
    let dev = Device::sim(ByteSize::mib(64));
    let src: std::sync::Arc<dyn MemorySource> = std::sync::Arc::new(dev.clone());
    let line = line!() + 1;
    let _b = src.budget(8 << 20).unwrap();
    let e = budget_error(dev.alloc::<u8>(16 << 20).unwrap_err());
    let at = e.opened_at.expect("the budget's site");
    assert_eq!((at.file(), at.line()), (file!(), line), "{e}");
}
