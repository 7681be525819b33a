//! Where device memory comes from: the [`MemorySource`] abstraction.
//!
//! oomguard guards and retries code whatever allocates its memory. Two sources implement it:
//! - [`Device`]: oomguard's caching allocator (memory handed out as [`crate::DeviceBuffer`]s);
//! - `DriverPool` (feature `cuda`): the CUDA driver's stream-ordered memory pool of a device,
//!   which `cuMemAllocAsync` draws from, and so cudarc's `CudaStream::alloc` and every candle
//!   tensor on CUDA. oomguard cannot see those allocations one by one; it reads and steers the
//!   pool (its used/reserved counters, trimming, a pool capped with `maxSize`).
//!
//! A source that can be neither configured nor capped from outside (cubecl's pools, which fall
//! back to `cuMemAlloc` when the pool refuses) can implement its budget with a `Ballast`
//! (feature `cuda`): device memory taken outside every pool so that only the budget stays free.
//!
//! What works over any source: [`MemorySource::usage`] and peaks, `empty_cache`,
//! `memory_summary`, a device-wide budget ([`MemorySource::budget`]), the coarse leak check and
//! peak scope of [`guards`] (by counters, not per allocation), and the retry engine
//! ([`crate::RetryEngine::run`] and `begin` take any source; the attribute macros reach every
//! registered one).
//! [`Device`] additionally has exact per-allocation, per-thread guards ([`crate::guard`]).
//!
//! ```
//! use oomguard_runtime::source::{MemorySource, guards::UsageLeakCheck};
//! use oomguard_runtime::{ByteSize, Device};
//! let dev = Device::sim(ByteSize::mib(64));
//! let check = UsageLeakCheck::new(&dev).unwrap();
//! let kept = dev.alloc::<u8>(1 << 20).unwrap();
//! let report = check.finish().unwrap();
//! assert_eq!(report.leaked_bytes, 1 << 20);
//! drop(kept);
//! assert_eq!(dev.usage().unwrap().used, 0);
//! ```

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use crate::error::Result;
use crate::guard::MemoryBudget;
use crate::Device;

#[cfg(feature = "cuda")]
mod ballast;
#[cfg(feature = "cuda")]
mod driver_pool;
pub mod guards;
mod install;
#[cfg(any(feature = "cuda", test))]
mod pool_state;

pub use crate::retry_report::Churn;
#[cfg(feature = "cuda")]
pub use ballast::{Ballast, BALLAST_PAGE};
#[cfg(feature = "cuda")]
pub use driver_pool::{DriverPool, DriverPoolBuilder};
pub use install::InstallSite;

/// Bytes in use and held by a memory source, now and at their peak (since the last
/// [`MemorySource::reset_peak`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryUsage {
    /// Bytes handed out to the program and not yet freed.
    pub used: u64,
    /// The most `used` has been.
    pub used_peak: u64,
    /// Bytes the source holds from the device (used plus cached).
    pub reserved: u64,
    /// The most `reserved` has been.
    pub reserved_peak: u64,
}

/// What a source is, for reports and for the key of remembered plans.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceInfo {
    /// The device's name (e.g. `"NVIDIA H100 80GB HBM3"`, `"sim"`).
    pub device_name: String,
    /// The device ordinal.
    pub ordinal: usize,
    /// The device's capacity in bytes.
    pub total_bytes: u64,
    /// What kind of source: `"caching allocator"` or `"driver pool"`.
    pub kind: &'static str,
}

impl fmt::Display for SourceInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} of device {} ({})",
            self.kind, self.ordinal, self.device_name
        )
    }
}

