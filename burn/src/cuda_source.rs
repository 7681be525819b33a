//! The memory of burn's CUDA backend (cubecl-cuda 0.10) as a [`MemorySource`] (feature `cuda`).
//!
//! cubecl keeps its own pools of pages and reserves each page with `cuMemAllocAsync` on its
//! stream, that is from the device's current driver memory pool (cubecl-cuda uses the primary
//! context, as oomguard's [`DriverPool::current`] does). oomguard cannot see cubecl's
//! allocations one by one: it reads both layers' counters.

use burn::backend::cuda::CudaDevice;
use burn::backend::Cuda;
use burn::cubecl::cuda::CudaRuntime;
use burn::cubecl::Runtime;
use burn::tensor::backend::Backend;
use oomguard::source::{DriverPool, MemorySource, MemoryUsage, SourceBudget, SourceInfo};

/// The memory of one CUDA device under burn's CUDA backend: cubecl's pools over the driver's
/// memory pool. Cheap to clone. Made by [`memory_source`](crate::memory_source).
///
/// - usage: the driver pool's counters ([`DriverPool`]): `used` is what cubecl holds as pages
///   (its reserved memory: what runs out), with the driver's exact high-water mark as the peak;
///   `reserved` adds the pool's cache. cubecl's own in-use bytes are in
///   [`CubeCudaSource::cubecl_usage`] and the summary.
/// - `empty_cache`: `Backend::memory_cleanup` (cubecl frees its unused pages), a sync so that
///   the cleanup has run, then the driver pool is trimmed.
/// - `budget`: refused, see [`MemorySource::budget`] below.
///
/// What is missed: pages cubecl allocates with `cuMemAlloc` after `cuMemAllocAsync` failed (its
/// fallback) are outside the pool and not counted.
#[derive(Clone, Debug)]
pub struct CubeCudaSource {
    device: CudaDevice,
    pool: DriverPool,
}

impl CubeCudaSource {
    /// The source of `device` (an error, never a panic, without a CUDA driver).
    pub fn new(device: &CudaDevice) -> oomguard::Result<Self> {
        Ok(Self {
            device: device.clone(),
            pool: DriverPool::current(device.index)?,
        })
    }

    /// cubecl's counters for this device: bytes in use by tensors, their padding, and bytes
    /// reserved as pages (cubecl 0.10 keeps no peak).
    pub fn cubecl_usage(&self) -> oomguard::Result<burn::cubecl::MemoryUsage> {
        CudaRuntime::client(&self.device)
            .memory_usage()
            .map_err(|e| oomguard::Error::InvalidArgument(format!("cubecl memory_usage: {e}")))
    }
}

impl MemorySource for CubeCudaSource {
    fn info(&self) -> SourceInfo {
        SourceInfo {
            kind: "cubecl pools on the driver pool",
            ..self.pool.info()
        }
    }
    fn usage(&self) -> oomguard::Result<MemoryUsage> {
        self.pool.usage()
    }
    fn available(&self) -> oomguard::Result<u64> {
        self.pool.available()
    }
    fn reset_peak(&self) -> oomguard::Result<()> {
        self.pool.reset_peak()
    }
    fn empty_cache(&self) -> oomguard::Result<()> {
        <Cuda as Backend>::memory_cleanup(&self.device);
        self.synchronize()?;
        self.pool.empty_cache()
    }
    fn memory_summary(&self) -> String {
        let mut s = self.pool.memory_summary();
        match self.cubecl_usage() {
            Ok(u) => {
                s += &format!(
                    "| cubecl: in use {}, padding {}, reserved {} ({} allocations) |\n",
                    oomguard::ByteSize(u.bytes_in_use),
                    oomguard::ByteSize(u.bytes_padding),
                    oomguard::ByteSize(u.bytes_reserved),
                    u.number_allocs
                )
            }
            Err(e) => s += &format!("| cubecl: unavailable: {e} |\n"),
        }
        s
    }
    /// Refused: nothing caps cubecl-cuda 0.10's memory at run time. A capped driver pool (what
    /// [`DriverPool::budget`] installs) does not hold: when `cuMemAllocAsync` fails, cubecl
    /// retries the page with `cuMemAlloc`, outside every pool; and cubecl's memory
    /// configuration (page sizes, pools) is read once, when the device's client is created, and
    /// has no total limit. Use `find_max_batch` and the retry engine instead.
    fn budget(&self, limit: u64) -> oomguard::Result<SourceBudget> {
        Err(oomguard::Error::InvalidArgument(format!(
            "a budget of {limit} bytes cannot be enforced on burn's CUDA backend: cubecl-cuda \
             0.10 falls back from cuMemAllocAsync to cuMemAlloc, outside any capped pool, and \
             its memory configuration has no run-time limit"
        )))
    }
    fn source_id(&self) -> usize {
        0x2000_0000 + self.device.index
    }
    fn synchronize(&self) -> oomguard::Result<()> {
        <Cuda as Backend>::sync(&self.device)
            .map_err(|e| oomguard::Error::InvalidArgument(format!("burn sync: {e}")))
    }
}
