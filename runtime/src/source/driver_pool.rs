//! The CUDA driver's stream-ordered memory pool as a [`MemorySource`]: what `cuMemAllocAsync`
//! draws from, so what cudarc's `CudaStream::alloc` and candle's CUDA tensors use.
#![allow(unsafe_code)] // FFI: every unsafe block calls the CUDA driver's pool API and says why

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::{result, sys, CudaContext};

use super::pool_state::{PoolDriver, PoolState};
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
///   is the tightest live one (see [`MemorySource::budget`] below for exactly what it caps and
///   what each order of drops means);
/// - every handle of a device (from [`DriverPool::current`], [`DriverPool::of_context`], any
///   context) shares one state: the caps in force and the lock serialising installs;
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
    /// The context this handle makes current for its driver calls.
    ctx: Arc<CudaContext>,
    /// The device's pool state, shared by every handle of the device.
    shared: Arc<DeviceShared>,
}

/// What every handle of one device shares: one install lock, one record of the caps in force.
struct DeviceShared {
    ordinal: usize,
    name: String,
    total: u64,
    state: Mutex<PoolState<usize>>,
}

/// One [`DeviceShared`] per device ordinal, for the process.
static DEVICES: Mutex<Vec<Arc<DeviceShared>>> = Mutex::new(Vec::new());

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The state is consistent between calls (each operation leaves it saying what is current).
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The CUDA driver behind [`PoolState`], for the device of a context.
struct Cuda<'a>(&'a Arc<CudaContext>);

impl PoolDriver for Cuda<'_> {
    type Pool = usize;
    fn current(&self) -> Result<usize> {
        self.0.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        // SAFETY: the device handle comes from a live context.
        let p = unsafe { result::device::get_mem_pool(self.0.cu_device()) }
            .map_err(drv("cuDeviceGetMemPool"))?;
        Ok(p as usize)
    }
    fn set_current(&self, pool: usize) -> Result<()> {
        set_current(self.0, PoolHandle(pool as sys::CUmemoryPool))
    }
    fn create(&self, max_size: Option<u64>, release_threshold: Option<u64>) -> Result<usize> {
        create_pool(self.0, max_size, release_threshold).map(|p| p.0 as usize)
    }
    fn trim(&self, pool: usize) {
        // SAFETY: the state passes only live pools of this device (never a destroyed one).
        let _ = unsafe { result::mem_pool::trim_to(pool as sys::CUmemoryPool, 0) };
    }
    fn synchronize(&self) {
        let _ = self.0.synchronize();
    }
    fn destroy(&self, pool: usize) -> Result<()> {
        // SAFETY: the state destroys only a pool it created that never became current (so no
        // allocation was made from it), once.
        unsafe { result::mem_pool::destroy(pool as sys::CUmemoryPool) }
            .map_err(drv("cuMemPoolDestroy"))
    }
}

