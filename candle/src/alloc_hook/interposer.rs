//! The hook's logic, apart from the driver: which calls oomguard serves, on which device and
//! stream, and which go to the driver. Generic over [`Driver`] so that it is tested on the
//! simulated device with a fake driver (no GPU); `symbols.rs` runs it over the real one.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::{Arc, Weak};

use oomguard::backend::{EventId, StreamId, PER_THREAD_STREAM_TAG, RAW_STREAM_TAG};
use oomguard::{Allocation, Device};
use parking_lot::{Mutex, RwLock};

use super::codes;

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
pub(crate) const LEGACY: u64 = 0x1;
const PER_THREAD: u64 = 0x2;

/// The allocator stream id of `cuMemAlloc_v2`'s blocks: the legacy stream's handle, tagged raw,
/// so that they are a pool of their own, apart from `cuMemAllocAsync`'s on stream 0: a
/// `cuMemFree_v2` (which names no stream) then always records an event on the legacy stream,
/// and the block is not reused before that stream has passed the free.
pub(crate) const V2_STREAM: StreamId = RAW_STREAM_TAG | LEGACY;

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
    /// capturing, so the call goes to the driver. Asked of the legacy stream ([`LEGACY`]), the
    /// driver answers with an error while any blocking stream of the context captures.
    fn is_capturing(&self, stream: u64) -> bool;
}

/// One device oomguard serves: its allocator and the live allocations it made for the hook.
pub(crate) struct Served {
    pub(crate) context: u64,
    pub(crate) device: Device,
    live: Mutex<HashMap<u64, Allocation>>,
    /// Blocks freed while a graph was being captured: the graph may use them whenever it is
    /// launched, so they are never reused (nor freed) while the process runs.
    held: Mutex<Vec<Allocation>>,
    /// Blocks freed on a stream that did not capture while another (blocking) stream of the
    /// context did, each with an event recorded on its freeing stream at the free: they go back
    /// to the allocator, once their event is done, at a later call made with no capture seen.
    waiting: Mutex<Vec<(Allocation, EventId)>>,
    /// Threads inside a call this device serves (unserving waits for none).
    in_flight: AtomicUsize,
    /// Per-thread stream ids of threads that have exited, for reuse once their event is done.
    retired: Mutex<Vec<(StreamId, EventId)>>,
    pub(crate) allocs: AtomicU64,
    pub(crate) frees: AtomicU64,
}

/// Counters of what the hook did, for the install probe and for users
/// ([`counts`](super::counts)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Counts {
    /// Allocations oomguard served.
    pub served_allocs: u64,
    /// Frees of allocations oomguard served.
    pub served_frees: u64,
    /// Calls passed to the driver: no device installed for the context, a zero-byte request, a
    /// graph being captured (on the stream, or on any blocking stream of the context), a call
    /// made from inside the hook, or a free of memory oomguard did not allocate.
    pub passed_to_driver: u64,
    /// Blocks of oomguard's freed while a graph was being captured: kept out of reuse for the
    /// rest of the process (a replay of the graph may use them), and counted as allocated.
    pub held_after_capture: u64,
    /// Blocks of oomguard's freed on a stream that did not capture while another stream of the
    /// context did: they wait (counted as allocated) for an event on their freeing stream and
    /// for a call made with no capture in progress, then go back to the cache.
    pub waiting_for_capture_end: u64,
}

/// The hook: the devices it serves, by context.
pub(crate) struct Interposer<D: Driver> {
    pub(crate) driver: D,
    served: RwLock<Vec<Arc<Served>>>,
    passed: AtomicU64,
}

/// This thread's per-thread default stream ids, one per served device; retired (for reuse once
/// the thread's stream has passed an event) when the thread exits.
struct ThreadStreams(RefCell<Vec<(Weak<Served>, StreamId)>>);

impl Drop for ThreadStreams {
    fn drop(&mut self) {
        for (w, id) in self.0.take() {
            if let Some(s) = w.upgrade() {
                s.retire(id);
            }
        }
    }
}

thread_local! {
    static THREAD_STREAMS: ThreadStreams = const { ThreadStreams(RefCell::new(Vec::new())) };
    /// Set while this thread runs inside the hook: an allocation made from there (by an OOM
    /// observer, say) goes to the driver, never back into the allocator that is running.
    static INSIDE: Cell<bool> = const { Cell::new(false) };
    /// The oomguard error behind this thread's last failed hooked allocation.
    static LAST_ERROR: RefCell<Option<oomguard::Error>> = const { RefCell::new(None) };
}

/// Numbers of per-thread stream ids (never 0), for every served device.
fn next_thread_number() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Relaxed)
}

