//! `Device`: a backend and its caching allocator, shared by every buffer allocated from it, and
//! the accounting of the memory guards open on it ([`tracker`]).

pub(crate) mod tracker;

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use self::tracker::Tracker;

use crate::alloc::{Allocation, CachingAllocator, MemoryStats, SegmentInfo};
use crate::backend::sim::SimDevice;
use crate::backend::{Backend, MemInfo, StreamId};
use crate::config::AllocatorConfig;
use crate::error::Result;
use crate::ByteSize;

/// A device with its caching allocator. Cheap to clone; clones share the allocator. Buffers keep
/// their device alive.
///
/// ```
/// # extern crate oomguard_runtime as oomguard; // as the facade re-exports it
/// use oomguard::{Device, ByteSize};
/// let dev = Device::sim(ByteSize::gib(8));
/// let buf = dev.from_slice(&[1.0f32, 2.0, 3.0]).unwrap();
/// assert_eq!(buf.to_vec().unwrap(), vec![1.0, 2.0, 3.0]);
/// drop(buf);
/// dev.empty_cache().unwrap();
/// assert_eq!(dev.stats().reserved_bytes.all.current, 0);
/// ```
#[derive(Clone)]
pub struct Device {
    inner: Arc<DeviceInner>,
}

struct DeviceInner {
    allocator: CachingAllocator,
    /// Accounting for the memory guards ([`crate::guard`]).
    tracker: Tracker,
}

/// Weak handles of every device made, so that device-agnostic guards can reach them.
static REGISTRY: Mutex<Vec<Weak<DeviceInner>>> = Mutex::new(Vec::new());

/// A [`Device`] that is not kept alive (see `Device::downgrade`).
#[derive(Clone, Debug)]
pub(crate) struct WeakDevice(Weak<DeviceInner>);

impl WeakDevice {
    /// The device's address, as `Device::thread_device_addr` gives it.
    pub(crate) fn addr(&self) -> usize {
        self.0.as_ptr() as usize
    }
    /// Whether the device is alive.
    pub(crate) fn alive(&self) -> bool {
        self.0.strong_count() > 0
    }
}

thread_local! {
    /// The address of the device this thread last allocated on (0: none).
    static THREAD_DEVICE: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

fn registry() -> MutexGuard<'static, Vec<Weak<DeviceInner>>> {
    // Only pushes and retains happen under the lock: a poisoned list is still a valid list.
    REGISTRY.lock().unwrap_or_else(|e| e.into_inner())
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device")
            .field("name", &self.name())
            .field("ordinal", &self.ordinal())
            .finish()
    }
}

impl Device {
    /// A host-backed simulated device of `capacity`, configured from `OOMGUARD_ALLOC_CONF`
    /// ([`AllocatorConfig::from_env`]; the default when unset), as [`Device::cuda`] is.
    ///
    /// It reserves memory as on a CUDA GPU: pages of 2 MiB (the mapping granularity of an
    /// H100) and segments of at least 2 MiB, so a device of less than 2 MiB serves no request
    /// (its out-of-memory error names the 2 MiB the request needs).
    ///
    /// This constructor cannot fail: when the variable holds an invalid configuration it logs
    /// the error (`tracing::error!`; once on standard error when no `tracing` subscriber is
    /// installed) and uses the default. [`Device::try_sim`] returns the error
    /// instead; [`Device::new`] with an explicit configuration ignores the variable.
    pub fn sim(capacity: ByteSize) -> Self {
        let config = AllocatorConfig::from_env().unwrap_or_else(|e| {
            tracing::error!(error = %e, "ignoring {}; using the default configuration", crate::config::ENV_VAR);
            static SAID: std::sync::Once = std::sync::Once::new();
            crate::config::say_once_without_subscriber(&SAID, "error", || {
                format!(
                    "ignoring {}: {e}; using the default configuration (Device::try_sim \
                     returns this error)",
                    crate::config::ENV_VAR
                )
            });
            AllocatorConfig::default()
        });
        Self::new(SimDevice::new(capacity), config)
    }

    /// A host-backed simulated device of `capacity`, configured from `OOMGUARD_ALLOC_CONF`;
    /// [`Error::Config`](crate::Error::Config) (naming the key) when the variable holds an invalid configuration.
    pub fn try_sim(capacity: ByteSize) -> Result<Self> {
        Ok(Self::new(
            SimDevice::new(capacity),
            AllocatorConfig::from_env()?,
        ))
    }

    /// A device over any backend, with `config` (the environment variable is not read: an
    /// explicit configuration overrides it). A configuration that fails
    /// [`AllocatorConfig::check`] is replaced by the default, and said
    /// ([`crate::CachingAllocator::new`]).
    pub fn new(backend: impl Backend, config: AllocatorConfig) -> Self {
        Self::from_arc(Arc::new(backend), config)
    }

    /// A device over a shared backend, with `config`.
    pub fn from_arc(backend: Arc<dyn Backend>, config: AllocatorConfig) -> Self {
        let d = Self {
            inner: Arc::new(DeviceInner {
                allocator: CachingAllocator::new(backend, config),
                tracker: Tracker::default(),
            }),
        };
        let mut all = registry();
        all.retain(|w| w.strong_count() > 0);
        all.push(Arc::downgrade(&d.inner));
        d
    }

    /// Every device alive in this process (for guards and retries that span devices).
    pub fn all() -> Vec<Device> {
        registry()
            .iter()
            .filter_map(Weak::upgrade)
            .map(|inner| Device { inner })
            .collect()
    }

