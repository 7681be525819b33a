//! Scoped guards: restored on panic, nesting, threads, budget boundaries, leak locations, peaks.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc;
use std::thread;

use oomguard_runtime::backend::sim::SimDevice;
use oomguard_runtime::{
    is_grad_enabled, is_inference_mode, no_grad, with_no_grad, AllocatorConfig, ByteSize, Device,
    Error, LeakAction, MemoryStats,
};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

fn dev() -> Device {
    Device::sim(ByteSize::gib(8))
}

/// Fixed segments (PyTorch's native allocator), where a cached block can be handed out whole.
fn native_dev() -> Device {
    Device::new(SimDevice::new(ByteSize::gib(8)), AllocatorConfig::native())
}

fn budget_err(e: Error) -> oomguard_runtime::BudgetExceeded {
    match e {
        Error::BudgetExceeded(b) => b,
        other => panic!("expected BudgetExceeded, got {other:?}"),
    }
}

// ---------------------------------------------------------------- grad mode

#[test]
fn grad_mode_restored_after_panic_in_closure_and_guard() {
    let r = catch_unwind(|| with_no_grad(|| -> () { panic!("in no_grad") }));
    assert!(r.is_err());
    assert!(is_grad_enabled());
    let r = catch_unwind(|| {
        let _g = oomguard_runtime::inference_mode();
        let _h = no_grad();
        panic!("in inference mode")
    });
    assert!(r.is_err());
    assert!(is_grad_enabled() && !is_inference_mode());
}

// ---------------------------------------------------------------- empty-cache guard

#[test]
fn empty_cache_guard_runs_on_unwind() {
    let d = dev();
    let r = catch_unwind(AssertUnwindSafe(|| {
        let _g = d.empty_cache_guard();
        let _x = d.zeros::<u8>(MIB as usize).unwrap();
        panic!("step failed");
    }));
    assert!(r.is_err());
    assert_eq!(d.stats().reserved_bytes.all.current, 0);
}

#[test]
fn empty_cache_guard_threshold() {
    let d = native_dev();
    let keep = d.alloc::<u8>(1000).unwrap(); // live: its segment stays either way
    {
        let _g = d.empty_cache_guard().above(ByteSize::mib(8));
        let _x = d.alloc::<u8>(6 * MIB as usize).unwrap(); // a 20 MiB segment, cached on drop
    }
    // 2 MiB + 20 MiB reserved, 1 KiB allocated: above 8 MiB cached, so emptied.
    assert_eq!(d.stats().reserved_bytes.all.current, 2 * MIB);
    {
        let _g = d.empty_cache_guard().above(ByteSize::mib(30));
        let _x = d.alloc::<u8>(6 * MIB as usize).unwrap();
    }
    // 20 MiB cached is not above 30 MiB: kept.
    assert_eq!(d.stats().reserved_bytes.all.current, 22 * MIB);
    drop(keep);
}

// ---------------------------------------------------------------- budgets

#[test]
fn budget_boundary_byte() {
    let d = dev();
    let b = d.thread_budget(ByteSize::mib(1));
    let x = d.alloc::<u8>((MIB - 512) as usize).unwrap();
    assert_eq!(b.remaining(), 512);
    // One more block than remains fails, before the allocator is touched.
    let before: MemoryStats = d.stats();
    let e = budget_err(d.alloc::<u8>(513).unwrap_err());
    assert_eq!((e.requested, e.in_use, e.limit), (1024, MIB - 512, MIB));
    let after = d.stats();
    assert_eq!(
        after.allocation.all.allocated,
        before.allocation.all.allocated
    );
    assert_eq!(after.num_ooms, before.num_ooms);
    // Exactly the remaining bytes succeed.
    let y = d.alloc::<u8>(512).unwrap();
    assert_eq!(b.used(), MIB);
    assert!(d.alloc::<u8>(1).unwrap_err().is_oom());
    drop((x, y));
    assert_eq!(b.used(), 0);
}

#[test]
fn budget_fails_before_touching_the_device() {
    let d = dev();
    let _b = d.thread_budget(ByteSize::mib(1));
    let e = d.alloc::<u8>(4 * MIB as usize).unwrap_err();
    assert!(e.is_oom(), "{e}");
    assert!(e.to_string().contains("memory budget exceeded"), "{e}");
    let s = d.stats();
    assert_eq!(s.num_device_alloc, 0);
    assert_eq!(s.reserved_bytes.all.current, 0);
    assert_eq!(s.allocation.all.allocated, 0);
}

