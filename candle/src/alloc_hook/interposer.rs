//! The hook's logic, apart from the driver: which calls oomguard serves, on which device and
//! stream, and which go to the driver. Generic over [`Driver`] so that it is tested on the
//! simulated device with a fake driver (no GPU); `symbols.rs` runs it over the real one.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use oomguard::backend::{StreamId, PER_THREAD_STREAM_TAG, RAW_STREAM_TAG};
use oomguard::{Allocation, Device};
use parking_lot::{Mutex, RwLock};

/// CUDA driver status codes the hook returns (`CUresult`, cuda.h).
pub(crate) mod status {
    /// `CUDA_SUCCESS`.
    pub const SUCCESS: u32 = 0;
    /// `CUDA_ERROR_INVALID_VALUE`.
    pub const INVALID_VALUE: u32 = 1;
    /// `CUDA_ERROR_OUT_OF_MEMORY`.
    pub const OUT_OF_MEMORY: u32 = 2;
    /// `CUDA_ERROR_UNKNOWN`.
    pub const UNKNOWN: u32 = 999;
}

/// CUDA's special stream handles.
const LEGACY_NULL: u64 = 0;
const LEGACY: u64 = 0x1;
const PER_THREAD: u64 = 0x2;

/// The driver below the hook: the calls it forwards, and what it asks the driver.
pub(crate) trait Driver: Send + Sync + 'static {
    /// `cuMemAllocAsync` of the real driver.
    fn alloc_async(&self, bytes: usize, stream: u64) -> Result<u64, u32>;
    /// `cuMemFreeAsync` of the real driver.
    fn free_async(&self, ptr: u64, stream: u64) -> u32;
    /// `cuMemAlloc_v2` of the real driver.
    fn alloc(&self, bytes: usize) -> Result<u64, u32>;
    /// `cuMemFree_v2` of the real driver.
    fn free(&self, ptr: u64) -> u32;
    /// The calling thread's current context (`cuCtxGetCurrent`), `None` without one.
    fn current_context(&self) -> Option<u64>;
    /// Whether `stream` is capturing a graph (`cuStreamIsCapturing`); an error counts as
    /// capturing, so the call goes to the driver.
    fn is_capturing(&self, stream: u64) -> bool;
}

/// One device oomguard serves: its allocator and the live allocations it made for the hook.
pub(crate) struct Served {
    pub(crate) context: u64,
    pub(crate) device: Device,
    live: Mutex<HashMap<u64, Allocation>>,
    pub(crate) allocs: AtomicU64,
    pub(crate) frees: AtomicU64,
}

/// Counters of what the hook did, for the install probe and for users (`HookStats`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// Allocations oomguard served.
    pub served_allocs: u64,
    /// Frees of allocations oomguard served.
    pub served_frees: u64,
    /// Calls passed to the driver: no device installed for the context, a zero-byte request, a
    /// stream capturing a graph, or a free of memory oomguard did not allocate.
    pub passed_to_driver: u64,
}

/// The hook: the devices it serves, by context.
pub(crate) struct Interposer<D: Driver> {
    pub(crate) driver: D,
    served: RwLock<Vec<Arc<Served>>>,
    passed: AtomicU64,
}

thread_local! {
    /// This thread's per-thread default stream, as an allocator stream id.
    static PER_THREAD_ID: StreamId = PER_THREAD_STREAM_TAG | next_thread_number();
    /// Set while this thread runs inside the hook: a driver call oomguard makes from there goes
    /// to the driver (the backend calls the driver's entry points directly; this is a second
    /// line of defence against recursion).
    static INSIDE: Cell<bool> = const { Cell::new(false) };
    /// The oomguard error behind this thread's last failed hooked allocation.
    static LAST_ERROR: RefCell<Option<oomguard::Error>> = const { RefCell::new(None) };
}

fn next_thread_number() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Relaxed)
}

/// The allocator's stream id for a raw stream handle used on the calling thread: the legacy
/// stream (0 and `CU_STREAM_LEGACY`) is 0, the per-thread default stream one id per thread, any
/// other handle itself (tagged raw: the backend records events on it while its owner frees).
pub(crate) fn stream_id(raw: u64) -> StreamId {
    match raw {
        LEGACY_NULL | LEGACY => 0,
        PER_THREAD => PER_THREAD_ID.with(|id| *id),
        h => h | RAW_STREAM_TAG,
    }
}

/// Takes the oomguard error behind the calling thread's last hooked allocation that failed.
pub(crate) fn take_last_error() -> Option<oomguard::Error> {
    LAST_ERROR.with(|e| e.borrow_mut().take())
}

/// Runs `f` with the thread marked as inside the hook.
fn inside<R>(f: impl FnOnce() -> R) -> R {
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            INSIDE.with(|i| i.set(false));
        }
    }
    INSIDE.with(|i| i.set(true));
    let _reset = Reset;
    f()
}

fn is_inside() -> bool {
    INSIDE.with(Cell::get)
}

/// The status for an oomguard error: out-of-memory (budgets included) as the driver says it,
/// so that candle's error and its classification are unchanged.
fn status_of(e: &oomguard::Error) -> u32 {
    if oomguard::IsOom::is_oom(e) {
        status::OUT_OF_MEMORY
    } else if matches!(e, oomguard::Error::InvalidArgument(_)) {
        status::INVALID_VALUE
    } else {
        status::UNKNOWN
    }
}

impl<D: Driver> Interposer<D> {
    pub(crate) fn new(driver: D) -> Self {
        Self {
            driver,
            served: RwLock::new(Vec::new()),
            passed: AtomicU64::new(0),
        }
    }

