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
use std::sync::Mutex;

use oomguard::source::{Ballast, DriverPool, MemorySource, MemoryUsage, SourceBudget, SourceInfo};

/// The memory of one CUDA device under burn's CUDA backend: cubecl's pools over the driver's
/// memory pool. Cheap to clone. Made by [`memory_source`](crate::memory_source).
///
/// - usage: the driver pool's counters ([`DriverPool`]): `used` is what cubecl holds as pages
///   (its reserved memory: what runs out), with the driver's exact high-water mark as the peak;
///   `reserved` adds the pool's cache. cubecl's own in-use bytes are in
///   [`CubeCudaSource::cubecl_usage`] and the summary.
/// - `empty_cache`: `Backend::memory_cleanup` (cubecl frees its unused pages), a sync so that
///   the cleanup has run, then the driver pool is trimmed.
/// - `budget`: a [`Ballast`] that leaves only the budget free on the device, see
///   [`MemorySource::budget`] below.
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
    /// Caps cubecl's memory on this device at `limit` bytes with a [`Ballast`]: cubecl's unused
    /// pages are freed and the pool trimmed (as [`MemorySource::empty_cache`]), then the device's
    /// free memory beyond `limit − held` (`held`: what cubecl still holds, its live tensors'
    /// pages) is taken outside every pool, until the returned guard is dropped. A reservation
    /// of cubecl past the limit then fails in the driver (both its `cuMemAllocAsync` and its
    /// `cuMemAlloc` fallback) and surfaces as cubecl's out-of-memory, which [`crate::catch_oom`],
    /// `train_step` and the retry engine handle.
    ///
    /// Why a ballast: cubecl-cuda 0.10 reads its memory configuration once, when the device's
    /// client is made, with no total limit, and when a capped driver pool refuses a page it
    /// retries with `cuMemAlloc`, outside every pool; the device's free memory is the one thing
    /// both paths draw from.
    ///
    /// What it caps is the device's free memory as seen from this process, so:
    /// - anything else that allocates on the device while the budget lives (other libraries,
    ///   kernels loaded, another framework, other processes) draws from the same room, and other
    ///   processes that free memory widen it;
    /// - the limit holds to within [`BALLAST_PAGE`](oomguard::source::BALLAST_PAGE) (2 MiB, the
    ///   driver's page), for what cubecl holds in the pool: pages it took with its `cuMemAlloc`
    ///   fallback before the budget are outside the pool, not counted in what it holds, and
    ///   stay on top of the limit until cubecl frees them;
    /// - one budget at a time per device: a second while one lives is refused (the ballasts of
    ///   two could not be dropped in any order and keep the tighter cap);
    /// - refused: 0 (as on every source), and a limit at or below what cubecl holds after the
    ///   cleanup.
    fn budget(&self, limit: u64) -> oomguard::Result<SourceBudget> {
        if limit == 0 {
            return Err(oomguard::Error::InvalidArgument(
                "a budget of 0 bytes: cubecl could not hold even its live tensors".into(),
            ));
        }
        let claim = BudgetClaim::take(self.device.index)?;
        self.empty_cache()?;
        let held = self.pool.usage()?.reserved;
        if limit <= held {
            return Err(oomguard::Error::InvalidArgument(format!(
                "a budget of {} on burn's CUDA device {}: cubecl already holds {} (its live \
                 tensors' pages, after freeing the unused ones)",
                oomguard::ByteSize(limit),
                self.device.index,
                oomguard::ByteSize(held)
            )));
        }
        let ballast = Ballast::leave_free(self.pool.context(), limit - held)?;
        Ok(SourceBudget::new(
            limit,
            self.info(),
            Box::new((ballast, claim)),
        ))
    }
    fn source_id(&self) -> usize {
        0x2000_0000 + self.device.index
    }
    fn synchronize(&self) -> oomguard::Result<()> {
        <Cuda as Backend>::sync(&self.device)
            .map_err(|e| oomguard::Error::InvalidArgument(format!("burn sync: {e}")))
    }
}

/// Devices with a live cubecl budget (one at a time per device).
static BUDGETED: Mutex<Vec<usize>> = Mutex::new(Vec::new());

/// A device's one budget slot, released on drop (after the ballast it guards: see the tuple's
/// drop order in `budget`).
#[derive(Debug)]
struct BudgetClaim(usize);

impl BudgetClaim {
    fn take(ordinal: usize) -> oomguard::Result<Self> {
        let mut set = BUDGETED.lock().unwrap_or_else(|e| e.into_inner());
        if set.contains(&ordinal) {
            return Err(oomguard::Error::InvalidArgument(format!(
                "a budget is already in force on burn's CUDA device {ordinal}: drop it first \
                 (one budget at a time per device)"
            )));
        }
        set.push(ordinal);
        Ok(Self(ordinal))
    }
}

impl Drop for BudgetClaim {
    fn drop(&mut self) {
        BUDGETED
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|&o| o != self.0);
    }
}