#[test]
fn budget_counts_whole_blocks_larger_than_the_request() {
    // A cached 20 MiB block is handed out whole for a 19.5 MiB request (the rest is too small to
    // split off): the block, not the request, is checked against the budget.
    let d = native_dev();
    drop(d.alloc::<u8>(6 * MIB as usize).unwrap()); // leaves a free 20 MiB block in the cache
    let reserved = d.stats().reserved_bytes.all.current;
    let b = d.thread_budget(ByteSize::b(19 * MIB + 768 * KIB));
    let e = budget_err(d.alloc::<u8>((19 * MIB + 512 * KIB) as usize).unwrap_err());
    assert_eq!(e.requested, 20 * MIB);
    assert_eq!(e.in_use, 0);
    assert_eq!(b.used(), 0);
    let s = d.stats();
    assert_eq!(s.allocated_bytes.all.current, 0, "the block went back");
    assert_eq!(s.reserved_bytes.all.current, reserved, "no device traffic");
    drop(b);
    let x = d.alloc::<u8>((19 * MIB + 512 * KIB) as usize).unwrap();
    assert_eq!(x.allocation().size, 20 * MIB);
}

#[test]
fn nested_budgets_tightest_wins_and_frees_credit() {
    let d = dev();
    let outer = d.thread_budget(ByteSize::mib(4));
    let a = d.alloc::<u8>(2 * MIB as usize).unwrap();
    {
        let inner = d.thread_budget(ByteSize::mib(8)); // looser than what the outer has left
        let e = budget_err(d.alloc::<u8>(3 * MIB as usize).unwrap_err());
        assert_eq!(e.limit, 4 * MIB, "the outer budget is the tightest");
        let b = d.alloc::<u8>(2 * MIB as usize).unwrap();
        assert_eq!((inner.used(), outer.used()), (2 * MIB, 4 * MIB));
        drop(b);
        assert_eq!((inner.used(), outer.used()), (0, 2 * MIB));
        let tight = d.thread_budget(ByteSize::kib(64));
        assert_eq!(
            budget_err(d.alloc::<u8>(65 * KIB as usize).unwrap_err()).limit,
            64 * KIB
        );
        drop(tight);
    }
    drop(a);
    assert_eq!(outer.used(), 0);
}

#[test]
fn allocations_before_the_budget_do_not_count() {
    let d = dev();
    let before = d.alloc::<u8>(4 * MIB as usize).unwrap();
    let b = d.thread_budget(ByteSize::mib(1));
    drop(before); // freeing it does not credit the budget either
    assert_eq!(b.used(), 0);
    let x = d.alloc::<u8>(MIB as usize).unwrap();
    assert_eq!(b.remaining(), 0);
    drop(x);
}

#[test]
fn budget_restored_after_panic() {
    let d = dev();
    let r = catch_unwind(AssertUnwindSafe(|| {
        let _b = d.thread_budget(ByteSize::kib(1));
        let _x = d.alloc::<u8>(1024).unwrap();
        panic!("boom");
    }));
    assert!(r.is_err());
    let big = d.alloc::<u8>(4 * MIB as usize);
    assert!(big.is_ok(), "budget still applied after unwinding");
}

#[test]
fn free_on_another_thread_and_after_scope_end_credits_safely() {
    let d = dev();
    let b = d.thread_budget(ByteSize::mib(2));
    let x = d.alloc::<u8>(MIB as usize).unwrap();
    let y = d.alloc::<u8>(MIB as usize).unwrap();
    thread::spawn(move || drop(x)).join().unwrap();
    assert_eq!(b.used(), MIB);
    drop(b);
    drop(y); // freed after the scope ended
    let b2 = d.thread_budget(ByteSize::mib(2));
    assert_eq!(b2.used(), 0);
    let z = d.alloc::<u8>(2 * MIB as usize).unwrap();
    assert_eq!(b2.remaining(), 0);
    drop(z);
    assert_eq!(d.stats().allocated_bytes.all.current, 0);
}

#[test]
fn budgets_are_per_thread_unless_device_wide() {
    let d = dev();
    let b = d.thread_budget(ByteSize::mib(1));
    let d2 = d.clone();
    let other = thread::spawn(move || d2.alloc::<u8>(4 * MIB as usize).map(drop))
        .join()
        .unwrap();
    assert!(other.is_ok(), "another thread's allocation was limited");
    assert_eq!(b.used(), 0);

    let wide = b.device_wide();
    assert!(wide.is_device_wide());
    let d2 = d.clone();
    let other = thread::spawn(move || d2.alloc::<u8>(4 * MIB as usize).map(drop))
        .join()
        .unwrap();
    assert!(other.unwrap_err().is_oom());
    // Another thread's live allocation counts against a device-wide budget.
    let d2 = d.clone();
    let held = thread::spawn(move || d2.alloc::<u8>(512 * KIB as usize).unwrap())
        .join()
        .unwrap();
    assert_eq!(wide.used(), 512 * KIB);
    drop(held);
    assert_eq!(wide.used(), 0);
}