/// A source of device memory that oomguard can observe and steer.
///
/// Implemented by [`Device`] and, with the `cuda` feature, `DriverPool`. Implement it for another
/// allocator (e.g. a framework's own cache) to put it under the retry engine and the guards of
/// [`guards`].
pub trait MemorySource: Send + Sync + fmt::Debug + 'static {
    /// Which device and what kind of source.
    fn info(&self) -> SourceInfo;
    /// Bytes used and reserved, now and at peak. Sources whose frees are stream-ordered count
    /// a free once the device has run it: synchronise first for an exact figure.
    fn usage(&self) -> Result<MemoryUsage>;
    /// Bytes the source could still hand out with its cache empty: the device's free memory,
    /// capped by the source's own limit (an allocator memory limit, a pool's `maxSize`) and by
    /// the room left in the budgets open on it ([`MemorySource::budget`]). What
    /// [`find_max_batch`](crate::retry::find_max_batch) aims under.
    fn available(&self) -> Result<u64>;
    /// Resets the peaks of [`MemorySource::usage`] to the current values.
    fn reset_peak(&self) -> Result<()>;
    /// Returns cached, unused memory to the device (after waiting for pending frees).
    fn empty_cache(&self) -> Result<()>;
    /// Whether the retry engine empties this source's cache after an out-of-memory, before the
    /// next attempt (the default: PyTorch's `empty_cache` remedy, which gives a fixed-segment
    /// cache's whole free segments back for requests of other sizes). A source whose cache
    /// serves any request on its own answers `false`: oomguard's allocator with growable
    /// segments (the default) moves free pages to where a request needs them, so emptying would
    /// only unmap every free page for the next attempt to map again (on an H100, 172 GB unmapped
    /// in the first step of a VGG-16 loop split after two OOMs; docs/GPU.md run 54).
    fn retry_empties_cache(&self) -> bool {
        true
    }
    /// Times the source emptied its cache and retried an allocation under pressure (thrash
    /// detection); 0 for sources that cannot tell.
    fn alloc_retries(&self) -> u64 {
        0
    }
    /// The source's churn counters so far (thrash detection reads them around each step): work
    /// under pressure that a settled loop does not do, such as allocator retries, pages moved,
    /// synchronisations inside the allocator. The default counts allocator retries only
    /// ([`MemorySource::alloc_retries`]).
    fn churn(&self) -> Churn {
        Churn::retries(self.alloc_retries())
    }
    /// A readable table of the source's statistics.
    fn memory_summary(&self) -> String;
    /// Caps what the source hands out, device-wide (every thread), to `limit` bytes allocated
    /// while the returned guard lives. See each implementation for what exactly is capped.
    ///
    /// A `limit` of 0 is refused with [`crate::Error::InvalidArgument`] on every source (a
    /// driver pool cannot cap at 0 bytes: `maxSize = 0` means no cap); implementations should
    /// do the same. [`Device::thread_budget`] (a per-thread guard) takes 0 and refuses every
    /// allocation.
    ///
    /// `#[track_caller]` (every implementation inherits it): a budget that records where it
    /// was opened ([`crate::BudgetExceeded::opened_at`]) records the caller of this method,
    /// also through `dyn MemorySource`.
    #[track_caller]
    fn budget(&self, limit: u64) -> Result<SourceBudget>;
    /// Identity: two handles of one source return the same value.
    fn source_id(&self) -> usize;
    /// Waits until the device has run all work queued so far (so that stream-ordered frees are
    /// counted). A no-op for sources without stream-ordered frees.
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
    /// A training step starts (the retry engine calls it at the start of every step it runs on
    /// a source: `RetryEngine::run`, `run_step`, `begin`, and so every `train_step`):
    /// a source that can serve a repeating step from a fixed layout records and plans here
    /// ([`Device::mark_step`]). Default: nothing.
    fn mark_step(&self) {}
}

/// A device-wide budget on a [`MemorySource`], made by [`MemorySource::budget`]; lifted on drop.
#[must_use = "the budget is lifted when this guard is dropped"]
pub struct SourceBudget {
    limit: u64,
    source: SourceInfo,
    // What lifts the budget when dropped (a MemoryBudget, or the restore of a driver pool).
    _lift: Box<dyn std::any::Any>,
}

impl SourceBudget {
    /// A budget of `limit` bytes on `source`, lifted when `lift` is dropped (for implementors of
    /// [`MemorySource`]).
    pub fn new(limit: u64, source: SourceInfo, lift: Box<dyn std::any::Any>) -> Self {
        Self {
            limit,
            source,
            _lift: lift,
        }
    }
    /// The limit in bytes.
    pub fn limit(&self) -> u64 {
        self.limit
    }
    /// The source it caps.
    pub fn source(&self) -> &SourceInfo {
        &self.source
    }
}

impl fmt::Debug for SourceBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SourceBudget")
            .field("limit", &self.limit)
            .field("source", &self.source)
            .finish()
    }
}

