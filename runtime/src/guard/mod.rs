//! Scoped guards: the folk remedies for GPU memory as RAII values that hold even when the code
//! panics. Every guard is `#[must_use]` and restores the previous state (or does its work) on
//! drop, also while unwinding.
//!
//! | folk remedy | guard |
//! | --- | --- |
//! | wrap inference in `torch.no_grad()` | [`no_grad`], [`inference_mode`], [`with_no_grad`] |
//! | `del x; torch.cuda.empty_cache()` | [`Device::empty_cache_guard`](crate::Device::empty_cache_guard) ([`EmptyCacheOnDrop`]) |
//! | watch `memory_allocated()` | [`Device::thread_budget`](crate::Device::thread_budget) ([`MemoryBudget`]), [`Device::set_memory_fraction`](crate::Device::set_memory_fraction) |
//! | don't keep tensors alive | [`Device::leak_check`](crate::Device::leak_check) ([`LeakCheck`]) |
//! | `max_memory_allocated()` around a region | [`Device::peak_scope`](crate::Device::peak_scope) ([`PeakScope`]) |
//!
//! The memory guards (budget, leak check, peak scope) are charged by the allocations of the
//! thread that opened them, on their device, from their opening to their drop (budgets can be
//! made device-wide). Accounting lives in the device's allocation path; with no guard open it
//! costs one relaxed atomic load per allocation and per free. Free buffers through the device
//! (dropping a [`DeviceBuffer`](crate::DeviceBuffer), or
//! [`Device::free_raw`](crate::Device::free_raw)), not through the allocator directly, so that
//! guards see it. The memory guards are not `Send`: drop them on the thread that made them.
//!
//! **Not across an `.await`.** A guard held across an `.await` in async code charges every task
//! the executor runs on that thread meanwhile: another task's allocation is refused by a budget
//! it never opened, and a leak check reports another task's buffers. Open and drop the guards
//! between two `.await`s. (On an `async fn` the attribute macros hold their guards during each
//! poll of its future; a plain `fn` returning `impl Future` is refused: its guards would end
//! when the future is made, before it runs.)
//!
//! ```
//! use oomguard_runtime::{no_grad, ByteSize, Device};
//! let dev = Device::sim(ByteSize::gib(1));
//! let _budget = dev.thread_budget(ByteSize::mib(64));
//! let peak = dev.peak_scope();
//! let leaks = dev.leak_check();
//! {
//!     let _g = no_grad();
//!     let _tmp = dev.zeros::<f32>(1 << 20).unwrap();
//! }
//! assert_eq!(peak.peak_bytes(), 4 << 20);
//! leaks.finish().unwrap(); // nothing left live
//! ```

mod budget;
mod empty_cache;
mod grad;
mod leak;
mod peak;
mod scope;
mod thread;

pub use crate::leak_report::{LeakReport, LeakedBuffer};
pub use budget::MemoryBudget;
pub use empty_cache::EmptyCacheOnDrop;
pub use grad::{
    enable_grad, inference_mode, is_grad_enabled, is_inference_mode, no_grad, set_grad_enabled,
    set_grad_mode_guard, with_grad_enabled, with_inference_mode, with_no_grad, GradGuard, GradMode,
};
pub use leak::{LeakAction, LeakCheck};
pub use peak::PeakScope;
pub use thread::{
    thread_budget, thread_budget_fraction, thread_leak_check, thread_leak_check_with_budget,
    thread_leak_check_with_budget_fraction, GuardSet, Scoped, ThreadBudget, ThreadLeakCheck,
};

#[cfg(test)]
mod tests {
    use crate::{ByteSize, Device};
    use std::panic::{catch_unwind, AssertUnwindSafe};

    #[test]
    fn fast_path_when_no_guard() {
        let dev = Device::sim(ByteSize::gib(1));
        let t = dev.tracker();
        assert!(!t.own_scopes_open() && !t.tracking());
        let before = dev.alloc::<u8>(100).unwrap();
        {
            let _p = dev.peak_scope();
            assert!(t.own_scopes_open());
            drop(before); // allocated before: never recorded
            assert!(!t.tracking());
            let x = dev.alloc::<u8>(100).unwrap();
            assert!(t.tracking());
            drop(x);
            assert!(!t.tracking());
        }
        assert!(!t.own_scopes_open());
    }

    #[test]
    fn every_scope_closes_on_unwind() {
        let dev = Device::sim(ByteSize::gib(1));
        let r = catch_unwind(AssertUnwindSafe(|| {
            let _b = dev.thread_budget(ByteSize::mib(1)).device_wide();
            let _c = dev.thread_budget(ByteSize::mib(1));
            let _p = dev.peak_scope();
            let _l = dev.leak_check();
            let _e = dev.empty_cache_guard();
            let _x = dev.zeros::<u8>(1000).unwrap();
            panic!("boom");
        }));
        assert!(r.is_err());
        let t = dev.tracker();
        assert!(!t.own_scopes_open(), "a scope stayed open");
        assert!(!t.tracking(), "a record outlived its buffer");
        assert_eq!(
            dev.stats().reserved_bytes.all.current,
            0,
            "cache not emptied"
        );
        // Nothing limits or records any more.
        let big = dev.alloc::<u8>(4 << 20).unwrap();
        assert!(!t.tracking());
        drop(big);
    }

    #[test]
    fn leak_panic_in_drop_still_closes_scope() {
        let dev = Device::sim(ByteSize::gib(1));
        let kept = std::cell::RefCell::new(Vec::new());
        let r = catch_unwind(AssertUnwindSafe(|| {
            let _l = dev.leak_check();
            kept.borrow_mut().push(dev.zeros::<u8>(10).unwrap());
        }));
        let msg = r.unwrap_err();
        let msg = msg
            .downcast_ref::<String>()
            .expect("a formatted panic message");
        assert!(msg.contains("1 buffer(s)"), "{msg}");
        assert!(!dev.tracker().own_scopes_open());
        drop(kept);
        assert!(!dev.tracker().tracking());
    }

    #[test]
    fn stale_record_is_credited_when_address_reused() {
        // A buffer freed through the allocator directly bypasses the guards; the record it left
        // is credited when its address is handed out again, not leaked forever.
        let dev = Device::sim(ByteSize::gib(1));
        let p = dev.peak_scope();
        let a = dev.alloc_raw(1000, 0).unwrap();
        dev.allocator().free(a).unwrap();
        assert_eq!(p.current_bytes(), 1024);
        let b = dev.alloc_raw(1000, 0).unwrap();
        assert_eq!(b.ptr, a.ptr);
        assert_eq!(p.current_bytes(), 1024);
        // The stale handle cannot uncount the live allocation at the same address.
        assert!(dev.free_raw(a).is_err());
        assert_eq!(p.current_bytes(), 1024);
        dev.free_raw(b).unwrap();
        assert_eq!(p.current_bytes(), 0);
        assert_eq!(p.live_allocations(), 0);
    }
}
