//! The CUDA driver's stream-ordered memory pool as a [`MemorySource`]: what `cuMemAllocAsync`
//! draws from, so what cudarc's `CudaStream::alloc` and candle's CUDA tensors use.
#![allow(unsafe_code)] // FFI: every unsafe block calls the CUDA driver's pool API and says why

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::{result, sys, CudaContext};

use super::{MemorySource, MemoryUsage, SourceBudget, SourceInfo};
use crate::backend::cuda::{driver_error, loader};
use crate::backend::{BackendError, BackendErrorKind};
use crate::error::{Error, Result};
use crate::ByteSize;

/// The memory pool `cuMemAllocAsync` uses on a CUDA device (its *current* pool), observed and
/// steered through the driver's pool attributes. Cheap to clone.
///
/// - usage: `USED_MEM_CURRENT/HIGH` and `RESERVED_MEM_CURRENT/HIGH` of the device's current pool;
/// - `empty_cache`: synchronise the context, then `cuMemPoolTrimTo(pool, 0)`;
/// - `budget(n)`: a new pool with `maxSize = n` made the device's current pool while the guard
///   lives (see [`MemorySource::budget`] below for exactly what it caps);
/// - [`DriverPoolBuilder`]: a capped pool installed for the whole run, before the framework
///   allocates.
///
/// ```no_run
/// use oomguard_runtime::source::{DriverPool, MemorySource};
/// let pool = DriverPool::current(0)?; // what candle's Device::new_cuda(0) allocates from
/// println!("{}", pool.memory_summary());
/// # Ok::<(), oomguard_runtime::Error>(())
/// ```
#[derive(Clone)]
pub struct DriverPool {
    inner: Arc<PoolInner>,
}

struct PoolInner {
    ctx: Arc<CudaContext>,
    name: String,
    total: u64,
    /// The cap of the device's current pool when oomguard installed it (`maxSize`), and the
    /// lock that serialises installs and restores of the current pool.
    install: Mutex<Option<u64>>,
}

fn lock(m: &Mutex<Option<u64>>) -> MutexGuard<'_, Option<u64>> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl fmt::Debug for DriverPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DriverPool")
            .field("ordinal", &self.inner.ctx.ordinal())
            .field("name", &self.inner.name)
            .finish()
    }
}

fn unavailable(op: &'static str, m: impl Into<String>) -> Error {
    Error::Backend(BackendError::new(
        BackendErrorKind::Unavailable,
        op,
        m.into(),
    ))
}

fn drv(op: &'static str) -> impl FnOnce(result::DriverError) -> Error {
    move |e| Error::Backend(driver_error(op, e))
}

/// A memory pool handle with the device's id, for the attribute calls.
#[derive(Clone, Copy)]
struct PoolHandle(sys::CUmemoryPool);

impl PoolHandle {
    fn attr(self, a: sys::CUmemPool_attribute) -> Result<u64> {
        let mut v: u64 = 0;
        // SAFETY: the pool is a live pool of the device (the current or a created one, never
        // destroyed while a handle is used); the four byte-count attributes and the release
        // threshold are `cuuint64_t`, which `v` is.
        unsafe { result::mem_pool::get_attribute(self.0, a, (&mut v as *mut u64).cast()) }
            .map_err(drv("cuMemPoolGetAttribute"))?;
        Ok(v)
    }
    fn set_attr(self, a: sys::CUmemPool_attribute, mut v: u64) -> Result<()> {
        // SAFETY: as in `attr`; the attributes set here (high-water marks, release threshold)
        // take a `cuuint64_t`.
        unsafe { result::mem_pool::set_attribute(self.0, a, (&mut v as *mut u64).cast()) }
            .map_err(drv("cuMemPoolSetAttribute"))
    }
}

use sys::CUmemPool_attribute::{
    CU_MEMPOOL_ATTR_RELEASE_THRESHOLD as RELEASE_THRESHOLD,
    CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT as RESERVED_CURRENT,
    CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH as RESERVED_HIGH,
    CU_MEMPOOL_ATTR_USED_MEM_CURRENT as USED_CURRENT, CU_MEMPOOL_ATTR_USED_MEM_HIGH as USED_HIGH,
};