impl MemorySource for Device {
    fn info(&self) -> SourceInfo {
        SourceInfo {
            device_name: self.name(),
            ordinal: self.ordinal(),
            total_bytes: self.allocator().device_total(),
            kind: "caching allocator",
        }
    }
    fn usage(&self) -> Result<MemoryUsage> {
        let s = self.stats();
        Ok(MemoryUsage {
            used: s.allocated_bytes.all.current,
            used_peak: s.allocated_bytes.all.peak,
            reserved: s.reserved_bytes.all.current,
            reserved_peak: s.reserved_bytes.all.peak,
        })
    }
    /// The device's free memory, capped by the allocator's memory limit
    /// ([`Device::set_memory_fraction`]) and by the room left in every budget that applies to
    /// an allocation of the calling thread: device-wide ones ([`Device::device_budget`],
    /// [`MemorySource::budget`]) and the thread's own ([`Device::thread_budget`]).
    fn available(&self) -> Result<u64> {
        let free = self.mem_info()?.free;
        let mut room = match self.allocator().memory_limit() {
            Some(limit) => free.min(limit.saturating_sub(self.usage()?.reserved)),
            None => free,
        };
        if let Some(budget) = self.tracker().budget_room(self.allocator().device_total()) {
            room = room.min(budget);
        }
        Ok(room)
    }
    fn reset_peak(&self) -> Result<()> {
        Device::reset_peak_stats(self);
        Ok(())
    }
    fn empty_cache(&self) -> Result<()> {
        Device::empty_cache(self)
    }
    /// `false` with growable segments (their free pages move to any request), `true` with
    /// fixed segments.
    fn retry_empties_cache(&self) -> bool {
        !self.allocator().uses_growable_segments()
    }
    fn alloc_retries(&self) -> u64 {
        self.allocator().num_alloc_retries()
    }
    /// From the allocator's statistics: `num_alloc_retries`, `num_unmap`,
    /// `unmapped_bytes_total`, `num_sync_all_streams + num_stream_syncs`. Pages mapped
    /// (`num_map`) are not churn: a loop maps what it needs once, then settles.
    fn churn(&self) -> Churn {
        let [alloc_retries, unmaps, unmapped_bytes, syncs] = self.allocator().churn_counters();
        Churn {
            alloc_retries,
            unmaps,
            unmapped_bytes,
            syncs,
        }
    }
    fn memory_summary(&self) -> String {
        Device::memory_summary(self)
    }
    /// [`Device::mark_step`]: the step's large requests are recorded, and a step that moved
    /// pages is served from a fixed layout from the next step on.
    fn mark_step(&self) {
        Device::mark_step(self)
    }
    /// A device-wide [`MemoryBudget`] (every thread's allocations while it lives).
    /// A limit of 0 is refused (as on every source; [`Device::thread_budget`] takes 0).
    fn budget(&self, limit: u64) -> Result<SourceBudget> {
        if limit == 0 {
            return Err(zero_budget());
        }
        let b: MemoryBudget = self.device_budget(limit);
        Ok(SourceBudget::new(limit, self.info(), Box::new(b)))
    }
    fn source_id(&self) -> usize {
        self.identity()
    }
}

/// `budget(0)` on a source: refused on every source (a driver pool's `maxSize = 0` means no
/// cap at all, so it cannot mean "nothing may be allocated").
pub(crate) fn zero_budget() -> crate::Error {
    crate::Error::InvalidArgument(
        "a budget of 0 bytes: MemorySource::budget needs a limit of at least 1 byte (a driver \
         pool cannot cap at 0: maxSize 0 means no cap; to refuse every allocation on a Device, \
         use Device::thread_budget(0))"
            .into(),
    )
}

/// Registered sources other than [`Device`]s (devices have their own registry, [`Device::all`]).
static SOURCES: Mutex<Vec<Weak<dyn MemorySource>>> = Mutex::new(Vec::new());

fn sources() -> MutexGuard<'static, Vec<Weak<dyn MemorySource>>> {
    // Only pushes and retains happen under the lock: a poisoned list is still a valid list.
    SOURCES.lock().unwrap_or_else(|e| e.into_inner())
}

/// Registers `source` so that code holding no handle (the attribute macros' retries, which empty
/// every source's cache and watch every source for thrashing) reaches it. Held weakly: it
/// leaves the registry when its last `Arc` is dropped. `DriverPool`s register themselves.
pub fn register(source: &Arc<dyn MemorySource>) {
    let mut all = sources();
    all.retain(|w| w.strong_count() > 0);
    if !all
        .iter()
        .filter_map(Weak::upgrade)
        .any(|s| s.source_id() == source.source_id())
    {
        all.push(Arc::downgrade(source));
    }
}

/// The registered sources other than devices (e.g. the driver pools candle allocates from).
pub fn registered() -> Vec<Arc<dyn MemorySource>> {
    sources().iter().filter_map(Weak::upgrade).collect()
}

/// Every live source: every [`Device`] and every registered source.
pub fn all() -> Vec<Arc<dyn MemorySource>> {
    let mut v: Vec<Arc<dyn MemorySource>> = Device::all()
        .into_iter()
        .map(|d| Arc::new(d) as Arc<dyn MemorySource>)
        .collect();
    v.extend(sources().iter().filter_map(Weak::upgrade));
    v
}

/// A shared source is a source (so `Arc<dyn MemorySource>` from a registry or an integration
/// crate can be handed to the retry engine and the guards).
impl<T: MemorySource + ?Sized> MemorySource for Arc<T> {
    fn info(&self) -> SourceInfo {
        (**self).info()
    }
    fn usage(&self) -> Result<MemoryUsage> {
        (**self).usage()
    }
    fn available(&self) -> Result<u64> {
        (**self).available()
    }
    fn reset_peak(&self) -> Result<()> {
        (**self).reset_peak()
    }
    fn empty_cache(&self) -> Result<()> {
        (**self).empty_cache()
    }
    fn retry_empties_cache(&self) -> bool {
        (**self).retry_empties_cache()
    }
    fn alloc_retries(&self) -> u64 {
        (**self).alloc_retries()
    }
    fn churn(&self) -> Churn {
        (**self).churn()
    }
    fn memory_summary(&self) -> String {
        (**self).memory_summary()
    }
    fn budget(&self, limit: u64) -> Result<SourceBudget> {
        (**self).budget(limit)
    }
    fn source_id(&self) -> usize {
        (**self).source_id()
    }
    fn synchronize(&self) -> Result<()> {
        (**self).synchronize()
    }
    fn mark_step(&self) {
        (**self).mark_step()
    }
}
