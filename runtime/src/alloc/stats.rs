//! Allocator statistics, as PyTorch's `torch.cuda.memory_stats()` keeps them.

/// One statistic: its current value, its peak since the last reset, and the totals added and
/// removed over the allocator's life.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stat {
    /// The value now.
    pub current: u64,
    /// The highest value since creation or [`crate::Device::reset_peak_stats`].
    pub peak: u64,
    /// Sum of all increases (wrapping after 2^64, as a counter of a long run may).
    pub allocated: u64,
    /// Sum of all decreases (wrapping after 2^64).
    pub freed: u64,
}

impl Stat {
    #[inline]
    pub(crate) fn add(&mut self, n: u64) {
        self.current += n;
        // the totals of a long run can pass 2^64: wrap (no debug-build panic, same code in release)
        self.allocated = self.allocated.wrapping_add(n);
        if self.current > self.peak {
            self.peak = self.current;
        }
    }
    #[inline]
    pub(crate) fn sub(&mut self, n: u64) {
        debug_assert!(
            self.current >= n,
            "stat underflow: {} - {}",
            self.current,
            n
        );
        self.current -= n;
        self.freed = self.freed.wrapping_add(n);
    }
    fn reset_peak(&mut self) {
        self.peak = self.current;
    }
    fn reset_accumulated(&mut self) {
        self.allocated = 0;
        self.freed = 0;
    }
}

/// A statistic for all memory and for each pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Both pools together.
    pub all: Stat,
    /// The small pool (requests of 1 MiB or less).
    pub small: Stat,
    /// The large pool.
    pub large: Stat,
}

impl PoolStats {
    #[inline]
    pub(crate) fn add(&mut self, small: bool, n: u64) {
        self.all.add(n);
        if small {
            self.small.add(n)
        } else {
            self.large.add(n)
        }
    }
    #[inline]
    pub(crate) fn sub(&mut self, small: bool, n: u64) {
        self.all.sub(n);
        if small {
            self.small.sub(n)
        } else {
            self.large.sub(n)
        }
    }
    fn reset_peak(&mut self) {
        self.all.reset_peak();
        self.small.reset_peak();
        self.large.reset_peak();
    }
    fn reset_accumulated(&mut self) {
        self.all.reset_accumulated();
        self.small.reset_accumulated();
        self.large.reset_accumulated();
    }
}

/// Everything the allocator counts. Byte figures are in bytes, counts in blocks or segments.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Bytes in allocated blocks (rounded sizes).
    pub allocated_bytes: PoolStats,
    /// Number of allocated blocks.
    pub allocation: PoolStats,
    /// Bytes held from the device: fixed segments plus mapped pages of growable segments.
    pub reserved_bytes: PoolStats,
    /// Number of segments (fixed segments and growable address ranges).
    pub segment: PoolStats,
    /// Bytes in active blocks: allocated, or freed but still awaiting another stream's work.
    pub active_bytes: PoolStats,
    /// Number of active blocks.
    pub active: PoolStats,
    /// Bytes callers asked for (before rounding) in allocated blocks.
    pub requested_bytes: PoolStats,
    /// Bytes in free blocks that cannot be returned to the device as they are (split segments).
    pub inactive_split_bytes: PoolStats,
    /// Number of such blocks.
    pub inactive_split: PoolStats,
    /// Times the device said out-of-memory and the allocator tried again: after waiting for
    /// pending cross-stream frees, draining the threads' caches and releasing its cache (except
    /// where [`MemoryStats::num_releases_skipped`] counts the release as skipped).
    pub num_alloc_retries: u64,
    /// Out-of-memory retries that kept the cache: the device's free memory plus what releasing
    /// would return (whole free pages and whole free segments) was less than the request, so
    /// releasing (a device-wide synchronisation, and pages that the next requests map again)
    /// could not have served it. PyTorch releases anyway.
    pub num_releases_skipped: u64,
    /// Out-of-memory errors returned to callers.
    pub num_ooms: u64,
    /// Step marks ([`crate::CachingAllocator::mark_step`]).
    pub num_step_marks: u64,
    /// Step plans installed: a step that moved pages was laid out once and its large blocks
    /// are served at fixed offsets of one mapped range from the next step on.
    pub num_plans_installed: u64,
    /// Step plans that could not be installed: the range of the layout's height could not be
    /// mapped (the memory limit, or the device refused it after every free page moved).
    pub num_plans_refused: u64,
    /// Of the plans installed, those shared at page granularity: the step's contiguous layout
    /// did not fit, so each planned request got an address range of its own, backed by pages
    /// that only requests never live at the same time share (`map_alias`).
    pub num_plans_shared: u64,
    /// Step plans dropped: two planned steps in a row had a miss, `empty_cache` was called, or a
    /// request ran out of memory outside the plan (its range then serves best fit as before).
    pub num_plans_dropped: u64,
    /// Large requests served at their planned offset.
    pub num_plan_hits: u64,
    /// Large requests of a planned step served outside the plan: another size or stream than
    /// the recorded step's request at that place, or the offset still held.
    pub num_plan_misses: u64,
    /// Times the allocator synchronised with all streams: once per `empty_cache` and per cache
    /// release on out-of-memory (PyTorch's `synchronize_and_free_events`), and before unmapping
    /// free pages under pressure.
    pub num_sync_all_streams: u64,
    /// Times the allocator waited for the streams of pages it moved (growable segments under
    /// pressure), rather than for the whole device.
    pub num_stream_syncs: u64,
    /// Successful backend calls that obtained memory: `alloc_segment` and `map`.
    pub num_device_alloc: u64,
    /// Backend calls that returned memory: `free_segment` and `unmap`.
    pub num_device_free: u64,
    /// `map` calls (growable segments).
    pub num_map: u64,
    /// `unmap` calls.
    pub num_unmap: u64,
    /// Bytes mapped over the allocator's life.
    pub mapped_bytes_total: u64,
    /// Bytes unmapped over the allocator's life.
    pub unmapped_bytes_total: u64,
    /// Allocations of at least `max_split_size`.
    pub oversize_allocations: Stat,
    /// Segments of at least `max_split_size`.
    pub oversize_segments: Stat,
    /// The configured `max_split_size` (`u64::MAX`: none).
    pub max_split_size: u64,
    /// The largest free block in the cache (mapped memory only).
    pub largest_free_block: u64,
    /// Bytes of pinned (page-locked) host memory held by live host buffers (CUDA devices only).
    pub pinned_bytes: Stat,
}

