//! libtorch's CUDA allocator statistics (`c10::CachingDeviceAllocator::DeviceStats`), the figures
//! `torch.cuda.memory_stats()` returns.

/// One statistic: its value now, its peak since the last peak reset, and the totals added and
/// removed since the last reset of accumulated statistics.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stat {
    /// The value now.
    pub current: i64,
    /// The highest value since the last [`reset_peak_stats`](crate::cuda_allocator::reset_peak_stats).
    pub peak: i64,
    /// The total added since the last
    /// [`reset_accumulated_stats`](crate::cuda_allocator::reset_accumulated_stats).
    pub allocated: i64,
    /// The total removed since the last
    /// [`reset_accumulated_stats`](crate::cuda_allocator::reset_accumulated_stats).
    pub freed: i64,
}

/// A statistic over all pools and per pool: libtorch keeps requests of at most 1 MiB in a small
/// pool (2 MiB segments) and the rest in a large pool.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatArray {
    /// `[all pools, small pool, large pool]` (c10's `StatType` order).
    pub pools: [Stat; 3],
}

impl StatArray {
    /// Over both pools.
    pub fn all(&self) -> Stat {
        self.pools[0]
    }
    /// The small pool (requests of at most 1 MiB).
    pub fn small_pool(&self) -> Stat {
        self.pools[1]
    }
    /// The large pool.
    pub fn large_pool(&self) -> Stat {
        self.pools[2]
    }
}

/// libtorch 2.11's `DeviceStats` for one CUDA device, field for field (the shim copies it into
/// this `repr(C)` layout). Byte figures are in bytes, counts in allocations or segments.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceStats {
    /// Allocations handed to the program (count).
    pub allocation: StatArray,
    /// Segments reserved from CUDA (`cudaMalloc` calls, or expandable segments) (count).
    pub segment: StatArray,
    /// Active blocks: allocated, or freed but still in use by a stream (count).
    pub active: StatArray,
    /// Inactive blocks split from a segment still partly in use: cached but not releasable
    /// (count).
    pub inactive_split: StatArray,
    /// Bytes allocated to the program (block sizes, rounded up by the allocator).
    pub allocated_bytes: StatArray,
    /// Bytes reserved from CUDA: allocated plus cached.
    pub reserved_bytes: StatArray,
    /// Bytes in active blocks.
    pub active_bytes: StatArray,
    /// Bytes in inactive split blocks.
    pub inactive_split_bytes: StatArray,
    /// Bytes the program asked for (before rounding).
    pub requested_bytes: StatArray,
    /// Times an allocation failed in CUDA, the cache was released, and the allocation retried.
    pub num_alloc_retries: i64,
    /// Out-of-memory errors raised (after the retry).
    pub num_ooms: i64,
    /// Oversize blocks (at least `max_split_size`) allocated from the cache (count).
    pub oversize_allocations: Stat,
    /// Oversize segments reserved from CUDA (count).
    pub oversize_segments: Stat,
    /// Times the allocator synchronised every stream to free blocks.
    pub num_sync_all_streams: i64,
    /// Device allocation calls (`cudaMalloc`, or page maps of expandable segments).
    pub num_device_alloc: i64,
    /// Device free calls (`cudaFree`, or page unmaps).
    pub num_device_free: i64,
    /// The `max_split_size` in force (bytes; `usize::MAX` as `i64` when unlimited).
    pub max_split_size: i64,
}

impl DeviceStats {
    /// Bytes allocated to the program now and at peak, reserved now and at peak (the
    /// [`MemoryUsage`](oomguard::source::MemoryUsage) of a source), clamped at 0.
    pub fn usage(&self) -> oomguard::source::MemoryUsage {
        let b = |v: i64| u64::try_from(v).unwrap_or(0);
        oomguard::source::MemoryUsage {
            used: b(self.allocated_bytes.all().current),
            used_peak: b(self.allocated_bytes.all().peak),
            reserved: b(self.reserved_bytes.all().current),
            reserved_peak: b(self.reserved_bytes.all().peak),
        }
    }
}
