//! The caching allocator: pools of blocks carved from device segments, handed out best-fit,
//! split and merged, cached on free, returned to the device on `empty_cache` or under pressure.
//!
//! Layering: it calls only the [`Backend`] below it. All state sits behind one mutex; the
//! cache-hit path (a free block of the right size exists) makes no backend call except the
//! backend's `check_request` hook (a no-op on real devices).

mod block;
mod fixed;
mod growable;
mod history;
mod lending;
mod live_bytes;
mod peaks;
mod pool;
mod shared_plan;
mod snapshot;
mod state;
mod static_layout;
mod stats;
mod step_plan;
mod steps;
mod summary;
mod thread_cache;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard, RwLock};

pub use block::PoolKind;
pub use history::{Frame, HistoryContext, HistoryOptions, TraceAction, TraceEntry};
pub use pool::{MIN_BLOCK, SMALL_SIZE};
pub use snapshot::{BlockInfo, BlockStatus, SegmentInfo};
pub use static_layout::{
    peak_live, plan_static_layout, plan_static_layout_within, LifeSpan, StaticLayout,
};
pub use stats::{MemoryStats, PoolStats, ScopeCounter, ScopeStats, Stat};

use crate::backend::{Backend, BackendError, StreamId};
use crate::config::AllocatorConfig;
use crate::error::{Error, OomError};
use block::{BlockId, BlockState};
use state::State;
use thread_cache::ThreadCache;

/// A live allocation: what the allocator handed out. Freed with [`CachingAllocator::free`];
/// [`crate::DeviceBuffer`] does that on drop.
///
/// A handle names one allocation of one allocator: it carries the allocator's identity and the
/// allocation's number (never reused), so [`CachingAllocator::free`] rejects a handle that was
/// freed already (even after its memory went to a new allocation), one from another allocator,
/// and the copy a live [`crate::DeviceBuffer`] lends out through
/// [`crate::DeviceBuffer::allocation`] (the buffer frees its memory itself).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Allocation {
    /// Device address of the first byte.
    pub ptr: u64,
    /// Bytes of the block (the request rounded up).
    pub size: u64,
    /// Bytes asked for.
    pub requested: u64,
    /// The stream the allocation belongs to.
    pub stream: StreamId,
    block: BlockId,
    /// The allocation's number ([`BORROWED`] set on copies a buffer lends out).
    generation: u64,
    /// The identity of the allocator that made it.
    owner: u64,
    /// The thread cache that handed it out, plus one (0: the shared state did; `block` is then
    /// the block's index, otherwise the cache's slot).
    cache: u32,
}

/// Set in [`Allocation::generation`] on the copy a [`crate::DeviceBuffer`] lends out: such a
/// copy can name the allocation (`record_stream`) but not free it.
const BORROWED: u64 = 1 << 63;

/// The block index of zero-byte allocations, which have no block.
const NO_BLOCK: BlockId = BlockId::MAX;

impl Allocation {
    /// This handle marked as lent out by its owner (it cannot free the allocation).
    pub(crate) fn borrowed(mut self) -> Self {
        self.generation |= BORROWED;
        self
    }
    /// The owner's handle back from a lent-out copy.
    pub(crate) fn owned(mut self) -> Self {
        self.generation &= !BORROWED;
        self
    }
    /// Whether this is a copy lent out by a buffer (see [`Allocation`]).
    pub fn is_borrowed(&self) -> bool {
        self.generation & BORROWED != 0
    }
}

/// History of a free, with the caller's location (off the fast path).
#[cold]
fn record_free(st: &mut State, a: &Allocation, loc: &'static std::panic::Location<'static>) {
    if let Some(h) = &mut st.history {
        h.record(
            TraceAction::FreeRequested,
            a.ptr,
            a.requested,
            a.stream,
            Some(loc),
        );
    }
}

/// Allocator identities: every allocator made in this process gets its own.
static NEXT_ALLOCATOR_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// Why growing the cache failed.
#[derive(Debug)]
pub(crate) enum GrowError {
    /// The backend failed (out-of-memory or otherwise).
    Backend(BackendError),
    /// The device-wide limit would be passed.
    Limit,
    /// The request cannot be represented.
    TooLarge,
}

impl From<BackendError> for GrowError {
    fn from(e: BackendError) -> Self {
        GrowError::Backend(e)
    }
}