#[test]
fn guards_on_several_threads_at_once() {
    let d = dev();
    let handles: Vec<_> = (1..=4u64)
        .map(|i| {
            let d = d.clone();
            thread::spawn(move || {
                let b = d.thread_budget(ByteSize::mib(i));
                let p = d.peak_scope();
                let mut held = Vec::new();
                for _ in 0..i * 4 {
                    held.push(d.alloc::<u8>(256 * KIB as usize).unwrap());
                }
                assert_eq!(b.remaining(), 0);
                assert!(d.alloc::<u8>(1).unwrap_err().is_oom());
                held.clear();
                (p.peak_bytes(), p.allocations(), b.used())
            })
        })
        .collect();
    for (i, h) in (1..=4u64).zip(handles) {
        assert_eq!(h.join().unwrap(), (i * MIB, i * 4, 0));
    }
}

#[test]
fn device_wide_budget_under_concurrency_never_exceeded() {
    let d = dev();
    let wide = d.device_budget(ByteSize::mib(4));
    let (tx, rx) = mpsc::channel();
    let handles: Vec<_> = (0..4)
        .map(|_| {
            let (d, tx) = (d.clone(), tx.clone());
            thread::spawn(move || {
                let mut held = Vec::new();
                for _ in 0..16 {
                    if let Ok(b) = d.alloc::<u8>(256 * KIB as usize) {
                        held.push(b);
                    }
                }
                tx.send(held).unwrap();
            })
        })
        .collect();
    drop(tx);
    for h in handles {
        h.join().unwrap();
    }
    let held: Vec<_> = rx.iter().flatten().collect();
    assert_eq!(held.len(), 16, "exactly the budget's worth succeeded");
    assert_eq!(wide.used(), 4 * MIB);
    drop(held);
    assert_eq!(wide.used(), 0);
}

#[test]
fn budgets_are_per_device() {
    let (a, b) = (dev(), dev());
    let _budget = a.thread_budget(ByteSize::kib(1));
    assert!(b.alloc::<u8>(MIB as usize).is_ok());
    assert!(a.alloc::<u8>(MIB as usize).is_err());
}

#[test]
fn memory_fraction() {
    let d = dev();
    // (0 is accepted, as in PyTorch: runtime/tests/conformance.rs)
    for bad in [-0.5, 1.01, f64::NAN, f64::INFINITY] {
        let e = d.set_memory_fraction(bad).unwrap_err();
        assert!(e.to_string().contains("memory fraction"), "{e}");
    }
    assert_eq!(d.allocator().memory_limit(), None);
    d.set_memory_fraction(0.25).unwrap();
    assert_eq!(d.allocator().memory_limit(), Some(2 << 30));
    let e = d.alloc::<u8>(3 << 30).unwrap_err();
    assert!(matches!(e, Error::Oom(_)), "{e}");
    assert!(d.alloc::<u8>(1 << 30).is_ok());
    d.set_memory_fraction(1.0).unwrap();
    assert!(d.alloc::<u8>(3 << 30).is_ok());
}

// ---------------------------------------------------------------- leak checks

#[test]
fn leak_reported_with_file_and_line() {
    let d = dev();
    let check = d.leak_check();
    let freed = d.alloc::<u8>(4096).unwrap();
    let kept = d.zeros::<f32>(300).unwrap();
    let line = line!() - 1;
    let raw = d.alloc_raw(5000, 0).unwrap();
    let raw_line = line!() - 1;
    drop(freed);
    let r = check.finish().unwrap_err();
    assert_eq!(r.leaks.len(), 2);
    assert_eq!(r.leaks[0].location.file(), file!());
    assert_eq!(r.leaks[0].location.line(), line);
    assert_eq!((r.leaks[0].size, r.leaks[0].requested), (1536, 1200));
    assert_eq!(r.leaks[1].location.line(), raw_line);
    assert_eq!(r.total_bytes, 1536 + 5120);
    let text = r.to_string();
    assert!(text.contains(&format!("{}:{line}:", file!())), "{text}");
    assert!(text.contains("2 buffer(s)"), "{text}");
    // the line alone may be a shared helper: the report says how to get each caller
    assert!(text.contains("OOMGUARD_LEAK_BACKTRACE=1"), "{text}");
    drop(kept);
    d.free_raw(raw).unwrap();
}

