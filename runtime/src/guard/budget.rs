//! Memory budgets: "watch `memory_allocated()`" as a hard limit that fails an allocation before
//! it reaches the allocator, and a device-wide cap like PyTorch's
//! `set_per_process_memory_fraction`.

use std::panic::Location;

use super::scope::ScopeGuard;
use crate::device::tracker::{Limit, ScopeKind};
use crate::device::Device;
use crate::error::Result;
use crate::ByteSize;

/// A memory budget: while it is alive, the bytes (block sizes) allocated on this device by this
/// thread inside the scope and still live may not exceed the limit. An allocation that would
/// exceed it fails with [`crate::Error::BudgetExceeded`] (an out-of-memory kind) before the allocator or
/// the device is touched.
///
/// - Nested budgets all apply: the tightest wins.
/// - Freeing a buffer allocated inside the scope credits it back, on whatever thread the buffer
///   is dropped; buffers allocated before the scope do not count.
/// - Other threads' allocations do not count, unless the budget is made device-wide
///   ([`MemoryBudget::device_wide`], [`Device::device_budget`]).
///
/// ```
/// use oomguard_runtime::{ByteSize, Device, Error};
/// let dev = Device::sim(ByteSize::gib(8));
/// let budget = dev.thread_budget(ByteSize::mib(1));
/// let a = dev.alloc::<u8>(512 << 10).unwrap();
/// let b = dev.alloc::<u8>(512 << 10).unwrap(); // exactly the rest: fits
/// let err = dev.alloc::<u8>(1).unwrap_err();
/// assert!(err.is_oom());
/// assert!(matches!(err, Error::BudgetExceeded(ref e) if e.limit == 1 << 20));
/// drop(a); // credited back
/// assert_eq!(budget.remaining(), 512 << 10);
/// # drop(b);
/// ```
///
/// Budgets count block sizes: a request is rounded up to a multiple of 512 bytes (more under
/// `roundup_power2_divisions`), and a cached block handed out whole may be larger than asked. The
/// check before the allocator uses the 512-byte rounding; when the block turns out larger and
/// breaks the budget, it goes straight back to the cache and the allocation fails all the same.
#[must_use = "the budget applies only while the guard is alive"]
pub struct MemoryBudget {
    guard: ScopeGuard,
    limit: u64,
}

impl MemoryBudget {
    /// Makes the budget count every thread's allocations on the device, not only this
    /// thread's. Allocations already counted stay counted.
    pub fn device_wide(mut self) -> Self {
        self.guard.make_wide();
        self
    }

    /// Whether every thread's allocations count.
    pub fn is_device_wide(&self) -> bool {
        self.guard.is_wide()
    }

    /// The limit in bytes.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Bytes counted against the budget now.
    pub fn used(&self) -> u64 {
        self.guard
            .scope
            .live
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Bytes that may still be allocated.
    pub fn remaining(&self) -> u64 {
        self.limit.saturating_sub(self.used())
    }

    /// The device the budget is on.
    pub fn device(&self) -> &Device {
        self.guard.device()
    }
}

impl std::fmt::Debug for MemoryBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryBudget")
            .field("limit", &ByteSize(self.limit))
            .field("used", &ByteSize(self.used()))
            .field("device_wide", &self.is_device_wide())
            .field("opened_at", &self.guard.scope.opened_at)
            .finish()
    }
}

impl Device {
    /// A budget of `limit` for this thread's allocations on this device, until the guard drops;
    /// see [`MemoryBudget`]. For every thread's allocations: [`Device::device_budget`] (or
    /// [`MemorySource::budget`](crate::source::MemorySource::budget), the same cap on any
    /// memory source).
    #[track_caller]
    pub fn thread_budget(&self, limit: impl Into<ByteSize>) -> MemoryBudget {
        let limit = limit.into().bytes();
        MemoryBudget {
            guard: ScopeGuard::open(
                self,
                ScopeKind::budget(Limit::Bytes(limit)),
                Location::caller(),
            ),
            limit,
        }
    }

    /// A budget of `limit` for this thread's allocations: renamed
    /// [`Device::thread_budget`], so that it no longer reads like the device-wide
    /// [`MemorySource::budget`](crate::source::MemorySource::budget) it shadows.
    #[deprecated(
        since = "0.1.0",
        note = "per thread: use `Device::thread_budget`; for every thread's allocations use \
                `Device::device_budget` (or `MemorySource::budget`)"
    )]
    #[track_caller]
    pub fn budget(&self, limit: impl Into<ByteSize>) -> MemoryBudget {
        self.thread_budget(limit)
    }

    /// A budget of `limit` for every thread's allocations on this device, until the guard
    /// drops: `device.thread_budget(limit).device_wide()`.
    ///
    /// ```
    /// use oomguard_runtime::{ByteSize, Device};
    /// let dev = Device::sim(ByteSize::gib(8));
    /// let _budget = dev.device_budget(ByteSize::mib(1));
    /// let d = dev.clone();
    /// let r = std::thread::spawn(move || d.alloc::<u8>(2 << 20).map(drop)).join().unwrap();
    /// assert!(r.unwrap_err().is_oom());
    /// ```
    #[track_caller]
    pub fn device_budget(&self, limit: impl Into<ByteSize>) -> MemoryBudget {
        self.thread_budget(limit).device_wide()
    }

    /// Caps the memory this device's allocator may hold at `fraction` of the device's capacity,
    /// as PyTorch's `torch.cuda.set_per_process_memory_fraction`: growing the cache past it
    /// fails with out-of-memory (after the cache is released and the allocation retried). Memory
    /// already held stays. `1.0` lifts the cap to the full capacity.
    ///
    /// Fails with [`crate::Error::InvalidArgument`] unless `0 <= fraction <= 1`; 0 allows
    /// nothing, as in PyTorch.
    ///
    /// ```
    /// use oomguard_runtime::{ByteSize, Device};
    /// let dev = Device::sim(ByteSize::gib(8));
    /// dev.set_memory_fraction(0.25).unwrap();
    /// assert!(dev.alloc::<u8>(3 << 30).unwrap_err().is_oom());
    /// assert!(dev.set_memory_fraction(1.5).is_err());
    /// ```
    pub fn set_memory_fraction(&self, fraction: f64) -> Result<()> {
        self.allocator().set_memory_fraction(fraction)
    }

    /// The fraction of the device's capacity the allocator may hold, as PyTorch's
    /// `torch.cuda.get_per_process_memory_fraction` (1.0 without a cap): from
    /// [`Device::set_memory_fraction`] or the `per_process_memory_fraction` config key.
    pub fn memory_fraction(&self) -> f64 {
        self.allocator().memory_fraction()
    }
}