impl DriverPool {
    /// The pool of CUDA device `ordinal` (its primary context, the one candle and cudarc's
    /// `CudaContext::new` use). Returns an error, never panics, without a driver or device.
    pub fn current(ordinal: usize) -> Result<Self> {
        loader::probe()?;
        loader::probe_with(loader::LIBRARY_NAMES, POOL_SYMBOLS)?;
        let ctx = std::panic::catch_unwind(|| CudaContext::new(ordinal))
            .map_err(|_| unavailable("cuInit", "the CUDA driver could not be used"))?
            .map_err(drv("cuDevicePrimaryCtxRetain"))?;
        Self::of_context(&ctx)
    }

    /// The pool of the device of `ctx` (e.g. candle's `CudaDevice::cuda_stream().context()`).
    pub fn of_context(ctx: &Arc<CudaContext>) -> Result<Self> {
        ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        let name = ctx.name().map_err(drv("cuDeviceGetName"))?;
        // SAFETY: the device handle comes from a live context.
        let total = unsafe { result::device::total_mem(ctx.cu_device()) }
            .map_err(drv("cuDeviceTotalMem"))?;
        let pool = Self {
            inner: Arc::new(PoolInner {
                ctx: ctx.clone(),
                name,
                total: total as u64,
                install: Mutex::new(None),
            }),
        };
        // The registry holds sources weakly: keep one handle per device for the process.
        let mut kept = REGISTERED.lock().unwrap_or_else(|e| e.into_inner());
        if !kept.iter().any(|s| s.source_id() == pool.source_id()) {
            let source: Arc<dyn MemorySource> = Arc::new(pool.clone());
            super::register(&source);
            kept.push(source);
        }
        Ok(pool)
    }

    /// A builder for a new pool on device `ordinal`, installed as the device's current pool.
    pub fn builder(ordinal: usize) -> DriverPoolBuilder {
        DriverPoolBuilder {
            ordinal,
            max_size: None,
            release_threshold: Some(u64::MAX),
        }
    }

    /// The cudarc context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.inner.ctx
    }

    fn current_handle(&self) -> Result<PoolHandle> {
        self.inner
            .ctx
            .bind_to_thread()
            .map_err(drv("cuCtxSetCurrent"))?;
        // SAFETY: the device handle comes from a live context.
        let p = unsafe { result::device::get_mem_pool(self.inner.ctx.cu_device()) }
            .map_err(drv("cuDeviceGetMemPool"))?;
        Ok(PoolHandle(p))
    }

    /// Unused bytes the current pool keeps cached across synchronisations (`RELEASE_THRESHOLD`).
    pub fn release_threshold(&self) -> Result<u64> {
        self.current_handle()?.attr(RELEASE_THRESHOLD)
    }

    /// Sets how many unused bytes the current pool keeps across synchronisations (the driver's
    /// default, 0, returns memory at every synchronisation: slow; RMM and this crate's builder
    /// use the maximum).
    pub fn set_release_threshold(&self, bytes: u64) -> Result<()> {
        self.current_handle()?.set_attr(RELEASE_THRESHOLD, bytes)
    }
}

/// The driver's pool entry points (CUDA 11.2+), checked before cudarc is called.
const POOL_SYMBOLS: &[&str] = &[
    "cuDeviceGetMemPool",
    "cuDeviceSetMemPool",
    "cuMemPoolCreate",
    "cuMemPoolDestroy",
    "cuMemPoolTrimTo",
    "cuMemPoolGetAttribute",
    "cuMemPoolSetAttribute",
];

/// Sources made by [`DriverPool::of_context`], kept for the process (one per device at most).
static REGISTERED: Mutex<Vec<Arc<dyn MemorySource>>> = Mutex::new(Vec::new());

impl MemorySource for DriverPool {
    fn info(&self) -> SourceInfo {
        SourceInfo {
            device_name: self.inner.name.clone(),
            ordinal: self.inner.ctx.ordinal(),
            total_bytes: self.inner.total,
            kind: "driver pool",
        }
    }

    /// The counters of the device's *current* pool (after a [`MemorySource::budget`], the
    /// capped pool's).
    fn usage(&self) -> Result<MemoryUsage> {
        let p = self.current_handle()?;
        Ok(MemoryUsage {
            used: p.attr(USED_CURRENT)?,
            used_peak: p.attr(USED_HIGH)?,
            reserved: p.attr(RESERVED_CURRENT)?,
            reserved_peak: p.attr(RESERVED_HIGH)?,
        })
    }