#[test]
fn a_leak_with_backtraces_does_not_ask_for_them() {
    let d = dev();
    let check = d.leak_check().with_backtraces();
    let kept = d.alloc::<u8>(4096).unwrap();
    let r = check.finish().unwrap_err();
    let text = r.to_string();
    if r.leaks[0].backtrace.is_some() {
        assert!(!text.contains("OOMGUARD_LEAK_BACKTRACE"), "{text}");
    } else {
        // a platform without backtraces: the hint stays
        assert!(text.contains("OOMGUARD_LEAK_BACKTRACE"), "{text}");
    }
    drop(kept);
}

#[test]
fn no_leak_when_freed_and_before_scope_not_counted() {
    let d = dev();
    let before = d.alloc::<u8>(1000).unwrap();
    let check = d.leak_check();
    let x = d.from_slice(&[1u32, 2, 3]).unwrap();
    drop(x);
    let y = d.alloc::<u8>(100).unwrap();
    thread::spawn(move || drop(y)).join().unwrap(); // freed on another thread
    check.finish().unwrap();
    drop(before);
}

#[test]
fn leak_panics_by_default_and_not_while_panicking() {
    let d = dev();
    let mut kept = Vec::new();
    let r = catch_unwind(AssertUnwindSafe(|| {
        let _c = d.leak_check();
        kept.push(d.alloc::<u8>(10).unwrap());
    }));
    let p = r.unwrap_err();
    assert!(p.downcast_ref::<String>().unwrap().contains("still live"));
    // Already panicking: the original panic comes through, no abort.
    let r = catch_unwind(AssertUnwindSafe(|| {
        let _c = d.leak_check();
        kept.push(d.alloc::<u8>(10).unwrap());
        panic!("original");
    }));
    assert_eq!(*r.unwrap_err().downcast_ref::<&str>().unwrap(), "original");
}

#[test]
fn leak_warn_report_and_allowance() {
    let d = dev();
    let mut kept = Vec::new();
    {
        let _c = d.leak_check().on_leak(LeakAction::Warn);
        kept.push(d.alloc::<u8>(10).unwrap());
    } // warns, does not panic
    {
        let c = d.leak_check().on_leak(LeakAction::Report);
        kept.push(d.alloc::<u8>(10).unwrap());
        assert_eq!(c.report().leaks.len(), 1);
    } // nothing on drop
    let c = d.leak_check().allow(ByteSize::kib(1));
    kept.push(d.alloc::<u8>(1024).unwrap());
    assert!(c.report().leaks.len() == 1 && !c.report().exceeds_allowance());
    kept.push(d.alloc::<u8>(1).unwrap());
    let r = c.finish().unwrap_err();
    assert_eq!((r.total_bytes, r.allowed_bytes), (1536, 1024));
}

#[test]
fn nested_leak_checks_and_other_threads() {
    let d = dev();
    let outer = d.leak_check();
    let inner = d.leak_check();
    let a = d.alloc::<u8>(10).unwrap();
    let d2 = d.clone();
    let other = thread::spawn(move || d2.alloc::<u8>(10).unwrap())
        .join()
        .unwrap();
    assert_eq!(inner.finish().unwrap_err().leaks.len(), 1);
    let r = outer.finish().unwrap_err();
    assert_eq!(
        r.leaks.len(),
        1,
        "the other thread's buffer is not this thread's leak"
    );
    assert_eq!(r.leaks[0].ptr, a.device_ptr());
    drop((a, other));
}

#[test]
fn leak_backtraces_on_request() {
    let d = dev();
    let c = d.leak_check().with_backtraces();
    let x = d.alloc::<u8>(10).unwrap();
    let r = c.finish().unwrap_err();
    assert!(r.leaks[0].backtrace.is_some());
    assert!(r.to_string().contains("backtrace:"));
    drop(x);
}

// ---------------------------------------------------------------- peak scopes