/// A caching device allocator over a [`Backend`]. Thread-safe; share it through an `Arc` (or a
/// [`crate::Device`], which does).
///
/// **Threads.** While one thread allocates, every request takes the allocator's one lock. Once a
/// second thread allocates, each thread gets a cache of its own: a request of a size the thread
/// freed before (on the same stream) and a free are served by that cache without the shared
/// lock, and a free on another thread returns the block to the cache that handed it out (on an
/// H100 host, 8 threads took 1.1–1.6× one thread's time per pair: docs/BENCHMARKS.md). Cached
/// blocks go back to the shared pool before any allocation can fail, on
/// [`CachingAllocator::empty_cache`], and when their thread exits. Current statistics stay exact,
/// and so does the peak of allocated bytes (all pools); the other peaks stay exact while one
/// thread allocates and frees, and are upper bounds otherwise, never above the reserved peak of
/// their pool (see [`CachingAllocator::stats`]).
///
/// ```
/// use std::sync::Arc;
/// use oomguard_runtime::{alloc::CachingAllocator, backend::sim::SimDevice, AllocatorConfig, ByteSize};
/// let a = CachingAllocator::new(Arc::new(SimDevice::new(ByteSize::gib(1))), AllocatorConfig::default());
/// let x = a.allocate(1000, 0).unwrap();
/// assert_eq!(x.size, 1024);
/// a.free(x).unwrap();
/// assert_eq!(a.stats().allocated_bytes.all.current, 0);
/// a.empty_cache().unwrap();
/// assert_eq!(a.stats().reserved_bytes.all.current, 0);
/// ```
#[derive(Debug)]
pub struct CachingAllocator {
    backend: Arc<dyn Backend>,
    state: Mutex<State>,
    total: u64,
    /// This allocator's identity, carried in its handles.
    id: u64,
    /// Called on every out-of-memory error, outside the state lock.
    observers: Mutex<Vec<OomObserver>>,
    /// The configuration (also in the state; this copy rounds requests without the lock).
    cfg: AllocatorConfig,
    /// Thread caches serve allocations and frees (multi-thread mode, no history, no statistics
    /// scope, not pass-through): read without the lock on the fast path.
    caching: AtomicBool,
    /// A thread may park one large block it freed in its cache (until steps are marked).
    park_large: AtomicBool,
    /// Large blocks parked in the caches now (merged before any large block is placed).
    parked_large: Arc<AtomicUsize>,
    /// Every thread's cache, by index (`None`: a vacated index).
    caches: RwLock<Vec<Option<Arc<ThreadCache>>>>,
    /// Generations for the caches, a range at a time.
    generations: AtomicU64,
    /// Caches whose thread exited and whose blocks are still to be collected.
    orphans: Arc<AtomicUsize>,
    /// Allocated bytes counted in one order in multi-thread mode (shared with the state and
    /// every cache; see `peaks`).
    live: Arc<live_bytes::LiveBytes>,
}

/// A function called with every out-of-memory error ([`CachingAllocator::attach_oom_observer`]).
#[derive(Clone)]
struct OomObserver(Arc<dyn Fn(&OomError) + Send + Sync>);

impl std::fmt::Debug for OomObserver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OomObserver")
    }
}