    /// Serves allocations made while `context` is current from `device`. Fails when the context
    /// is served already.
    pub(crate) fn serve(&self, context: u64, device: Device) -> Result<Arc<Served>, Arc<Served>> {
        let mut served = self.served.write();
        if let Some(s) = served.iter().find(|s| s.context == context) {
            return Err(Arc::clone(s));
        }
        let s = Arc::new(Served {
            context,
            device,
            live: Mutex::new(HashMap::new()),
            allocs: AtomicU64::new(0),
            frees: AtomicU64::new(0),
        });
        served.push(Arc::clone(&s));
        Ok(s)
    }

    /// Stops serving `context` (only while nothing it served is live: used when the install
    /// probe fails). Returns whether it was removed.
    pub(crate) fn unserve_if_idle(&self, context: u64) -> bool {
        let mut served = self.served.write();
        match served.iter().position(|s| s.context == context) {
            Some(i) if served[i].live.lock().is_empty() => {
                served.remove(i);
                true
            }
            _ => false,
        }
    }

    /// The device serving `context`.
    pub(crate) fn served(&self, context: u64) -> Option<Arc<Served>> {
        self.served
            .read()
            .iter()
            .find(|s| s.context == context)
            .cloned()
    }

    /// What the hook did so far, over every served device.
    pub(crate) fn counts(&self) -> Counts {
        let served = self.served.read();
        Counts {
            served_allocs: served.iter().map(|s| s.allocs.load(Relaxed)).sum(),
            served_frees: served.iter().map(|s| s.frees.load(Relaxed)).sum(),
            passed_to_driver: self.passed.load(Relaxed),
        }
    }

    fn pass(&self) {
        self.passed.fetch_add(1, Relaxed);
    }

    /// The device to serve a request on `stream` from, or `None`: pass it to the driver.
    fn target(&self, bytes: usize, stream: Option<u64>) -> Option<Arc<Served>> {
        if bytes == 0 || is_inside() {
            return None; // the driver's own zero-byte behaviour; never recurse
        }
        if self.served.read().is_empty() {
            return None;
        }
        let s = self.served(self.driver.current_context()?)?;
        if stream.is_some_and(|st| self.driver.is_capturing(st)) {
            return None; // graph capture: the driver's graph memory nodes, never our cache
        }
        Some(s)
    }

    /// `cuMemAllocAsync(bytes, stream)`: the pointer, or the driver status of the failure.
    pub(crate) fn alloc_async(&self, bytes: usize, stream: u64) -> Result<u64, u32> {
        match self.target(bytes, Some(stream)) {
            Some(s) => self.serve_alloc(&s, bytes, stream_id(stream)),
            None => {
                self.pass();
                self.driver.alloc_async(bytes, stream)
            }
        }
    }

    /// `cuMemAlloc_v2(bytes)`: served on the legacy default stream.
    pub(crate) fn alloc(&self, bytes: usize) -> Result<u64, u32> {
        match self.target(bytes, None) {
            Some(s) => self.serve_alloc(&s, bytes, 0),
            None => {
                self.pass();
                self.driver.alloc(bytes)
            }
        }
    }

    fn serve_alloc(&self, s: &Served, bytes: usize, stream: StreamId) -> Result<u64, u32> {
        let result = inside(|| s.device.alloc_raw(bytes as u64, stream));
        match result {
            Ok(a) => {
                s.live.lock().insert(a.ptr, a);
                s.allocs.fetch_add(1, Relaxed);
                Ok(a.ptr)
            }
            Err(e) => {
                let code = status_of(&e);
                LAST_ERROR.with(|l| *l.borrow_mut() = Some(e));
                Err(code)
            }
        }
    }

    /// `cuMemFreeAsync(ptr, stream)`.
    pub(crate) fn free_async(&self, ptr: u64, stream: u64) -> u32 {
        match self.take_live(ptr) {
            Some((s, a)) => self.serve_free(&s, a, stream_id(stream)),
            None => {
                self.pass();
                self.driver.free_async(ptr, stream)
            }
        }
    }

    /// `cuMemFree_v2(ptr)`: the memory may have been used on any stream, so it is reused only
    /// after the legacy default stream's work queued by now (which waits for every blocking
    /// stream) has finished, as the driver's synchronous free would.
    pub(crate) fn free(&self, ptr: u64) -> u32 {
        match self.take_live(ptr) {
            Some((s, a)) => self.serve_free(&s, a, 0),
            None => {
                self.pass();
                self.driver.free(ptr)
            }
        }
    }

    /// Removes `ptr` from the table of the device that served it.
    fn take_live(&self, ptr: u64) -> Option<(Arc<Served>, Allocation)> {
        if ptr == 0 || is_inside() {
            return None;
        }
        let served = self.served.read();
        served
            .iter()
            .find_map(|s| s.live.lock().remove(&ptr).map(|a| (Arc::clone(s), a)))
    }

    /// Frees `a` in the order of `stream` (the stream the free was queued on): when that is not
    /// the stream it was allocated on, the block waits for the work queued there by now
    /// (`record_stream`), as the driver's stream-ordered free would.
    fn serve_free(&self, s: &Served, a: Allocation, stream: StreamId) -> u32 {
        let result = inside(|| {
            if stream != a.stream {
                s.device.allocator().record_stream(&a, stream)?;
            }
            s.device.free_raw(a)
        });
        match result {
            Ok(()) => {
                s.frees.fetch_add(1, Relaxed);
                status::SUCCESS
            }
            Err(e) => {
                tracing::error!(error = %e, ptr = a.ptr, "oomguard's allocator hook could not free");
                status_of(&e)
            }
        }
    }
}