/// Takes the oomguard error behind the calling thread's last hooked allocation that failed.
pub(crate) fn take_last_error() -> Option<oomguard::Error> {
    LAST_ERROR.with(|e| e.borrow_mut().take())
}

/// Runs `f` with the thread marked as inside the hook (restoring the mark after: calls nest).
fn inside<R>(f: impl FnOnce() -> R) -> R {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            INSIDE.with(|i| i.set(self.0));
        }
    }
    let _reset = Reset(INSIDE.with(|i| i.replace(true)));
    f()
}

fn is_inside() -> bool {
    INSIDE.with(Cell::get)
}

/// The status for an oomguard error: out-of-memory (budgets included) as the driver says it,
/// so that candle's error and its classification are unchanged; a driver failure inside
/// oomguard with the driver's own code.
pub(crate) fn status_of(e: &oomguard::Error) -> u32 {
    if oomguard::IsOom::is_oom(e) {
        return status::OUT_OF_MEMORY;
    }
    match e {
        oomguard::Error::Backend(b) => codes::code_in_message(&b.message).unwrap_or(
            if b.kind == oomguard::backend::BackendErrorKind::InvalidArgument {
                status::INVALID_VALUE
            } else {
                status::UNKNOWN
            },
        ),
        oomguard::Error::InvalidArgument(_) => status::INVALID_VALUE,
        _ => status::UNKNOWN,
    }
}

/// Where a graph is being captured, as a call sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Capture {
    /// Nowhere the hook can see.
    None,
    /// On the call's own stream (or the call is on the legacy stream while a blocking stream
    /// captures): nothing may be recorded on it.
    OnStream,
    /// On another blocking stream of the context.
    Elsewhere,
}

/// A thread inside a call a [`Served`] device serves: unserving is refused until it leaves.
struct Entered(Arc<Served>);

impl Drop for Entered {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, SeqCst);
    }
}

impl Served {
    /// The allocator's stream id for a raw stream handle used on the calling thread: the legacy
    /// stream (0 and `CU_STREAM_LEGACY`) is 0, the per-thread default stream one id per thread,
    /// any other handle itself (tagged raw: the backend records events on it while its owner
    /// frees).
    pub(crate) fn stream_id(self: &Arc<Self>, raw: u64) -> StreamId {
        match raw {
            LEGACY_NULL | LEGACY => 0,
            PER_THREAD => self.thread_stream(),
            h => h | RAW_STREAM_TAG,
        }
    }

    /// The calling thread's per-thread stream id on this device.
    fn thread_stream(self: &Arc<Self>) -> StreamId {
        THREAD_STREAMS
            .try_with(|t| {
                let mut t = t.0.borrow_mut();
                if let Some(&(_, id)) = t.iter().find(|(w, _)| w.as_ptr() == Arc::as_ptr(self)) {
                    return id;
                }
                t.retain(|(w, _)| w.strong_count() > 0);
                let id = self.reuse_or_new_id();
                t.push((Arc::downgrade(self), id));
                id
            })
            // The thread is exiting (its table is gone): an id of its own, never reused.
            .unwrap_or_else(|_| PER_THREAD_STREAM_TAG | next_thread_number())
    }

    /// An id of an exited thread whose stream has passed its last work (so its cached blocks
    /// can serve this thread), or a new one.
    fn reuse_or_new_id(&self) -> StreamId {
        let backend = self.device.allocator().backend();
        let mut retired = self.retired.lock();
        let mut i = 0;
        while i < retired.len() {
            match backend.event_done(retired[i].1) {
                Ok(true) => return retired.swap_remove(i).0,
                Ok(false) => i += 1,
                Err(e) => {
                    // Unknown whether its work is done: never reuse the id.
                    tracing::warn!(error = %e, "an exited thread's stream event failed");
                    retired.swap_remove(i);
                }
            }
        }
        PER_THREAD_STREAM_TAG | next_thread_number()
    }

    /// The thread that used `id` exits (called on it): an event on its per-thread stream marks
    /// the end of its work; once done, a new thread takes over the id and its cached blocks.
    fn retire(&self, id: StreamId) {
        match self.device.allocator().backend().record_event(id) {
            Ok(ev) => self.retired.lock().push((id, ev)),
            Err(e) => {
                tracing::warn!(error = %e, "no event on an exiting thread's stream: its id is not reused");
            }
        }
    }

    /// Per-thread stream ids of exited threads waiting for reuse.
    #[cfg(test)]
    pub(crate) fn retired_ids(&self) -> Vec<StreamId> {
        self.retired.lock().iter().map(|r| r.0).collect()
    }