thread_local! {
    static THREAD_ALLOC_RETRIES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Allocator retries (the cache freed and the request tried again after an out-of-memory) that
/// allocations made by the calling thread caused, on every device. The retry engine's thrash
/// detection for steps that hold no device watches this, so that another thread's device does
/// not count.
pub fn thread_alloc_retries() -> u64 {
    THREAD_ALLOC_RETRIES.try_with(|c| c.get()).unwrap_or(0)
}

impl CachingAllocator {
    /// An allocator over `backend`. Growable segments are used when the configuration asks for
    /// them and the backend supports them.
    ///
    /// A configuration that fails [`AllocatorConfig::check`] (a field set by hand out of its
    /// key's range, e.g. a NaN memory fraction) is not used: the error is logged
    /// (`tracing::error!`; once on standard error when no `tracing` subscriber is installed)
    /// and the default configuration is in force, as [`crate::Device::sim`] does with a bad
    /// `OOMGUARD_ALLOC_CONF`. Check a configuration you build before you pass it.
    pub fn new(backend: Arc<dyn Backend>, config: AllocatorConfig) -> Self {
        let config = config.check().map(|()| config).unwrap_or_else(|e| {
            tracing::error!(error = %e, "ignoring the allocator configuration; using the default");
            static SAID: std::sync::Once = std::sync::Once::new();
            crate::config::say_once_without_subscriber(&SAID, "error", || {
                format!(
                    "ignoring the allocator configuration: {e}; using the default \
                     (AllocatorConfig::check says this before a device is made)"
                )
            });
            AllocatorConfig::default()
        });
        let growable =
            config.expandable_segments && !config.pass_through && backend.supports_growable();
        let total = backend.mem_info().map(|m| m.total).unwrap_or(0);
        let granularity = backend.granularity().max(MIN_BLOCK);
        let fraction = config.per_process_memory_fraction;
        let mut state = State::new(config, growable, granularity);
        if let Some(f) = fraction {
            state.limit = Some((total as f64 * f) as u64);
            state.fraction = Some(f);
        }
        let live = state.live.clone();
        Self {
            live,
            cfg: state.cfg.clone(),
            state: Mutex::new(state),
            backend,
            total,
            id: NEXT_ALLOCATOR_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            observers: Mutex::new(Vec::new()),
            caching: AtomicBool::new(false),
            park_large: AtomicBool::new(true),
            parked_large: Arc::default(),
            caches: RwLock::new(Vec::new()),
            generations: AtomicU64::new(thread_cache::CACHE_GENERATIONS),
            orphans: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// The backend below this allocator.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// The configuration in force.
    pub fn config(&self) -> AllocatorConfig {
        self.lock().cfg.clone()
    }

    /// Whether growable segments are in use.
    pub fn uses_growable_segments(&self) -> bool {
        self.lock().growable
    }

    #[inline]
    fn lock(&self) -> MutexGuard<'_, State> {
        // parking_lot: spins briefly before parking, which keeps short critical sections cheap
        // under contention; no poisoning (every mutation completes before anything can panic).
        self.state.lock()
    }

    /// Allocates `bytes` on `stream`: from the cache when a free block fits, otherwise from the
    /// device. On out-of-memory it frees the cache and retries once before returning
    /// [`Error::Oom`].
    ///
    /// Zero bytes allocate nothing, as in PyTorch and RMM: the handle's `ptr` is 0 (null) and
    /// its `size` 0; freeing it does nothing. A request of 1 EB (2^60 bytes) or more fails at
    /// once with out-of-memory, as in PyTorch. Out-of-memory errors are passed to the observers
    /// ([`CachingAllocator::attach_oom_observer`]) first.
    #[track_caller]
    #[inline]
    pub fn allocate(&self, bytes: u64, stream: StreamId) -> Result<Allocation, Error> {
        if bytes == 0 {
            return Ok(self.allocate_nothing(stream));
        }
        let r = match self.backend.check_request(bytes) {
            Err(e) => Err(self.fail(&mut self.lock(), bytes, e)),
            Ok(()) => {
                if self.caching.load(Relaxed) {
                    if let Some(a) = self.allocate_cached(bytes, stream) {
                        return Ok(a);
                    }
                }
                self.allocate_locked(bytes, stream)
            }
        };
        if let Err(Error::Oom(e)) = &r {
            self.notify_oom(e);
        }
        r
    }

    /// Calls the out-of-memory observers (the state lock is not held).
    #[cold]
    fn notify_oom(&self, e: &OomError) {
        let observers = self.observers.lock().clone();
        for o in observers {
            (o.0)(e);
        }
    }

    /// Registers `f` to be called with every out-of-memory error of this allocator (device,
    /// request, allocated bytes, the device's free bytes, …), as PyTorch's
    /// `torch._C._cuda_attach_out_of_memory_observer`: for instance to save a snapshot at the
    /// moment of the failure. It runs on the allocating thread, without the allocator's lock
    /// held, so it may call the allocator (`snapshot`, `memory_summary`, `empty_cache`).
    pub fn attach_oom_observer(&self, f: impl Fn(&OomError) + Send + Sync + 'static) {
        self.observers.lock().push(OomObserver(Arc::new(f)));
    }

    /// The multi-thread fast path: a block of exactly the rounded size cached by the calling
    /// thread (`None`: none).
    #[inline]
    fn allocate_cached(&self, bytes: u64, stream: StreamId) -> Option<Allocation> {
        let size = pool::round_size(bytes, &self.cfg)?;
        thread_cache::with_thread_cache(self.id, |c| {
            let mut cs = c.state.lock();
            let i = cs.take(stream, size, bytes, &self.generations)?;
            Some(self.cached_handle(c.index, i, &cs.slots[i as usize]))
        })
        .flatten()
    }

    #[track_caller]
    #[inline]
    fn allocate_locked(&self, bytes: u64, stream: StreamId) -> Result<Allocation, Error> {
        let mut st = self.lock();
        let Some(size) = pool::round_size(bytes, &st.cfg) else {
            return Err(self.refuse_huge(&mut st, bytes));
        };
        let pool = pool::pool_for(size);
        if st.owner_thread != thread_cache::thread_token() {
            self.thread_joined(&mut st);
        }
        if st.multi {
            return self.allocate_shared(st, pool, stream, size, bytes);
        }
        if st.cfg.pass_through {
            let a = self.allocate_through(&mut st, pool, stream, size, bytes)?;
            if st.history.is_some() {
                self.record_alloc(&mut st, a.block, stream);
            }
            return Ok(a);
        }
        if !st.pending.is_empty() {
            self.process_events(&mut st, false);
        }
        // marked steps: the plan's offset first (`step_plan`), and the request recorded
        let planned = if st.steps.on {
            st.plan_take(pool, stream, size, self.total)
        } else {
            None
        };
        let id = match planned {
            Some(id) => id,
            None => self.take_or_grow(&mut st, pool, stream, size, bytes)?,
        };
        if st.steps.on {
            st.step_allocated(id, pool, size, stream);
        }
        st.mark_allocated(id, bytes);
        if st.history.is_some() {
            self.record_alloc(&mut st, id, stream);
        }
        Ok(self.handle(&st, id, bytes, stream))
    }

    /// The one-thread search: a parked block, a free one, then the device.
    #[inline]
    fn take_or_grow(
        &self,
        st: &mut State,
        pool: PoolKind,
        stream: StreamId,
        size: u64,
        bytes: u64,
    ) -> Result<BlockId, Error> {
        if let Some(id) = st.take_parked(stream, size) {
            return Ok(id);
        }
        if !pool.is_small() {
            st.unpark_large();
        }
        if let Some(id) = st.take_free(pool, stream, size, self.total) {
            return Ok(id);
        }
        st.flush_parked();
        match st.take_free(pool, stream, size, self.total) {
            Some(id) => Ok(id),
            None => self.allocate_slow(st, pool, stream, size, bytes),
        }
    }

    /// Marks the end of one training step and the start of the next. Optional: a loop that
    /// calls it once per step (the glue's `train_step` does) lets the allocator serve a step
    /// that repeats from a fixed layout when best fit kept moving pages at the edge of memory.
    ///
    /// After the first mark, each step's large requests (over 1 MiB) are recorded: their order,
    /// sizes and lifetimes. At a mark after a step that moved pages or retried inside the
    /// allocator and repeated the step before it (the same large requests in the same order;
    /// growable segments only), that step's blocks are laid out once, one address range of the
    /// layout's height is mapped (the one move, here), and from then on the j-th request of a
    /// size in a step is served at the offset of the j-th request of that size in the laid-out
    /// step. A loop whose steps repeat then maps, unmaps and waits for nothing. A step that
    /// repeated the one before with nothing moved (room to spare) is laid out once per run of
    /// repeating steps, and gets a plan when that would leave at most 98 % of the bytes
    /// reserved (its free pages given back first, so reserved memory never rises for it; not
    /// after a plan was dropped for its misses). Requests that
    /// differ from the recorded step are served as without marks (or, where only moved pages
    /// could serve them, in the plan's free space); after two steps in a row with such misses,
    /// on [`CachingAllocator::empty_cache`] and before an out-of-memory release, the plan is
    /// dropped. [`MemoryStats`] counts marks, plans and hits. What the program computes does
    /// not change, only where its blocks sit. The limit: a step that differs from the laid-out
    /// one at the very edge of memory can run out of memory where best fit alone would not
    /// (3–5 of 40 random loops with changed steps on the simulator; every loop of repeating
    /// steps ran); `step_plans:False` in the configuration turns plans off.
    ///
    /// Measured on the simulator: VGG-16 from tch at 1,118 rows (77.18 GiB live, the step
    /// recorded in `traces/tch_vgg16_b1118.trace.csv`) on an 80 GiB card moved 10-24 GiB of
    /// pages a step without marks; with them, nothing once the plan is installed (at the third
    /// mark), on one thread and with libtorch's autograd thread freeing the backward's blocks.
    pub fn mark_step(&self) {
        let mut st = self.lock();
        // the plan's map changes reserved bytes: an interval of its own (`peaks`)
        self.fold_caches(&mut st);
        if st.plans_possible() && self.park_large.swap(false, Relaxed) {
            // from now on every large request and free reaches the shared state (recorded)
            self.drain_all_caches(&mut st);
        }
        st.mark_step(&*self.backend, self.total);
        self.fold_caches(&mut st);
    }

    /// History of an allocation, with the caller's location (off the fast path).
    #[track_caller]
    fn record_alloc(&self, st: &mut State, id: BlockId, stream: StreamId) {
        // the requested size, as PyTorch records it (the block's size is in the snapshot)
        let (addr, requested) = (st.blocks[id].addr, st.blocks[id].requested);
        if let Some(h) = &mut st.history {
            h.record(
                TraceAction::Alloc,
                addr,
                requested,
                stream,
                Some(std::panic::Location::caller()),
            );
        }
    }

    /// `backend:cudaMallocAsync`: a segment of exactly the rounded size for every allocation.
    /// Blocks freed while other streams used them go back to the device once those streams'
    /// events complete (checked first, waited for on out-of-memory).
    fn allocate_through(
        &self,
        st: &mut State,
        pool: PoolKind,
        stream: StreamId,
        size: u64,
        bytes: u64,
    ) -> Result<Allocation, Error> {
        if !st.pending.is_empty() {
            self.process_events(st, false);
            st.release_fixed(&*self.backend);
        }
        let mut grown = st.grow_exact(&*self.backend, pool, stream, size);
        if matches!(&grown, Err(GrowError::Backend(e)) if e.is_oom()) && !st.pending.is_empty() {
            st.stats.num_alloc_retries += 1;
            self.process_events(st, true);
            st.release_fixed(&*self.backend);
            grown = st.grow_exact(&*self.backend, pool, stream, size);
        }
        let id = grown.map_err(|e| self.grow_failed(st, bytes, e))?;
        st.mark_allocated(id, bytes);
        Ok(self.handle(st, id, bytes, stream))
    }

    /// The device must give more memory: grow; on out-of-memory release the cache and try again.
    fn allocate_slow(
        &self,
        st: &mut State,
        pool: PoolKind,
        stream: StreamId,
        size: u64,
        bytes: u64,
    ) -> Result<BlockId, Error> {
        if let Some(t) = st.cfg.garbage_collection_threshold {
            if st.reserved() as f64 + size as f64 > t * self.total as f64 {
                self.drain_all_caches(st);
                self.release_cache(st, false);
                if let Some(id) = st.take_free(pool, stream, size, self.total) {
                    return Ok(id);
                }
            }
        }
        let first = self.grow(st, pool, stream, size, false);
        let err = match first {
            Ok(id) => return Ok(id),
            Err(GrowError::TooLarge) => return Err(too_large(bytes)),
            Err(GrowError::Backend(e)) if !e.is_oom() => return Err(Error::Backend(e)),
            Err(e) => e,
        };
        // Out of memory: wait for pending cross-stream frees, give the cache back, retry.
        st.stats.num_alloc_retries += 1;
        THREAD_ALLOC_RETRIES.with(|c| c.set(c.get() + 1));
        // (nothing pending: nothing to wait for; the release below counts its own wait)
        let waited = !st.pending.is_empty();
        if waited {
            self.process_events(st, true);
        }
        if let Some(id) = st.take_free(pool, stream, size, self.total) {
            return Ok(id);
        }
        // memory parked in any thread's cache goes back before anything fails
        self.drain_all_caches(st);
        if let Some(id) = st.take_free(pool, stream, size, self.total) {
            return Ok(id);
        }
        // Releasing the cache costs a device-wide synchronisation and, for growable segments,
        // every free page (which the next requests map again). When even all of it could not
        // serve this request, fail without releasing: cuDNN and cuBLAS probe workspaces far
        // larger than what is left, one failure after another.
        if st
            .release_cannot_serve(&*self.backend, pool, stream, size)
            .is_some()
        {
            st.stats.num_releases_skipped += 1;
            if st.growable {
                // (an address range the first grow reserved holds nothing)
                st.release_empty_ranges_of(&*self.backend, pool, stream);
            }
            return Err(self.fail(st, bytes, first_cause(st, err)));
        }
        let released = self.release_cache(st, waited);
        // the memory limit is the user's stated capacity: a request under it is served, in a
        // segment of its own size if need be
        let second = self.grow(st, pool, stream, size, true);
        if second.is_err() {
            // An address range reserved for this request holds nothing: give it back now
            // rather than at the next empty_cache. Only the request's pool and stream can hold
            // one, unless pages were just released (then any range may have emptied); a look
            // at every segment on each failure made a run of failures quadratic.
            if released > 0 {
                st.release_empty_ranges(&*self.backend);
            } else if st.growable {
                st.release_empty_ranges_of(&*self.backend, pool, stream);
            }
        }
        match second {
            Ok(id) => Ok(id),
            Err(GrowError::Backend(e)) if !e.is_oom() => Err(Error::Backend(e)),
            Err(GrowError::Backend(e)) => Err(self.fail(st, bytes, e)),
            Err(_) => Err(self.fail(st, bytes, first_cause(st, err))),
        }
    }

    /// Grows the cache for a request of `size`; `exact_under_limit`: a fixed segment of
    /// exactly `size` when the rounded one would pass the memory limit.
    fn grow(
        &self,
        st: &mut State,
        pool: PoolKind,
        stream: StreamId,
        size: u64,
        exact_under_limit: bool,
    ) -> Result<BlockId, GrowError> {
        if st.growable {
            st.grow_growable(&*self.backend, pool, stream, size, self.total)
        } else {
            st.grow_fixed(&*self.backend, pool, stream, size, exact_under_limit)
        }
    }

    /// The error of a segment that could not be grown for a request of `bytes`.
    fn grow_failed(&self, st: &mut State, bytes: u64, e: GrowError) -> Error {
        match e {
            GrowError::Backend(e) => self.fail(st, bytes, e),
            GrowError::TooLarge => too_large(bytes),
            GrowError::Limit => {
                let e = limit_exceeded(st);
                self.fail(st, bytes, e)
            }
        }
    }

    /// Builds the out-of-memory error (and counts it).
    fn fail(&self, st: &mut State, bytes: u64, cause: BackendError) -> Error {
        if !cause.is_oom() {
            return Error::Backend(cause);
        }
        st.stats.num_ooms += 1;
        self.fold_caches(st);
        let info = self.backend.mem_info().unwrap_or_default();
        st.trace(TraceAction::Oom, info.free, bytes, 0);
        let allocated = st.stats.allocated_bytes.all.current;
        Error::Oom(OomError {
            requested: bytes,
            device: self.backend.ordinal(),
            device_total: info.total,
            device_free: info.free,
            allocated,
            reserved_unallocated: st.reserved().saturating_sub(allocated),
            largest_free_block: st.largest_free_block(),
            cause: Some(cause.to_string()),
            expandable_segments: st.growable,
            memory_limit: st.limit,
        })
    }

    /// Gives cached memory back: whole free fixed segments and free pages of growable segments.
    fn release_cache(&self, st: &mut State, sync_counted: bool) -> u64 {
        // what the device refused is learned again from here
        st.refused_at = u64::MAX;
        st.pressed = false;
        // a step plan's free offsets become ordinary free blocks (best fit, releasable)
        st.drop_plan();
        st.release_drained_plan(&*self.backend);
        let fixed = st.release_fixed(&*self.backend);
        if fixed > 0 && !sync_counted {
            // (freeing a segment waits for the whole device)
            st.stats.num_sync_all_streams += 1;
        }
        fixed
            + st.release_pages(
                &*self.backend,
                u64::MAX,
                [None, None],
                growable::Release::All { sync_counted },
            )
    }

    /// Whether `a` names a live allocation of this allocator (lent-out copies included).
    fn is_live(&self, st: &State, a: &Allocation) -> bool {
        let generation = a.generation & !BORROWED;
        if a.cache != 0 {
            return a.owner == self.id
                && self
                    .cache_at(a.cache)
                    .is_some_and(|c| c.state.lock().is_live(a.block, generation, a.ptr));
        }
        a.owner == self.id
            && st.blocks.get(a.block).is_some_and(|b| {
                b.state == BlockState::Allocated && b.generation == generation && b.addr == a.ptr
            })
    }

    /// Returns an allocation to the cache. Fails (changing nothing) for a handle that is not live
    /// (freed already), is from another allocator, or is the copy a live
    /// [`crate::DeviceBuffer`] lends out. Freeing a zero-byte (null) allocation does nothing.
    /// The caller's location is what the history records as where the block was freed.
    #[track_caller]
    pub fn free(&self, a: Allocation) -> Result<(), Error> {
        if a.cache != 0 {
            return self.free_cached(a);
        }
        let mut st = self.lock();
        // One test for the common case: the owner's handle of a live block (a lent-out copy has
        // the BORROWED bit in its generation, a null handle no block, so neither matches).
        let owned_live = a.owner == self.id
            && st.blocks.get(a.block).is_some_and(|b| {
                b.generation == a.generation && b.state == BlockState::Allocated && b.addr == a.ptr
            });
        if !owned_live {
            return self.reject_free(&mut st, &a);
        }
        if st.multi {
            return self.free_between_folds(&mut st, &a, std::panic::Location::caller());
        }
        self.free_block(&mut st, &a, a.block, std::panic::Location::caller());
        Ok(())
    }

    /// A free of a block the shared state handed out, in multi-thread mode: not on behalf of a
    /// cache, so its changes get an interval of their own (`peaks`).
    #[cold]
    fn free_between_folds(
        &self,
        st: &mut State,
        a: &Allocation,
        loc: &'static std::panic::Location<'static>,
    ) -> Result<(), Error> {
        self.fold_caches(st);
        self.free_block(st, a, a.block, loc);
        self.fold_caches(st);
        Ok(())
    }

    /// Frees allocated block `id` (handle `a`, validated): uncounts it, then parks it, merges it
    /// or (used on other streams) leaves it pending.
    fn free_block(
        &self,
        st: &mut State,
        a: &Allocation,
        id: BlockId,
        loc: &'static std::panic::Location<'static>,
    ) {
        st.unmark_allocated(id);
        if st.steps.on {
            st.step_freed(id);
        }
        if st.history.is_some() {
            record_free(st, a, loc);
        }
        let others = std::mem::take(&mut st.blocks[id].other_streams);
        if others.is_empty() {
            if st.cfg.pass_through {
                st.release_block(id);
                st.release_fixed(&*self.backend);
                return;
            }
            st.park_or_release(id);
            return;
        }
        // Used on other streams: reuse only after their work queued so far has finished.
        let mut events = Vec::with_capacity(others.len());
        for s in others {
            match self.backend.record_event(s) {
                Ok(e) => events.push(e),
                Err(e) => {
                    tracing::warn!(error = %e, "record_event failed; synchronizing instead");
                    let _ = self.backend.synchronize();
                }
            }
        }
        st.blocks[id].state = BlockState::PendingFree;
        st.pending.push((id, events));
    }

    /// Why `free` refused a handle (off the fast path): a null handle frees nothing (its
    /// owner's handle counts as a free in an open statistics scope, as rmm counts it).
    #[cold]
    fn reject_free(&self, st: &mut State, a: &Allocation) -> Result<(), Error> {
        if a.block == NO_BLOCK && a.cache == 0 && a.owner == self.id {
            if !a.is_borrowed() {
                if let Some(scope) = st.scopes.last_mut() {
                    scope.freed(0);
                }
            }
            return Ok(());
        }
        if a.is_borrowed() && self.is_live(st, a) {
            return Err(Error::InvalidArgument(format!(
                "free of {:#x}: this handle is a copy lent out by a DeviceBuffer, which frees its \
                 memory when dropped; drop the buffer instead",
                a.ptr
            )));
        }
        Err(Error::InvalidArgument(format!(
            "free of {:#x}: not a live allocation of this allocator (double free?)",
            a.ptr
        )))
    }

    /// Marks an allocation as used by `stream` as well as its own, as PyTorch's `record_stream`:
    /// when freed, it is not reused until the work queued on `stream` by then has completed.
    pub fn record_stream(&self, a: &Allocation, stream: StreamId) -> Result<(), Error> {
        if a.block == NO_BLOCK && a.cache == 0 && a.owner == self.id {
            return Ok(()); // a zero-byte allocation: no memory to protect
        }
        if a.cache != 0 {
            return self.record_stream_cached(a, stream);
        }
        let mut st = self.lock();
        if !self.is_live(&st, a) {
            return Err(Error::InvalidArgument(format!(
                "record_stream on {:#x}: not a live allocation of this allocator",
                a.ptr
            )));
        }
        let b = &mut st.blocks[a.block];
        if stream != b.stream && !b.other_streams.contains(&stream) {
            b.other_streams.push(stream);
        }
        Ok(())
    }

    /// Frees pending blocks whose events have completed (all of them, waiting, with `wait`:
    /// PyTorch's `synchronize_and_free_events`, counted in `num_sync_all_streams` as there).
    fn process_events(&self, st: &mut State, wait: bool) {
        if wait {
            st.stats.num_sync_all_streams += 1;
        }
        let pending = std::mem::take(&mut st.pending);
        for (id, events) in pending {
            let mut left = Vec::new();
            for ev in events {
                let done = if wait {
                    self.backend.wait_event(ev).map(|_| true)
                } else {
                    self.backend.event_done(ev)
                };
                match done {
                    Ok(true) => {}
                    Ok(false) => left.push(ev),
                    Err(e) => {
                        tracing::warn!(error = %e, "event query failed; synchronizing");
                        let _ = self.backend.synchronize();
                    }
                }
            }
            if left.is_empty() {
                st.release_block(id);
            } else {
                st.pending.push((id, left));
            }
        }
    }

    /// Returns every cached unused segment and page to the device (waiting for pending
    /// cross-stream frees first). Allocated memory is untouched.
    pub fn empty_cache(&self) -> Result<(), Error> {
        let mut st = self.lock();
        // with thread caches, the changes below get an interval of their own (`peaks`)
        self.fold_caches(&mut st);
        self.process_events(&mut st, true);
        self.drain_all_caches(&mut st);
        st.flush_parked();
        st.step_before_empty_cache();
        st.release_drained_plan(&*self.backend);
        st.release_fixed(&*self.backend);
        st.release_pages(
            &*self.backend,
            u64::MAX,
            [None, None],
            growable::Release::All { sync_counted: true },
        );
        st.release_empty_ranges(&*self.backend);
        st.step_after_empty_cache();
        self.fold_caches(&mut st);
        Ok(())
    }

    /// A copy of the statistics. Current values and totals are exact at any moment no other
    /// thread allocates or frees. Peaks are exact while one thread allocates and frees (since
    /// the previous call or [`CachingAllocator::reset_peak_stats`]), also after other threads
    /// have used the allocator (thread caches, see [`CachingAllocator`]). With any number of
    /// threads, `allocated_bytes.all.peak` is exact (allocated bytes are counted in one order
    /// by every thread); while several threads allocate or free between two calls, each other
    /// `peak` is an upper bound: never below the true peak, never above the reserved peak of
    /// its pool.
    pub fn stats(&self) -> MemoryStats {
        let mut st = self.lock();
        self.fold_caches(&mut st);
        let mut s = st.stats;
        // A parked large block is free memory, counted as merged; it stays parked, so that
        // reading the statistics changes nothing the allocator does next (it was merged here,
        // and a replay that read them at every event reserved 8 MiB more on resnet50).
        s.largest_free_block = st.largest_free_block();
        let live = st.multi.then_some(&*st.live);
        st.peaks.apply_floors(&mut s, live);
        s
    }

    /// A diagnostic, not a statistic: free blocks and segments visited so far by scans over
    /// all of them (the largest free block, whole free fixed segments, free pages to release,
    /// empty address ranges). Tests read it to check that a path does not rescan the cache,
    /// with a count rather than a clock.
    #[doc(hidden)]
    pub fn cache_entries_scanned(&self) -> u64 {
        let st = self.lock();
        st.free
            .iter()
            .fold(st.segments_scanned, |n, f| n.wrapping_add(f.scanned()))
    }

    /// `num_alloc_retries` alone, without copying every statistic (for per-step checks).
    pub fn num_alloc_retries(&self) -> u64 {
        self.lock().stats.num_alloc_retries
    }

    /// The counters of work the allocator does under pressure, without copying every statistic
    /// (read around each step by the retry engine's thrash detection): `num_alloc_retries`,
    /// `num_unmap`, `unmapped_bytes_total`, and `num_sync_all_streams + num_stream_syncs`.
    pub(crate) fn churn_counters(&self) -> [u64; 4] {
        let st = self.lock();
        let s = &st.stats;
        [
            s.num_alloc_retries,
            s.num_unmap,
            s.unmapped_bytes_total,
            s.num_sync_all_streams.wrapping_add(s.num_stream_syncs),
        ]
    }

    /// Allocated and reserved bytes now, without copying every statistic.
    pub fn allocated_and_reserved(&self) -> (u64, u64) {
        let mut st = self.lock();
        self.fold_caches(&mut st);
        (st.stats.allocated_bytes.all.current, st.reserved())
    }

    /// Takes `bytes` from the device now and keeps them cached for later requests, as rmm's
    /// `pool_memory_resource` initial pool size or JAX's preallocation: one block of the large
    /// pool (requests above 1 MiB), which later requests split (`max_split_size` permitting; the
    /// small pool keeps its own 2 MiB segments). What is taken is `bytes` rounded up to the 2 MiB
    /// pages (growable segments) or to a segment of a multiple of 2 MiB (native mode; exactly
    /// `bytes`, rounded to 512, where that would pass the maximum), at least 2 MiB: native mode
    /// does not give a reservation under 10 MiB the 20 MiB segment an allocation gets. `bytes`
    /// must not exceed the maximum (the memory limit, [`CachingAllocator::set_memory_limit`] /
    /// `per_process_memory_fraction`) nor the device's capacity ([`Error::InvalidArgument`]);
    /// out-of-memory otherwise. 0 does nothing.
    pub fn reserve_initial(&self, bytes: u64) -> Result<(), Error> {
        if bytes == 0 {
            return Ok(());
        }
        let (max, native) = {
            let st = self.lock();
            let max = st.limit.unwrap_or(u64::MAX).min(self.total);
            (max, !st.growable && !st.cfg.pass_through)
        };
        if bytes > max {
            return Err(Error::InvalidArgument(format!(
                "initial reservation of {} exceeds the maximum of {} (the memory limit or the \
                 device's capacity)",
                crate::ByteSize(bytes),
                crate::ByteSize(max)
            )));
        }
        if native {
            return self.reserve_segment(bytes, max);
        }
        // above the small pool, whatever was asked
        let a = self.allocate(bytes.max(pool::SMALL_SIZE + 1), 0)?;
        self.free(a)?;
        // with thread caches the freed block is parked in this thread's cache: hand it to the
        // shared pool, where every thread's requests can split it
        self.drain_own_cache();
        Ok(())
    }

    /// [`CachingAllocator::reserve_initial`] in native mode: one fixed segment of `bytes` (see
    /// there), its one block free in the large pool; the cache is emptied and the segment tried
    /// again if the device refuses it.
    fn reserve_segment(&self, bytes: u64, max: u64) -> Result<(), Error> {
        let at_least = bytes.max(pool::SMALL_SIZE + 1);
        let size = [pool::ROUND_LARGE, pool::MIN_BLOCK]
            .into_iter()
            .filter_map(|unit| at_least.checked_next_multiple_of(unit))
            .find(|&size| size <= max)
            .unwrap_or(at_least);
        let mut st = self.lock();
        let mut grown = st.grow_exact(&*self.backend, PoolKind::Large, 0, size);
        let room_cached = |g: &Result<BlockId, GrowError>| match g {
            Err(GrowError::Backend(e)) => e.is_oom(),
            Err(GrowError::Limit) => true,
            _ => false,
        };
        if room_cached(&grown) {
            // As an allocation's last resort: every cached block, also those parked or in a
            // thread's cache, merged so that whole free segments go back.
            st.stats.num_alloc_retries += 1;
            let waited = !st.pending.is_empty();
            if waited {
                self.process_events(&mut st, true);
            }
            self.drain_all_caches(&mut st);
            st.flush_parked();
            self.release_cache(&mut st, waited);
            grown = st.grow_exact(&*self.backend, PoolKind::Large, 0, size);
        }
        let r = match grown {
            Ok(id) => {
                st.index_insert(id);
                return Ok(());
            }
            Err(e) => self.grow_failed(&mut st, bytes, e),
        };
        drop(st);
        if let Error::Oom(e) = &r {
            self.notify_oom(e);
        }
        Err(r)
    }

    /// Opens a nested statistics scope, as rmm's `statistics_resource_adaptor::push_counters`:
    /// until it is popped, every allocation adds its requested bytes and every free (of any
    /// allocation, also one made before the scope) subtracts them, so the value can go negative.
    ///
    /// Unlike a [`crate::guard::PeakScope`] (block sizes, only allocations made inside the scope
    /// and their frees, never negative), this counts what rmm counts, zero-byte allocations
    /// (null handles) and their frees included.
    pub fn push_statistics_scope(&self) {
        let mut st = self.lock();
        st.scopes.push(ScopeStats::default());
        self.update_caching(&mut st);
    }

    /// Closes the innermost statistics scope and returns its counters; they are folded into the
    /// scope below, if any (rmm's `pop_counters`). `Err` when no scope is open.
    pub fn pop_statistics_scope(&self) -> Result<ScopeStats, Error> {
        let mut st = self.lock();
        let top = st.scopes.pop().ok_or_else(|| {
            Error::InvalidArgument("pop_statistics_scope: no statistics scope is open".into())
        })?;
        if let Some(below) = st.scopes.last_mut() {
            below.fold(&top);
        }
        self.update_caching(&mut st);
        Ok(top)
    }

    /// The counters of the innermost open statistics scope (`None` when none is open).
    pub fn statistics_scope(&self) -> Option<ScopeStats> {
        self.lock().scopes.last().copied()
    }

    /// Resets every peak to its current value.
    pub fn reset_peak_stats(&self) {
        let mut st = self.lock();
        self.fold_caches(&mut st);
        st.stats.reset_peaks();
        st.peaks.reset();
        st.live.reset_peak();
    }

    /// Resets the accumulated totals (`allocated`/`freed` of every statistic) and the event
    /// counters (`num_*`, mapped/unmapped totals) to zero, as PyTorch's
    /// `reset_accumulated_memory_stats`; current values and peaks stay.
    pub fn reset_accumulated_memory_stats(&self) {
        let mut st = self.lock();
        self.fold_caches(&mut st);
        st.stats.reset_accumulated();
    }

    /// Caps the bytes this allocator may hold from the device (`None`: no cap), as PyTorch's
    /// `set_per_process_memory_fraction`. Memory already held stays; growth past the cap fails
    /// with out-of-memory after the cache is released.
    pub fn set_memory_limit(&self, limit: Option<u64>) {
        let mut st = self.lock();
        st.limit = limit;
        st.fraction = None;
    }

    /// Caps the bytes this allocator may hold at `fraction` of the device's capacity (PyTorch's
    /// `set_per_process_memory_fraction`); `Err` unless `0 <= fraction <= 1`. 0 allows nothing,
    /// as in PyTorch (every request but a zero-byte one then fails with out-of-memory).
    pub fn set_memory_fraction(&self, fraction: f64) -> Result<(), Error> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(Error::InvalidArgument(format!(
                "memory fraction must be in [0, 1], got {fraction}"
            )));
        }
        let mut st = self.lock();
        st.limit = Some((self.total as f64 * fraction) as u64);
        st.fraction = Some(fraction);
        Ok(())
    }

    /// The fraction of the device's capacity this allocator may hold (PyTorch's
    /// `get_per_process_memory_fraction`): 1.0 without a cap; a cap set in bytes
    /// ([`CachingAllocator::set_memory_limit`]) as its share of the capacity.
    pub fn memory_fraction(&self) -> f64 {
        let st = self.lock();
        match (st.fraction, st.limit) {
            (Some(f), _) => f,
            (None, Some(l)) if self.total > 0 => l as f64 / self.total as f64,
            _ => 1.0,
        }
    }

    /// The cap set by [`CachingAllocator::set_memory_limit`].
    pub fn memory_limit(&self) -> Option<u64> {
        self.lock().limit
    }

    /// Counts `bytes` of pinned host memory taken (`taken`) or given back in
    /// [`MemoryStats::pinned_bytes`].
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn count_pinned(&self, bytes: u64, taken: bool) {
        let mut st = self.lock();
        if taken {
            st.stats.pinned_bytes.add(bytes);
        } else {
            st.stats.pinned_bytes.sub(bytes);
        }
    }

    /// Device capacity as the backend reported it when the allocator was made.
    pub fn device_total(&self) -> u64 {
        self.total
    }

    /// A zero-byte allocation: no memory, counted only by an open statistics scope (as rmm
    /// counts it).
    #[cold]
    fn allocate_nothing(&self, stream: StreamId) -> Allocation {
        if let Some(scope) = self.lock().scopes.last_mut() {
            scope.allocated(0);
        }
        self.null_handle(stream)
    }

    /// A request of 1 EB or more: out of memory at once, as in PyTorch (whose message the
    /// error's `Display` repeats).
    #[cold]
    fn refuse_huge(&self, st: &mut State, bytes: u64) -> Error {
        let e = BackendError::oom("allocate", "requests of 1EB or more are refused");
        self.fail(st, bytes, e)
    }

    /// The handle of a zero-byte allocation: no block, a null pointer.
    fn null_handle(&self, stream: StreamId) -> Allocation {
        Allocation {
            ptr: 0,
            size: 0,
            requested: 0,
            stream,
            block: NO_BLOCK,
            generation: 0,
            owner: self.id,
            cache: 0,
        }
    }

    /// The handle of allocated slot `i` of cache `cache` (its index).
    #[inline]
    fn cached_handle(&self, cache: u32, i: u32, s: &thread_cache::Slot) -> Allocation {
        Allocation {
            ptr: s.addr,
            size: s.size,
            requested: s.requested,
            stream: s.stream,
            block: i,
            generation: s.generation,
            owner: self.id,
            cache: cache + 1,
        }
    }

    /// The handle of allocated block `id`.
    #[inline]
    fn handle(&self, st: &State, id: BlockId, requested: u64, stream: StreamId) -> Allocation {
        let b = &st.blocks[id];
        Allocation {
            ptr: b.addr,
            size: b.size,
            requested,
            stream,
            block: id,
            generation: b.generation,
            owner: self.id,
            cache: 0,
        }
    }
}

/// The backend's refusal behind a failed grow (the memory limit's, when the limit refused it).
fn first_cause(st: &State, err: GrowError) -> BackendError {
    match err {
        GrowError::Backend(e) => e,
        _ => limit_exceeded(st),
    }
}

/// The cause of an out-of-memory at the device-wide memory limit: the limit and what is
/// reserved against it (the figures a user sets the limit or the fraction by).
fn limit_exceeded(st: &State) -> BackendError {
    let limit = st
        .limit
        .map_or_else(|| "none".into(), |l| crate::ByteSize(l).to_string());
    BackendError::oom(
        "limit",
        format!(
            "the device-wide memory limit of {limit} would be exceeded ({} reserved; \
             set_memory_limit / per_process_memory_fraction)",
            crate::ByteSize(st.reserved())
        ),
    )
}

fn too_large(bytes: u64) -> Error {
    Error::InvalidArgument(format!(
        "allocation of {bytes} bytes is too large to represent"
    ))
}