#[test]
fn peak_scopes_nest() {
    let d = dev();
    let before = d.alloc::<u8>(8 * MIB as usize).unwrap();
    let outer = d.peak_scope();
    let a = d.alloc::<u8>(MIB as usize).unwrap();
    {
        let inner = d.peak_scope();
        let b = d.alloc::<u8>(2 * MIB as usize).unwrap();
        let c = d.alloc::<u8>(3 * MIB as usize).unwrap();
        drop(b);
        assert_eq!(inner.peak_bytes(), 5 * MIB);
        assert_eq!(inner.current_bytes(), 3 * MIB);
        drop(c);
        assert_eq!((inner.allocations(), inner.live_allocations()), (2, 0));
        inner.reset_peak();
        assert_eq!(inner.peak_bytes(), 0);
    }
    drop(before); // allocated before the scope: not counted
    assert_eq!(outer.peak_bytes(), 6 * MIB);
    assert_eq!(outer.current_bytes(), MIB);
    assert_eq!((outer.allocations(), outer.live_allocations()), (3, 1));
    {
        let sibling = d.peak_scope();
        let e = d.alloc::<u8>(512 * KIB as usize).unwrap();
        drop(e);
        assert_eq!(sibling.peak_bytes(), 512 * KIB);
    }
    assert_eq!(
        outer.peak_bytes(),
        6 * MIB,
        "the sibling stayed below the outer peak"
    );
    drop(a);
    assert_eq!(outer.current_bytes(), 0);
}

#[test]
fn peak_scope_ignores_other_threads_and_survives_panic() {
    let d = dev();
    let p = d.peak_scope();
    let d2 = d.clone();
    thread::spawn(move || drop(d2.alloc::<u8>(MIB as usize).unwrap()))
        .join()
        .unwrap();
    assert_eq!(p.allocations(), 0);
    let r = catch_unwind(AssertUnwindSafe(|| {
        let _inner = d.peak_scope();
        let _x = d.alloc::<u8>(MIB as usize).unwrap();
        panic!("boom");
    }));
    assert!(r.is_err());
    assert_eq!((p.peak_bytes(), p.current_bytes()), (MIB, 0));
}

#[test]
fn allocator_history_sees_the_callers_line_through_a_guard() {
    let d = dev();
    d.allocator().record_history(16, true);
    let _p = d.peak_scope();
    let x = d.alloc::<u8>(100).unwrap();
    let line = line!() - 1;
    let alloc = d
        .allocator()
        .history()
        .into_iter()
        .find(|e| e.action == oomguard_runtime::alloc::TraceAction::Alloc)
        .unwrap();
    assert_eq!(alloc.frames[0].filename, file!());
    assert_eq!(alloc.frames[0].line, line);
    drop(x);
}

/// `Device::thread_budget` caps this thread's allocations; the device-wide cap is
/// `MemorySource::budget` (and `Device::device_budget`): two names for two meanings (issue 26).
#[test]
fn thread_budget_is_per_thread_and_the_source_budget_device_wide() {
    use oomguard_runtime::source::MemorySource;
    let d = Device::sim(ByteSize::gib(1));
    let other = |d: &Device| {
        let d = d.clone();
        std::thread::spawn(move || d.alloc::<u8>(2 << 20).map(drop))
            .join()
            .unwrap()
    };
    {
        let _b = d.thread_budget(ByteSize::mib(1));
        assert!(d.alloc::<u8>(2 << 20).unwrap_err().is_oom());
        assert!(other(&d).is_ok(), "another thread is not capped");
    }
    let _b = MemorySource::budget(&d, 1 << 20).unwrap();
    assert!(d.alloc::<u8>(2 << 20).unwrap_err().is_oom());
    assert!(other(&d).unwrap_err().is_oom(), "every thread is capped");
}

/// A clean leak check says so; the advice about what is still alive comes only with a leak.
#[test]
fn a_clean_leak_check_does_not_claim_a_leak() {
    use oomguard_runtime::source::guards::UsageLeakCheck;
    let d = Device::sim(ByteSize::gib(1));
    let check = UsageLeakCheck::new(&d).unwrap();
    drop(d.alloc::<u8>(1 << 20).unwrap());
    let clean = check.finish().unwrap();
    assert!(!clean.exceeds_allowance());
    let text = clean.to_string();
    assert!(!text.contains("still alive"), "{text}");
    assert!(text.contains("no leak"), "{text}");
    let check = UsageLeakCheck::new(&d).unwrap();
    let kept = d.alloc::<u8>(1 << 20).unwrap();
    let leak = check.finish().unwrap();
    assert!(leak.to_string().contains("still alive"), "{leak}");
    drop(kept);
    // the per-allocation check of a Device, too
    let check = d.leak_check();
    let text = check.report().to_string();
    assert!(text.contains("no leak"), "{text}");
    check.finish().unwrap();
}