impl fmt::Debug for DriverPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DriverPool")
            .field("ordinal", &self.shared.ordinal)
            .field("name", &self.shared.name)
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
    /// Every handle of one device, from any context, shares one state: the caps in force and
    /// the lock that serialises installs and budgets.
    pub fn of_context(ctx: &Arc<CudaContext>) -> Result<Self> {
        ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        let ordinal = ctx.ordinal();
        let shared = {
            let mut devices = lock(&DEVICES);
            match devices.iter().find(|d| d.ordinal == ordinal) {
                Some(d) => d.clone(),
                None => {
                    let name = ctx.name().map_err(drv("cuDeviceGetName"))?;
                    // SAFETY: the device handle comes from a live context.
                    let total = unsafe { result::device::total_mem(ctx.cu_device()) }
                        .map_err(drv("cuDeviceTotalMem"))?;
                    let d = Arc::new(DeviceShared {
                        ordinal,
                        name,
                        total: total as u64,
                        state: Mutex::new(PoolState::default()),
                    });
                    devices.push(d.clone());
                    d
                }
            }
        };
        let pool = Self {
            ctx: ctx.clone(),
            shared,
        };
        // The registry holds sources weakly: keep one handle per device for the process.
        let mut kept = lock(&REGISTERED);
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
        &self.ctx
    }

    fn current_handle(&self) -> Result<PoolHandle> {
        Cuda(&self.ctx)
            .current()
            .map(|p| PoolHandle(p as sys::CUmemoryPool))
    }

    /// The `maxSize` oomguard installed on the device's current pool (the tightest live
    /// budget's, else a builder's), shared by every handle of the device; `None` when no cap
    /// is known.
    pub fn installed_cap(&self) -> Option<u64> {
        let mut st = lock(&self.shared.state);
        st.repair(&Cuda(&self.ctx));
        st.cap()
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
            device_name: self.shared.name.clone(),
            ordinal: self.shared.ordinal,
            total_bytes: self.shared.total,
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
    /// `maxSize` oomguard installed (the tightest live budget's, else a builder's; through any
    /// handle of the device) less what is in use.
    fn available(&self) -> Result<u64> {
        let cap = self.installed_cap();
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        let (free, _total) = result::mem_get_info().map_err(drv("cuMemGetInfo"))?;
        let u = self.usage()?;
        let avail = free as u64 + u.reserved.saturating_sub(u.used);
        Ok(match cap {
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
    /// pool while it is the tightest live budget of the device; on drop, the pool of the next
    /// tightest live budget, or the pool current before the first budget (or one a builder
    /// installed since), is current again, and the capped pool is trimmed (its unused memory
    /// goes back to the device) and kept as a spare that a later budget of the same limit
    /// reuses. Pools that have been current are never destroyed: another thread's
    /// `cuMemAllocAsync` selects the current pool inside the driver and may still be allocating
    /// from it (on the H100, two threads making budgets while allocating crashed the process
    /// while such pools were destroyed). A process so keeps one driver pool per distinct budget
    /// limit (per budget live at once with that limit), without device memory once trimmed.
    ///
    /// What it caps: bytes `cuMemAllocAsync` hands out on this device, from any thread or
    /// stream, while the guard is in force, to `limit` (rounded by the driver to its 2 MiB
    /// granularity), so an allocation past it fails with `CUDA_ERROR_OUT_OF_MEMORY`, which the
    /// retry engine retries. What it does not cap: memory allocated before (it stays in the
    /// previous pool), allocations through an explicit pool (`cuMemAllocFromPoolAsync`) or
    /// `cuMemAlloc`, and frameworks that cache on their own. Needs CUDA 12.2+ (pool `maxSize`).
    ///
    /// Several budgets on one device (through any handle, from any thread) share one state, and
    /// any order of drops is sound:
    /// - the cap in force is the **smallest limit among the live budgets** (the newest among
    ///   equals): a looser budget made inside a tighter one does not lift it;
    /// - dropping a budget that is not in force changes nothing for allocations (its pool, not
    ///   current since a tighter one was made, is trimmed and kept as a spare);
    /// - dropping the budget in force makes the next tightest live budget's pool current (its
    ///   cap counts only what was allocated while its pool was current), or, when none is left,
    ///   the base pool;
    /// - if the driver refuses to make another pool current, the capped pool stays current, its
    ///   cap still reported by [`DriverPool::installed_cap`] and `available`, and it is replaced
    ///   (and becomes a spare) at the next call that succeeds (a warning is logged).
    ///
    /// A limit of 0 is refused (`maxSize = 0` means no cap to the driver), as on every source.
    fn budget(&self, limit: u64) -> Result<SourceBudget> {
        let id = lock(&self.shared.state).budget(&Cuda(&self.ctx), limit)?;
        let lift = Box::new(BudgetLift {
            pool: self.clone(),
            id,
        });
        Ok(SourceBudget::new(limit, self.info(), lift))
    }

    fn source_id(&self) -> usize {
        // One source per device: the primary context's device.
        0x1000_0000 + self.shared.ordinal
    }

    fn synchronize(&self) -> Result<()> {
        self.ctx.synchronize().map_err(drv("cuCtxSynchronize"))
    }
}

/// Releases a budget of the device's shared state when dropped (see [`DriverPool`]'s
/// `MemorySource::budget`).
struct BudgetLift {
    pool: DriverPool,
    id: u64,
}

impl Drop for BudgetLift {
    fn drop(&mut self) {
        lock(&self.pool.shared.state).release(&Cuda(&self.pool.ctx), self.id);
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
        if let Err(e) = p.set_attr(RELEASE_THRESHOLD, t) {
            // SAFETY: `p` was just created here and nothing else knows it.
            let _ = unsafe { result::mem_pool::destroy(p.0) };
            return Err(e);
        }
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

    /// Creates the pool and makes it the device's current pool (with budgets live on the device:
    /// once the last of them drops; their caps stay in force while they live). The pool lives
    /// for the rest of the process. If it cannot be made current it is destroyed and the error
    /// returned.
    pub fn install(self) -> Result<DriverPool> {
        if self.max_size == Some(0) {
            return Err(Error::InvalidArgument(
                "a driver pool of max_size 0 could hand out nothing (omit max_size for no cap)"
                    .into(),
            ));
        }
        let pool = DriverPool::current(self.ordinal)?;
        lock(&pool.shared.state).install(
            &Cuda(&pool.ctx),
            self.max_size,
            self.release_threshold,
        )?;
        Ok(pool)
    }
}