impl MemoryStats {
    /// Every per-pool statistic, for the resets below.
    fn pool_stats_mut(&mut self) -> [&mut PoolStats; 9] {
        [
            &mut self.allocated_bytes,
            &mut self.allocation,
            &mut self.reserved_bytes,
            &mut self.segment,
            &mut self.active_bytes,
            &mut self.active,
            &mut self.requested_bytes,
            &mut self.inactive_split_bytes,
            &mut self.inactive_split,
        ]
    }

    pub(crate) fn reset_peaks(&mut self) {
        for s in self.pool_stats_mut() {
            s.reset_peak();
        }
        self.oversize_allocations.reset_peak();
        self.oversize_segments.reset_peak();
        self.pinned_bytes.reset_peak();
    }

    /// PyTorch's `reset_accumulated_memory_stats`: the totals (`allocated`, `freed`) of every
    /// statistic and the event counters go to zero; current values and peaks stay.
    pub(crate) fn reset_accumulated(&mut self) {
        for s in self.pool_stats_mut() {
            s.reset_accumulated();
        }
        self.oversize_allocations.reset_accumulated();
        self.oversize_segments.reset_accumulated();
        self.pinned_bytes.reset_accumulated();
        self.num_alloc_retries = 0;
        self.num_releases_skipped = 0;
        self.num_ooms = 0;
        self.num_step_marks = 0;
        self.num_plans_installed = 0;
        self.num_plans_refused = 0;
        self.num_plans_shared = 0;
        self.num_plans_dropped = 0;
        self.num_plan_hits = 0;
        self.num_plan_misses = 0;
        self.num_sync_all_streams = 0;
        self.num_stream_syncs = 0;
        self.num_device_alloc = 0;
        self.num_device_free = 0;
        self.num_map = 0;
        self.num_unmap = 0;
        self.mapped_bytes_total = 0;
        self.unmapped_bytes_total = 0;
    }
}

/// One counter of a statistics scope, as rmm's `statistics_resource_adaptor::counter`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScopeCounter {
    /// Added minus removed while the scope was on top. Frees of allocations made before the
    /// scope count too, so this can be negative.
    pub value: i64,
    /// The highest `value` seen.
    pub peak: i64,
    /// Sum of everything added.
    pub total: i64,
}

// Saturating arithmetic throughout: counters of absurd sizes stop at the i64 range instead of
// overflowing (a panic in debug builds).
impl ScopeCounter {
    #[inline]
    fn add(&mut self, n: i64) {
        self.value = self.value.saturating_add(n);
        self.total = self.total.saturating_add(n);
        self.peak = self.peak.max(self.value);
    }
    #[inline]
    fn sub(&mut self, n: i64) {
        self.value = self.value.saturating_sub(n);
    }
    /// rmm's `add_counters_from_tracked_sub_block`: folds a popped inner scope into this one.
    fn fold(&mut self, inner: &ScopeCounter) {
        self.peak = self.peak.max(self.value.saturating_add(inner.peak));
        self.value = self.value.saturating_add(inner.value);
        self.total = self.total.saturating_add(inner.total);
    }
}

/// The counters of a statistics scope
/// ([`crate::CachingAllocator::push_statistics_scope`]): bytes *requested* and allocations,
/// counted as rmm's `statistics_resource_adaptor` counts them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScopeStats {
    /// Bytes requested (not rounded).
    pub bytes: ScopeCounter,
    /// Allocations.
    pub allocations: ScopeCounter,
}

impl ScopeStats {
    #[inline]
    pub(crate) fn allocated(&mut self, requested: u64) {
        self.bytes.add(i64::try_from(requested).unwrap_or(i64::MAX));
        self.allocations.add(1);
    }
    #[inline]
    pub(crate) fn freed(&mut self, requested: u64) {
        self.bytes.sub(i64::try_from(requested).unwrap_or(i64::MAX));
        self.allocations.sub(1);
    }
    pub(crate) fn fold(&mut self, inner: &ScopeStats) {
        self.bytes.fold(&inner.bytes);
        self.allocations.fold(&inner.allocations);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_tracks_peak_and_totals() {
        let mut s = PoolStats::default();
        s.add(true, 10);
        s.add(false, 5);
        s.sub(true, 10);
        assert_eq!(s.all.current, 5);
        assert_eq!(s.all.peak, 15);
        assert_eq!(s.small.allocated, 10);
        assert_eq!(s.small.freed, 10);
        assert_eq!(s.large.current, 5);
        s.reset_peak();
        assert_eq!(s.all.peak, 5);
    }
}
