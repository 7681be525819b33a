//! Peak scopes: the peak memory of a region of code, as RMM's push/pop statistics counters.

use std::panic::Location;
use std::sync::atomic::Ordering::Relaxed;

use super::scope::ScopeGuard;
use crate::device::tracker::ScopeKind;
use crate::device::Device;
use crate::ByteSize;

/// Measures the bytes (block sizes) allocated on this device by this thread inside the scope:
/// their peak while live, what is live now, and how many allocations were made. Buffers
/// allocated before the scope count neither while live nor when freed.
///
/// Scopes nest as RMM's statistics stack: each sees its own peak, and a parent's figures include
/// its children's allocations. The figures are readable while the scope is open.
///
/// What differs from rmm's `statistics_resource_adaptor`, on purpose (a peak scope measures the
/// memory a region takes, as PyTorch's `max_memory_allocated` does):
/// - bytes are block sizes, not requested bytes: two allocations of 1,000 bytes count 2,048
///   (each rounded to 512 bytes);
/// - only this thread's allocations made inside the scope count, and freeing a buffer
///   allocated before it subtracts nothing (rmm's values can go negative).
///
/// A buffer of the scope freed on another thread while this thread allocates counts as live
/// until this thread's allocation is charged: when the two meet in the allocator the peak
/// includes both; it may also include both when the other thread's free reached the allocator
/// just before the allocation did (never below the true peak; above it by at most the buffer
/// being freed at that instant).
///
/// An allocation of 0 bytes counts in [`PeakScope::allocations`], as rmm counts it, and takes
/// no bytes (it is never live). For rmm's exact counters (requested bytes, every thread, frees
/// of earlier allocations), use the allocator's statistics scopes
/// ([`CachingAllocator::push_statistics_scope`](crate::CachingAllocator::push_statistics_scope)).
///
/// ```
/// use oomguard_runtime::{ByteSize, Device};
/// let dev = Device::sim(ByteSize::gib(1));
/// let outer = dev.peak_scope();
/// let a = dev.alloc::<u8>(4096).unwrap();
/// {
///     let inner = dev.peak_scope();
///     let b = dev.alloc::<u8>(1024).unwrap();
///     drop(b);
///     assert_eq!(inner.peak_bytes(), 1024);
///     assert_eq!(inner.current_bytes(), 0);
/// }
/// assert_eq!(outer.peak_bytes(), 4096 + 1024);
/// assert_eq!(outer.current_bytes(), 4096);
/// assert_eq!(outer.allocations(), 2);
/// # drop(a);
/// ```
#[must_use = "the scope measures only while the guard is alive"]
pub struct PeakScope {
    guard: ScopeGuard,
}

impl PeakScope {
    /// The highest number of live bytes allocated inside the scope so far.
    pub fn peak_bytes(&self) -> u64 {
        self.guard.scope.peak.load(Relaxed)
    }

    /// Bytes allocated inside the scope and live now.
    pub fn current_bytes(&self) -> u64 {
        self.guard.scope.live.load(Relaxed)
    }

    /// Allocations made inside the scope (those of 0 bytes included).
    pub fn allocations(&self) -> u64 {
        self.guard.scope.allocations.load(Relaxed)
    }

    /// Allocations made inside the scope and live now.
    pub fn live_allocations(&self) -> u64 {
        self.guard.scope.live_allocations.load(Relaxed)
    }

    /// Lowers the peak to the current live bytes (to measure the next phase).
    pub fn reset_peak(&self) {
        let s = &self.guard.scope;
        s.peak.store(s.live.load(Relaxed), Relaxed);
    }

    /// The device it measures.
    pub fn device(&self) -> &Device {
        self.guard.device()
    }
}

impl std::fmt::Debug for PeakScope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeakScope")
            .field("peak", &ByteSize(self.peak_bytes()))
            .field("current", &ByteSize(self.current_bytes()))
            .field("allocations", &self.allocations())
            .field("opened_at", &self.guard.scope.opened_at)
            .finish()
    }
}

impl Device {
    /// A peak-memory scope on this device for this thread's allocations; see [`PeakScope`].
    #[track_caller]
    pub fn peak_scope(&self) -> PeakScope {
        PeakScope {
            guard: ScopeGuard::open(self, ScopeKind::PEAK, Location::caller()),
        }
    }
}