    /// The device's free memory plus what the current pool caches unused, capped by the
    /// `maxSize` oomguard installed (a builder's or a budget's) less what is in use.
    fn available(&self) -> Result<u64> {
        self.inner
            .ctx
            .bind_to_thread()
            .map_err(drv("cuCtxSetCurrent"))?;
        let (free, _total) = result::mem_get_info().map_err(drv("cuMemGetInfo"))?;
        let u = self.usage()?;
        let avail = free as u64 + u.reserved.saturating_sub(u.used);
        Ok(match *lock(&self.inner.install) {
            Some(cap) => avail.min(cap.saturating_sub(u.used)),
            None => avail,
        })
    }

    fn reset_peak(&self) -> Result<()> {
        let p = self.current_handle()?;
        // Setting a high-water mark to 0 resets it to the current value.
        p.set_attr(USED_HIGH, 0)?;
        p.set_attr(RESERVED_HIGH, 0)
    }

    /// Synchronises the context (pending `cuMemFreeAsync`s complete), then trims the current
    /// pool to 0 unused bytes.
    fn empty_cache(&self) -> Result<()> {
        self.synchronize()?;
        let p = self.current_handle()?;
        // SAFETY: `p` is the device's live current pool.
        unsafe { result::mem_pool::trim_to(p.0, 0) }.map_err(drv("cuMemPoolTrimTo"))
    }

    fn memory_summary(&self) -> String {
        let info = self.info();
        let mut s = format!(
            "|=== oomguard memory summary: {} ({}) ===|\n",
            info,
            ByteSize(info.total_bytes)
        );
        match (self.usage(), self.release_threshold()) {
            (Ok(u), Ok(t)) => {
                let row = |name: &str, cur: u64, peak: u64| {
                    format!(
                        "| {name:<17} | current {:>12} | peak {:>12} |\n",
                        ByteSize(cur).to_string(),
                        ByteSize(peak).to_string()
                    )
                };
                s += &row("used", u.used, u.used_peak);
                s += &row("reserved", u.reserved, u.reserved_peak);
                let threshold = if t == u64::MAX {
                    "max (cache kept)".to_string()
                } else {
                    ByteSize(t).to_string()
                };
                s += &format!(
                    "| {:<17} | current {:>12} | {:>17} |\n| {:<17} | {:>39} |\n",
                    "cached (unused)",
                    ByteSize(u.reserved.saturating_sub(u.used)).to_string(),
                    "",
                    "release threshold",
                    threshold
                );
            }
            (Err(e), _) | (_, Err(e)) => s += &format!("| unavailable: {e} |\n"),
        }
        s
    }

    /// Creates a pool with `maxSize = limit` on the device and makes it the device's current
    /// pool while the guard lives; the previous pool is current again on drop, and the capped
    /// pool is destroyed (the driver frees it once its last allocation is freed).
    ///
    /// What it caps: bytes `cuMemAllocAsync` hands out on this device, from any thread or
    /// stream, while the guard lives, to `limit` (rounded by the driver to its 2 MiB
    /// granularity), so an allocation past it fails with `CUDA_ERROR_OUT_OF_MEMORY`, which the
    /// retry engine retries. What it does not cap: memory allocated before (it stays in the
    /// previous pool), allocations through an explicit pool (`cuMemAllocFromPoolAsync`) or
    /// `cuMemAlloc`, and frameworks that cache on their own. Needs CUDA 12.2+ (pool `maxSize`).
    /// Budgets on one device nest: drop them in the reverse order of their creation (each
    /// restores the pool that was current when it was made).
    fn budget(&self, limit: u64) -> Result<SourceBudget> {
        let mut cap = lock(&self.inner.install);
        let previous = self.current_handle()?;
        let capped = create_pool(&self.inner.ctx, Some(limit), Some(u64::MAX))?;
        // Memory cached by the previous pool cannot serve the capped one: give it back.
        // SAFETY: `previous` is the device's live current pool.
        let _ = unsafe { result::mem_pool::trim_to(previous.0, 0) };
        set_current(&self.inner.ctx, capped)?;
        let lift = Box::new(RestorePool {
            pool: self.clone(),
            previous,
            previous_cap: cap.replace(limit),
            capped,
        });
        drop(cap);
        Ok(SourceBudget::new(limit, self.info(), lift))
    }

    fn source_id(&self) -> usize {
        // One source per device: the primary context's device.
        0x1000_0000 + self.inner.ctx.ordinal()
    }

    fn synchronize(&self) -> Result<()> {
        self.inner
            .ctx
            .synchronize()
            .map_err(drv("cuCtxSynchronize"))
    }
}

/// Restores the device's previous pool when a budget is dropped.
struct RestorePool {
    pool: DriverPool,
    previous: PoolHandle,
    previous_cap: Option<u64>,
    capped: PoolHandle,
}