    fn idle(&self) -> bool {
        // `in_flight` first: a thread leaving a call has filled the tables before it counted
        // itself out. Then one lock at a time (`release_waiting` takes `held` inside `waiting`).
        if self.in_flight.load(SeqCst) != 0 {
            return false;
        }
        let live = self.live.lock().is_empty();
        let held = self.held.lock().is_empty();
        live && held && self.waiting.lock().is_empty()
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
            held: Mutex::new(Vec::new()),
            waiting: Mutex::new(Vec::new()),
            in_flight: AtomicUsize::new(0),
            retired: Mutex::new(Vec::new()),
            allocs: AtomicU64::new(0),
            frees: AtomicU64::new(0),
        });
        served.push(Arc::clone(&s));
        Ok(s)
    }

    /// Stops serving `context`, only while nothing it served is live or held and no thread is
    /// inside a call it serves (used when install fails). Returns whether it was removed; when
    /// not, the device keeps serving (and stays alive) for the memory it gave out.
    pub(crate) fn unserve_if_idle(&self, context: u64) -> bool {
        // The write lock waits for threads between the table and `in_flight` (see `enter`).
        let mut served = self.served.write();
        match served.iter().position(|s| s.context == context) {
            Some(i) if served[i].idle() => {
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

    /// Enters the device serving `context`: counted in flight under the table's lock, so that
    /// `unserve_if_idle` either sees this thread or has removed the device before it looked.
    fn enter(&self, context: u64) -> Option<Entered> {
        let served = self.served.read();
        let s = served.iter().find(|s| s.context == context)?;
        s.in_flight.fetch_add(1, SeqCst);
        Some(Entered(Arc::clone(s)))
    }

    /// What the hook did so far, over every served device.
    pub(crate) fn counts(&self) -> Counts {
        let served = self.served.read();
        Counts {
            served_allocs: served.iter().map(|s| s.allocs.load(Relaxed)).sum(),
            served_frees: served.iter().map(|s| s.frees.load(Relaxed)).sum(),
            passed_to_driver: self.passed.load(Relaxed),
            held_after_capture: served.iter().map(|s| s.held.lock().len() as u64).sum(),
            waiting_for_capture_end: served.iter().map(|s| s.waiting.lock().len() as u64).sum(),
        }
    }

    fn pass(&self) {
        self.passed.fetch_add(1, Relaxed);
    }

    /// Whether a graph is being captured on `stream` or on a blocking stream of the current
    /// context (the legacy stream's answer), when oomguard must call nothing that would break
    /// it (a served allocation may map pages, synchronize or free segments).
    fn capturing(&self, stream: Option<u64>) -> bool {
        self.capture(stream) != Capture::None
    }

    /// Where a graph is being captured, seen from a call on `stream` (`None`: the legacy
    /// stream, as `cuMemAlloc_v2`/`cuMemFree_v2`).
    fn capture(&self, stream: Option<u64>) -> Capture {
        let own = stream.filter(|&st| st != LEGACY_NULL && st != LEGACY);
        if own.is_some_and(|st| self.driver.is_capturing(st)) {
            return Capture::OnStream;
        }
        if self.driver.is_capturing(LEGACY) {
            // the legacy stream itself cannot be used while a blocking stream captures
            return if own.is_some() {
                Capture::Elsewhere
            } else {
                Capture::OnStream
            };
        }
        Capture::None
    }

    /// [`Self::capture`] for a free of a block of `s`: the driver can only be asked in the
    /// block's context. A thread with another context current (or none: cudarc frees a tensor
    /// dropped on any thread without binding its context) cannot see a capture there, and its
    /// free is served as before; counting the driver's error as a capture would keep the block
    /// out of reuse for good.
    fn capture_at_free(&self, s: &Served, stream: Option<u64>) -> Capture {
        if self.driver.current_context() != Some(s.context) {
            return Capture::None;
        }
        self.capture(stream)
    }

    /// Gives the blocks waiting for a capture's end back to the allocator once their event is
    /// done (called with no capture seen).
    fn release_waiting(&self, s: &Served) {
        let mut waiting = s.waiting.lock();
        if waiting.is_empty() {
            return;
        }
        let backend = s.device.allocator().backend();
        let mut i = 0;
        while i < waiting.len() {
            let (a, ev) = waiting[i];
            match inside(|| backend.event_done(ev)) {
                Ok(false) => i += 1,
                Ok(true) => {
                    waiting.swap_remove(i);
                    if let Err(e) = inside(|| s.device.free_raw(a)) {
                        tracing::error!(error = %e, ptr = a.ptr, "oomguard's allocator hook could not free");
                    }
                }
                Err(e) => {
                    // whether the freeing stream is done is unknown: never reuse the block
                    tracing::warn!(error = %e, ptr = a.ptr, "an event of a free made during capture failed");
                    waiting.swap_remove(i);
                    s.held.lock().push(a);
                }
            }
        }
    }

    /// The device to serve a request on `stream` from, or `None`: pass it to the driver.
    fn target(&self, bytes: usize, stream: Option<u64>) -> Option<Entered> {
        if bytes == 0 || is_inside() {
            return None; // the driver's own zero-byte behaviour; never recurse
        }
        if self.served.read().is_empty() {
            return None;
        }
        let s = self.enter(self.driver.current_context()?)?;
        if self.capturing(stream) {
            return None; // graph capture: the driver's graph memory nodes, never our cache
        }
        self.release_waiting(&s.0);
        Some(s)
    }

    /// `cuMemAllocAsync(bytes, stream)`: the pointer, or the driver status of the failure.
    pub(crate) fn alloc_async(&self, bytes: usize, stream: u64) -> Result<u64, u32> {
        match self.target(bytes, Some(stream)) {
            Some(s) => {
                let id = s.0.stream_id(stream);
                self.serve_alloc(&s.0, bytes, id)
            }
            None => {
                self.pass();
                self.driver.alloc_async(bytes, stream)
            }
        }
    }

    /// `cuMemAlloc_v2(bytes)`: served on the legacy default stream, in a pool of its own
    /// ([`V2_STREAM`]).
    pub(crate) fn alloc(&self, bytes: usize) -> Result<u64, u32> {
        match self.target(bytes, None) {
            Some(s) => self.serve_alloc(&s.0, bytes, V2_STREAM),
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
            Some((s, a)) => match self.capture_at_free(&s.0, Some(stream)) {
                Capture::OnStream => self.hold(&s.0, a),
                Capture::Elsewhere => self.wait_for_capture_end(&s.0, a, stream),
                Capture::None => {
                    self.release_waiting(&s.0);
                    let id = s.0.stream_id(stream);
                    self.serve_free(&s.0, a, id)
                }
            },
            None => {
                self.pass();
                self.driver.free_async(ptr, stream)
            }
        }
    }

    /// `cuMemFree_v2(ptr)`: the memory may have been used on any stream, so it is reused only
    /// after the legacy default stream's work queued by now (which waits for every blocking
    /// stream) has finished: an event there for every block not allocated on stream 0 itself
    /// (`cuMemAlloc_v2`'s blocks are on [`V2_STREAM`], so they always get one).
    pub(crate) fn free(&self, ptr: u64) -> u32 {
        match self.take_live(ptr) {
            Some((s, a)) if self.capture_at_free(&s.0, None) != Capture::None => self.hold(&s.0, a),
            Some((s, a)) => {
                self.release_waiting(&s.0);
                self.serve_free(&s.0, a, 0)
            }
            None => {
                self.pass();
                self.driver.free(ptr)
            }
        }
    }

    /// Removes `ptr` from the table of the device that served it (also from inside the hook:
    /// a block oomguard made is freed into oomguard, whoever frees it).
    fn take_live(&self, ptr: u64) -> Option<(Entered, Allocation)> {
        if ptr == 0 {
            return None;
        }
        let served = self.served.read();
        served.iter().find_map(|s| {
            let a = s.live.lock().remove(&ptr)?;
            s.in_flight.fetch_add(1, SeqCst);
            Some((Entered(Arc::clone(s)), a))
        })
    }

    /// A free while a graph is being captured: the graph may use the block whenever it is
    /// launched, and no event can be recorded now, so the block is kept out of reuse for good.
    fn hold(&self, s: &Served, a: Allocation) -> u32 {
        tracing::debug!(
            ptr = a.ptr,
            bytes = a.size,
            "a block freed during graph capture is kept out of reuse"
        );
        s.held.lock().push(a);
        s.frees.fetch_add(1, Relaxed);
        status::SUCCESS
    }

    /// A free on `stream`, which does not capture, while another stream of the context does:
    /// an event on `stream` now (legal there), the block back to the allocator later (freeing
    /// may release segments, which a capture forbids).
    fn wait_for_capture_end(&self, s: &Arc<Served>, a: Allocation, stream: u64) -> u32 {
        let id = s.stream_id(stream);
        match inside(|| s.device.allocator().backend().record_event(id)) {
            Ok(ev) => {
                s.waiting.lock().push((a, ev));
                s.frees.fetch_add(1, Relaxed);
                status::SUCCESS
            }
            Err(e) => {
                tracing::warn!(error = %e, ptr = a.ptr, "no event for a free made during capture");
                self.hold(s, a)
            }
        }
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