    /// The address identifying the device the calling thread last allocated on (0: none).
    pub(crate) fn thread_device_addr() -> usize {
        THREAD_DEVICE.try_with(|d| d.get()).unwrap_or(0)
    }

    /// A handle that does not keep the device alive; while it exists, no other device can have
    /// this device's address.
    pub(crate) fn downgrade(&self) -> WeakDevice {
        WeakDevice(Arc::downgrade(&self.inner))
    }

    /// The device the calling thread last allocated on, if it is still alive: what a step that
    /// holds no device (`#[oom_retry]`) runs on, for remembering its plans per device.
    ///
    /// ```
    /// # extern crate oomguard_runtime as oomguard; // as the facade re-exports it
    /// use oomguard::{ByteSize, Device};
    /// let dev = Device::sim(ByteSize::mib(8));
    /// let _b = dev.alloc::<u8>(16).unwrap();
    /// assert_eq!(Device::last_used_on_thread().unwrap().ordinal(), dev.ordinal());
    /// ```
    pub fn last_used_on_thread() -> Option<Device> {
        let addr = Self::thread_device_addr();
        if addr == 0 {
            return None;
        }
        registry()
            .iter()
            .find(|w| w.as_ptr() as usize == addr)
            .and_then(Weak::upgrade)
            .map(|inner| Device { inner })
    }

    /// The caching allocator.
    pub fn allocator(&self) -> &CachingAllocator {
        &self.inner.allocator
    }

    /// The accounting of the memory guards.
    pub(crate) fn tracker(&self) -> &Tracker {
        &self.inner.tracker
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        self.inner.allocator.backend()
    }

    /// The device's name.
    pub fn name(&self) -> String {
        self.backend().name()
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> usize {
        self.backend().ordinal()
    }

    /// Free and total memory as the device reports them.
    pub fn mem_info(&self) -> Result<MemInfo> {
        Ok(self.backend().mem_info()?)
    }

    /// An identity of the device, equal for every handle of it (its shared state's address).
    pub(crate) fn identity(&self) -> usize {
        Arc::as_ptr(&self.inner) as usize
    }

    /// Whether two handles are the same device.
    pub fn same_device(&self, other: &Device) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Allocates `bytes` raw bytes on `stream`; the caller frees with [`Device::free_raw`].
    /// Prefer [`Device::alloc`], which frees on drop.
    ///
    /// Memory guards ([`crate::guard`]) open on this device apply: a budget that the
    /// allocation would exceed fails it before the allocator is called. The caller's source
    /// location is recorded for leak checks.
    #[track_caller]
    pub fn alloc_raw(&self, bytes: u64, stream: StreamId) -> Result<Allocation> {
        let inner = &*self.inner;
        THREAD_DEVICE.with(|d| d.set(self.identity()));
        if !inner.tracker.scopes_open() {
            return inner.allocator.allocate(bytes, stream);
        }
        inner.tracker.allocate(&inner.allocator, bytes, stream)
    }

    /// Frees an allocation from [`Device::alloc_raw`] (and credits the memory guards it was
    /// charged to). Free through the device, not through [`Device::allocator`], so that the
    /// guards see it. The caller's location is what the history records as where it was freed.
    #[track_caller]
    pub fn free_raw(&self, a: Allocation) -> Result<()> {
        let inner = &*self.inner;
        if inner.tracker.tracking() {
            inner.tracker.release(&a);
        }
        inner.allocator.free(a)
    }

    /// A copy of the allocator's statistics.
    pub fn stats(&self) -> MemoryStats {
        self.inner.allocator.stats()
    }

    /// Marks the end of one training step and the start of the next (see
    /// [`CachingAllocator::mark_step`]): a loop that calls it once per step lets a step that
    /// repeats be served from a fixed layout, with no page moved, at the edge of memory.
    pub fn mark_step(&self) {
        self.inner.allocator.mark_step()
    }

    /// Resets every peak statistic to its current value.
    pub fn reset_peak_stats(&self) {
        self.inner.allocator.reset_peak_stats()
    }

    /// Resets the accumulated statistics and event counters (PyTorch's
    /// `reset_accumulated_memory_stats`; see
    /// [`CachingAllocator::reset_accumulated_memory_stats`]), and
    /// [`Device::budget_refusals`].
    pub fn reset_accumulated_memory_stats(&self) {
        self.inner.allocator.reset_accumulated_memory_stats();
        self.inner.tracker.reset_budget_refusals();
    }

    /// Allocations on this device that a memory budget refused ([`BudgetExceeded`](crate::BudgetExceeded)),
    /// since the device was made or [`Device::reset_accumulated_memory_stats`]. A refusal never
    /// reaches the allocator, so [`MemoryStats::num_ooms`] (PyTorch's meaning: out-of-memory
    /// errors of the allocator) does not count it, while a retry report counts it as an
    /// out-of-memory; [`Device::memory_summary`] shows both.
    pub fn budget_refusals(&self) -> u64 {
        self.inner.tracker.budget_refusals()
    }

    /// Returns cached unused memory to the device.
    pub fn empty_cache(&self) -> Result<()> {
        self.inner.allocator.empty_cache()
    }

    /// A readable table of the statistics, like `torch.cuda.memory_summary()`, with a line for
    /// the allocations memory budgets refused ([`Device::budget_refusals`]; its `OOMs` counts
    /// the allocator's out-of-memory errors only, as PyTorch's `num_ooms`).
    pub fn memory_summary(&self) -> String {
        self.inner
            .allocator
            .memory_summary_with(Some(self.budget_refusals()))
    }

    /// Segments and blocks of the allocator.
    pub fn snapshot(&self) -> Vec<SegmentInfo> {
        self.inner.allocator.snapshot()
    }
}