impl Drop for RestorePool {
    fn drop(&mut self) {
        let mut cap = lock(&self.pool.inner.install);
        if let Err(e) = set_current(&self.pool.inner.ctx, self.previous) {
            tracing::warn!(target: "oomguard::source", error = %e, "restoring the device's memory pool failed");
            return;
        }
        *cap = self.previous_cap;
        // Let pending frees complete, then destroy: the driver releases the pool's memory when
        // its last outstanding allocation is freed.
        let _ = self.pool.synchronize();
        // SAFETY: the capped pool was created by `budget` and is no longer current; it is
        // destroyed once, here.
        if let Err(e) = unsafe { result::mem_pool::destroy(self.capped.0) } {
            tracing::warn!(target: "oomguard::source", error = %e, "destroying a capped memory pool failed");
        }
    }
}

fn set_current(ctx: &Arc<CudaContext>, p: PoolHandle) -> Result<()> {
    ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
    // SAFETY: a live pool of this device and the device of a live context.
    unsafe { result::device::set_mem_pool(ctx.cu_device(), p.0) }.map_err(drv("cuDeviceSetMemPool"))
}

fn create_pool(
    ctx: &Arc<CudaContext>,
    max_size: Option<u64>,
    release_threshold: Option<u64>,
) -> Result<PoolHandle> {
    ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
    let max = match max_size {
        Some(m) => usize::try_from(m).map_err(|_| {
            Error::InvalidArgument(format!(
                "a pool size of {m} bytes does not fit this platform"
            ))
        })?,
        None => 0,
    };
    // SAFETY: an all-zero CUmemPoolProps is the documented default (no handle types, no
    // win32 attributes, maxSize 0 = the device's memory); the fields set below describe a
    // pinned device-memory pool on this context's device.
    let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
    props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    props.handleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
    props.location = crate::backend::cuda::device_location(ctx.cu_device());
    props.maxSize = max;
    // SAFETY: `props` is a valid, fully initialised CUmemPoolProps.
    let p =
        PoolHandle(unsafe { result::mem_pool::create(&props) }.map_err(drv("cuMemPoolCreate"))?);
    if let Some(t) = release_threshold {
        p.set_attr(RELEASE_THRESHOLD, t)?;
    }
    Ok(p)
}

/// Creates a pool on a device and makes it the device's current pool, so that everything
/// `cuMemAllocAsync` hands out later (cudarc, candle) comes from it. Made by
/// [`DriverPool::builder`].
///
/// ```no_run
/// use oomguard_runtime::source::DriverPool;
/// use oomguard_runtime::ByteSize;
/// // Before candle's first allocation on device 0: cap the pool at 20 GiB for the whole run.
/// let pool = DriverPool::builder(0).max_size(ByteSize::gib(20)).install()?;
/// # Ok::<(), oomguard_runtime::Error>(())
/// ```
#[derive(Clone, Debug)]
#[must_use = "install() makes the pool current"]
pub struct DriverPoolBuilder {
    ordinal: usize,
    max_size: Option<u64>,
    release_threshold: Option<u64>,
}

impl DriverPoolBuilder {
    /// Caps the pool at `bytes` (`maxSize`, CUDA 12.2+): allocations past it fail with
    /// `CUDA_ERROR_OUT_OF_MEMORY`. Memory allocated before `install` is not in this pool.
    pub fn max_size(mut self, bytes: impl Into<ByteSize>) -> Self {
        self.max_size = Some(bytes.into().0);
        self
    }

    /// Unused bytes the pool keeps across synchronisations (default: the maximum, so freed
    /// memory is reused instead of returned to the driver at every synchronisation; `None`
    /// keeps the driver's default of 0).
    pub fn release_threshold(mut self, bytes: Option<u64>) -> Self {
        self.release_threshold = bytes;
        self
    }

    /// Creates the pool and makes it the device's current pool. The pool lives for the rest of
    /// the process.
    pub fn install(self) -> Result<DriverPool> {
        if self.max_size == Some(0) {
            return Err(Error::InvalidArgument(
                "a driver pool of max_size 0 could hand out nothing (omit max_size for no cap)"
                    .into(),
            ));
        }
        let pool = DriverPool::current(self.ordinal)?;
        {
            let mut cap = lock(&pool.inner.install);
            let p = create_pool(&pool.inner.ctx, self.max_size, self.release_threshold)?;
            set_current(&pool.inner.ctx, p)?;
            *cap = self.max_size;
        }
        Ok(pool)
    }
}
