//! Thread caches: how several threads allocate from one allocator without contending.
//!
//! While one thread allocates, the allocator works as it always has: one lock, blocks parked in
//! its quick lists. When a second thread allocates, the allocator switches (for good) to
//! *thread caches*: every thread gets a [`ThreadCache`] of its own, behind its own lock, and
//!
//! - an allocation is taken from the calling thread's cache when it holds a free block of
//!   exactly the rounded size on the stream (no shared lock, no shared write); otherwise the
//!   shared state finds a block (best fit, split, grow — under the allocator's lock) and *lends*
//!   it to the thread's cache, which hands it out;
//! - a free goes back to the cache that handed the block out (the owner's or, for a
//!   cross-thread free, another thread's — locking that cache only), parked there for reuse at
//!   exactly its size (at most [`CACHE_CAP`] blocks per stream and size); anything else (a full
//!   list, a block used on other streams, a large block, a thread that has exited) returns the
//!   block to the shared state under its lock. Large blocks are merged there as in one-thread
//!   mode: parked at their exact size they were out of reach of merging and best fit, and a
//!   loop whose blocks are freed on another thread than the one that made them (libtorch's
//!   autograd engine) reserved 1.2-1.4 × what it did with them merged. One exception keeps
//!   large alloc+free pairs off the shared lock: a thread parks the one large block it last
//!   freed itself (not another thread's), until its next large request reaches the shared
//!   state (which merges it first), a miss under pressure, or the first step mark (a step plan
//!   sees every large request).
//!
//! Invariants:
//! - a lent block (`BlockState::Lent`) belongs to exactly one cache slot, which says whether it
//!   is allocated or cached; neither is merged with its neighbours or indexed;
//! - lock order: the allocator's lock before any cache's lock, caches in table order; the fast
//!   paths take one cache lock only;
//! - the allocation-level statistics (allocated, active, requested, inactive split, oversize
//!   allocations) that a cache changes are kept as signed deltas in the cache
//!   ([`DeltaStats`]) and folded into the allocator's statistics whenever they are read, so that
//!   at any quiescent point they equal a recount; totals (`allocated`/`freed`) stay exact;
//! - cached blocks go back to the shared state before any out-of-memory error (and before the
//!   garbage-collection threshold releases memory), on `empty_cache`, when history or
//!   statistics scopes start, and when their thread exits (collected at the allocator's next
//!   slow allocation). A cache miss does not flush the thread's cache (single-thread mode
//!   flushes its quick lists) while growing is free: a thread's cache may so hold up to
//!   [`CACHE_CAP`] small blocks per stream and size that the shared state cannot split or
//!   merge. A miss under pressure (growing would move or release pages) drains every cache
//!   first.
//!
//! Peaks (see `peaks`): the allocated bytes' peak is exact with any number of threads (every
//! cache counts into the allocator's `LiveBytes` as it hands a block out or parks it); the
//! others are exact while only one thread allocates between two reads of the statistics, and
//! never below the true peak with several.

use std::cell::RefCell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use rustc_hash::FxHashMap;

use super::block::BlockId;
use super::live_bytes::LiveBytes;
use super::stats::{MemoryStats, Stat};
use crate::backend::StreamId;

/// Most blocks a cache parks per (stream, size), as the quick lists of the single-thread mode.
pub(crate) const CACHE_CAP: usize = 8;

/// Generations a cache takes at once from the allocator's shared counter.
pub(crate) const GENERATION_RANGE: u64 = 1 << 16;

/// Where cache generations start: the shared state numbers its own allocations from 1 up, so
/// the two never meet (2^62 allocations would take centuries).
pub(crate) const CACHE_GENERATIONS: u64 = 1 << 62;

/// What a slot of a cache holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SlotState {
    /// Nothing (the index is free for reuse).
    Vacant,
    /// A free block parked for reuse at exactly its size.
    Cached,
    /// A block handed out.
    Allocated,
}

/// A block lent to a cache.
#[derive(Debug)]
pub(crate) struct Slot {
    /// The block in the allocator's arena.
    pub block: BlockId,
    pub addr: u64,
    pub size: u64,
    pub stream: StreamId,
    pub small: bool,
    /// Counts as an inactive split block while cached (fixed segment with neighbours).
    pub split: bool,
    /// At least `max_split_size`.
    pub oversize: bool,
    pub state: SlotState,
    pub generation: u64,
    pub requested: u64,
    /// Streams other than `stream` that used the block (`record_stream`).
    pub other_streams: Vec<StreamId>,
}

/// The state of one thread's cache, behind the cache's lock.
#[derive(Debug, Default)]
pub(crate) struct CacheState {
    pub slots: Vec<Slot>,
    vacant: Vec<u32>,
    /// Cached slots by (stream, size).
    pub lists: FxHashMap<(StreamId, u64), Vec<u32>>,
    /// Slots cached.
    pub cached: usize,
    /// Slots allocated.
    pub live: usize,
    pub stats: DeltaStats,
    /// The highest each delta reached in any window since the last fold (see `peaks`).
    pub highs: [u64; CACHE_STATS],
    /// The allocator's count of allocated bytes in one order (see `peaks`).
    pub live_bytes: Arc<LiveBytes>,
    /// The one large block parked (freed by the owning thread itself; see [`CacheState::park`]).
    pub large: Option<u32>,
    /// The large slot handed out last.
    last_large: Option<u32>,
    /// This cache is counted in `parked_large`: it parked a large block since the shared state
    /// last took its parked blocks back (set while `large` is, and possibly after: a repeated
    /// pair of one size then touches no shared counter).
    large_counted: bool,
    /// Caches counted as holding a parked large block (shared by the allocator's caches): at
    /// least the number that hold one, so 0 means none does.
    pub parked_large: Arc<AtomicUsize>,
    /// The owning thread has exited: frees return blocks to the shared state.
    pub owner_gone: bool,
    /// The allocator has drained this orphan's cached blocks.
    pub collected: bool,
    gen_next: u64,
    gen_end: u64,
}

/// One thread's cache for one allocator (aligned to two cache lines: the lock of one thread's
/// cache never shares a line with another's).
#[derive(Debug)]
#[repr(align(128))]
pub(crate) struct ThreadCache {
    /// Its position in the allocator's table (handles carry it, plus one).
    pub index: u32,
    pub state: Mutex<CacheState>,
    /// The allocator's count of orphaned caches not yet collected.
    orphans: Arc<AtomicUsize>,
}

impl ThreadCache {
    pub fn new(
        index: u32,
        orphans: Arc<AtomicUsize>,
        live: Arc<LiveBytes>,
        parked_large: Arc<AtomicUsize>,
    ) -> Self {
        Self {
            index,
            state: Mutex::new(CacheState {
                live_bytes: live,
                parked_large,
                ..CacheState::default()
            }),
            orphans,
        }
    }
}

impl CacheState {
    /// A slot for a block being lent (not yet counted in any list or statistic).
    pub fn insert(&mut self, slot: Slot) -> u32 {
        match self.vacant.pop() {
            Some(i) => {
                self.slots[i as usize] = slot;
                i
            }
            None => {
                self.slots.push(slot);
                (self.slots.len() - 1) as u32
            }
        }
    }

    /// Empties slot `i` (its block goes back to the shared state).
    pub fn vacate(&mut self, i: u32) -> Slot {
        let vacant = Slot {
            state: SlotState::Vacant,
            other_streams: Vec::new(),
            ..self.slots[i as usize]
        };
        self.vacant.push(i);
        std::mem::replace(&mut self.slots[i as usize], vacant)
    }

    /// The next generation, from `shared` a range at a time.
    #[inline]
    pub fn next_generation(&mut self, shared: &std::sync::atomic::AtomicU64) -> u64 {
        if self.gen_next == self.gen_end {
            let base = shared.fetch_add(GENERATION_RANGE, Ordering::Relaxed);
            self.gen_next = base;
            self.gen_end = base + GENERATION_RANGE;
        }
        let g = self.gen_next;
        self.gen_next += 1;
        g
    }

    /// The fast path: a cached slot of exactly `size` on `stream`, handed out.
    #[inline]
    pub fn take(
        &mut self,
        stream: StreamId,
        size: u64,
        requested: u64,
        generations: &std::sync::atomic::AtomicU64,
    ) -> Option<u32> {
        let i = self.lists.get_mut(&(stream, size))?.pop()?;
        self.cached -= 1;
        if self.large == Some(i) {
            // (stays counted: the next park of this pair's block need not count it again)
            self.large = None;
        }
        let s = &self.slots[i as usize];
        let (small, split) = (s.small, s.split);
        if split {
            self.stats.inactive_split(small, size, false);
        }
        self.allocate(i, requested, generations);
        Some(i)
    }

    /// Marks slot `i` allocated for `requested` bytes and counts it.
    #[inline]
    pub fn allocate(&mut self, i: u32, requested: u64, generations: &std::sync::atomic::AtomicU64) {
        let g = self.next_generation(generations);
        self.live += 1;
        let s = &mut self.slots[i as usize];
        s.state = SlotState::Allocated;
        s.generation = g;
        s.requested = requested;
        let (small, size, oversize) = (s.small, s.size, s.oversize);
        if !small {
            self.last_large = Some(i);
        }
        self.live_bytes.add(size);
        self.stats.allocated(small, size, requested, oversize);
    }

    /// Whether `i` names the live allocation `generation` at `addr`.
    #[inline]
    pub fn is_live(&self, i: u32, generation: u64, addr: u64) -> bool {
        self.slots.get(i as usize).is_some_and(|s| {
            s.state == SlotState::Allocated && s.generation == generation && s.addr == addr
        })
    }

    /// The fast free: parks allocated slot `i` when it may be (`false`: the caller returns the
    /// block to the shared state instead). Small blocks park. Of large ones, only one per cache,
    /// freed by the owning thread itself (`own_large`: the caller allows it), and only until
    /// that thread's next large request reaches the shared state, which merges it first
    /// ([`CacheState::take_large`]): an alloc+free pair of one size repeated on a thread then
    /// takes no shared lock. Otherwise large blocks are merged on free, as in single-thread
    /// mode (`park_or_release`): parked at their exact size they are out of reach of merging
    /// and best fit, which raises fragmentation in fixed segments, and in growable ones kept a
    /// loop whose blocks are freed on another thread (libtorch's autograd engine frees the
    /// forward's activations) from settling: GPT-2 small in tch reserved 20.2-22.1 GB with them
    /// parked, 16.5 GB merged (H100, docs/GPU.md runs 34-36).
    #[inline]
    pub fn park(&mut self, i: u32, own_large: bool) -> bool {
        let s = &self.slots[i as usize];
        // (only a pair: the large block handed out last, freed by its thread before another)
        let large_ok = own_large && self.large.is_none() && self.last_large == Some(i);
        if (!s.small && !large_ok) || !s.other_streams.is_empty() || self.owner_gone {
            return false;
        }
        let (small, size, split, oversize, req) =
            (s.small, s.size, s.split, s.oversize, s.requested);
        let list = self.lists.entry((s.stream, size)).or_default();
        if list.len() >= CACHE_CAP {
            return false;
        }
        if !small {
            self.large = Some(i);
            if !self.large_counted {
                self.large_counted = true;
                self.parked_large.fetch_add(1, Ordering::Relaxed);
            }
        }
        list.push(i);
        self.cached += 1;
        self.live -= 1;
        let s = &mut self.slots[i as usize];
        s.state = SlotState::Cached;
        s.requested = 0;
        self.live_bytes.sub(size);
        self.stats.freed(small, size, req, oversize);
        if split {
            self.stats.inactive_split(small, size, true);
        }
        true
    }

    /// Takes the parked large slot out of its list, if there is one (the caller returns its
    /// block to the shared state), and stops counting this cache in `parked_large`.
    pub fn take_large(&mut self) -> Option<u32> {
        self.uncount_large();
        let i = self.large.take()?;
        let s = &self.slots[i as usize];
        if let Some(list) = self.lists.get_mut(&(s.stream, s.size)) {
            list.retain(|&j| j != i);
        }
        self.cached -= 1;
        Some(i)
    }

    /// Whether this cache is counted in `parked_large` (it may hold a parked large block).
    pub fn large_counted(&self) -> bool {
        self.large_counted
    }

    /// Stops counting this cache in `parked_large` (it holds no parked large block).
    pub fn uncount_large(&mut self) {
        if std::mem::take(&mut self.large_counted) {
            self.parked_large.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Takes every cached slot out of the lists (emptied for reuse): the caller returns their
    /// blocks to the shared state.
    pub fn drain_cached(&mut self) -> Vec<u32> {
        self.large = None;
        self.uncount_large();
        let mut out = Vec::with_capacity(self.cached);
        for list in self.lists.values_mut() {
            out.append(list);
        }
        self.cached = 0;
        out
    }
}

thread_local! {
    /// This thread's caches, one per allocator it has allocated from in multi-thread mode.
    static CACHES: RefCell<ThreadCaches> = const { RefCell::new(ThreadCaches(Vec::new())) };
    /// A number for this thread, unique in the process (0: not yet given).
    static THREAD_TOKEN: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

static NEXT_TOKEN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// A number that identifies the calling thread (never 0; 0 also while the thread is exiting).
#[inline]
pub(crate) fn thread_token() -> u64 {
    THREAD_TOKEN
        .try_with(|t| {
            let v = t.get();
            if v != 0 {
                return v;
            }
            let v = NEXT_TOKEN.fetch_add(1, Ordering::Relaxed);
            t.set(v);
            v
        })
        .unwrap_or(0)
}

/// The caches of one thread, by allocator identity; on thread exit each is marked orphaned.
struct ThreadCaches(Vec<(u64, Arc<ThreadCache>)>);

impl Drop for ThreadCaches {
    fn drop(&mut self) {
        for (_, c) in self.0.drain(..) {
            let mut s = c.state.lock();
            // counted before it can be seen, so that a collection never counts it down first
            c.orphans.fetch_add(1, Ordering::Relaxed);
            s.owner_gone = true;
        }
    }
}

/// Runs `f` on the calling thread's cache for allocator `id`, if it has one.
#[inline]
pub(crate) fn with_thread_cache<R>(id: u64, f: impl FnOnce(&ThreadCache) -> R) -> Option<R> {
    CACHES
        .try_with(|c| {
            let c = c.try_borrow().ok()?;
            let (_, cache) = c.0.iter().find(|e| e.0 == id)?;
            Some(f(cache))
        })
        .ok()
        .flatten()
}

/// Records `cache` as the calling thread's cache for allocator `id` (dropping entries of
/// allocators that no longer exist). `false` when the thread is exiting.
pub(crate) fn set_thread_cache(id: u64, cache: Arc<ThreadCache>) -> bool {
    CACHES
        .try_with(|c| {
            let Ok(mut c) = c.try_borrow_mut() else {
                return false;
            };
            // only the thread's own handle is left when the allocator (its table) is gone
            c.0.retain(|e| Arc::strong_count(&e.1) > 1);
            c.0.push((id, cache));
            true
        })
        .unwrap_or(false)
}

/// One statistic's change in a cache since the last sync (see `peaks`).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Delta {
    pub cur: i64,
    /// Highest `cur` since the last sync (never below 0: every sync restarts from 0).
    pub max: i64,
    pub allocated: u64,
    pub freed: u64,
}

impl Delta {
    #[inline(always)]
    fn add(&mut self, n: u64) {
        self.cur += n as i64;
        self.allocated = self.allocated.wrapping_add(n);
        if self.cur > self.max {
            self.max = self.cur;
        }
    }
    #[inline(always)]
    fn sub(&mut self, n: u64) {
        self.cur -= n as i64;
        self.freed = self.freed.wrapping_add(n);
    }
}

/// The allocation-level statistics a cache changes: 7 per-pool statistics (all, small, large)
/// and `oversize_allocations`, in the order of [`cache_stats_mut`].
pub(crate) const CACHE_STATS: usize = 22;

const ALLOCATED_BYTES: usize = 0;
const ALLOCATION: usize = 3;
const ACTIVE_BYTES: usize = 6;
const ACTIVE: usize = 9;
const REQUESTED_BYTES: usize = 12;
const INACTIVE_SPLIT_BYTES: usize = 15;
const INACTIVE_SPLIT: usize = 18;
const OVERSIZE_ALLOCATIONS: usize = 21;

/// A cache's statistics deltas.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DeltaStats(pub [Delta; CACHE_STATS]);

impl Default for DeltaStats {
    fn default() -> Self {
        Self([Delta::default(); CACHE_STATS])
    }
}

impl DeltaStats {
    #[inline(always)]
    fn pool_add(&mut self, base: usize, small: bool, n: u64) {
        self.0[base].add(n);
        self.0[base + if small { 1 } else { 2 }].add(n);
    }
    #[inline(always)]
    fn pool_sub(&mut self, base: usize, small: bool, n: u64) {
        self.0[base].sub(n);
        self.0[base + if small { 1 } else { 2 }].sub(n);
    }
    /// A block handed out.
    #[inline(always)]
    pub fn allocated(&mut self, small: bool, size: u64, requested: u64, oversize: bool) {
        self.pool_add(ALLOCATED_BYTES, small, size);
        self.pool_add(ALLOCATION, small, 1);
        self.pool_add(ACTIVE_BYTES, small, size);
        self.pool_add(ACTIVE, small, 1);
        self.pool_add(REQUESTED_BYTES, small, requested);
        if oversize {
            self.0[OVERSIZE_ALLOCATIONS].add(1);
        }
    }
    /// A block freed (no longer allocated nor active).
    #[inline(always)]
    pub fn freed(&mut self, small: bool, size: u64, requested: u64, oversize: bool) {
        self.pool_sub(ALLOCATED_BYTES, small, size);
        self.pool_sub(ALLOCATION, small, 1);
        self.pool_sub(ACTIVE_BYTES, small, size);
        self.pool_sub(ACTIVE, small, 1);
        self.pool_sub(REQUESTED_BYTES, small, requested);
        if oversize {
            self.0[OVERSIZE_ALLOCATIONS].sub(1);
        }
    }
    /// A split block that became cached (`add`) or stopped being cached.
    #[inline(always)]
    pub fn inactive_split(&mut self, small: bool, size: u64, add: bool) {
        if add {
            self.pool_add(INACTIVE_SPLIT, small, 1);
            self.pool_add(INACTIVE_SPLIT_BYTES, small, size);
        } else {
            self.pool_sub(INACTIVE_SPLIT, small, 1);
            self.pool_sub(INACTIVE_SPLIT_BYTES, small, size);
        }
    }

    /// Whether anything changed since the last sync (every change hands out or takes back an
    /// allocation).
    #[inline]
    pub fn changed(&self) -> bool {
        let d = &self.0[ALLOCATION];
        d.allocated != 0 || d.freed != 0
    }
}

/// The statistics a cache changes, in [`DeltaStats`] order.
pub(crate) fn cache_stats_mut(s: &mut MemoryStats) -> [&mut Stat; CACHE_STATS] {
    let [a, b, c, d, e, f, g] = [
        &mut s.allocated_bytes,
        &mut s.allocation,
        &mut s.active_bytes,
        &mut s.active,
        &mut s.requested_bytes,
        &mut s.inactive_split_bytes,
        &mut s.inactive_split,
    ];
    [
        &mut a.all,
        &mut a.small,
        &mut a.large,
        &mut b.all,
        &mut b.small,
        &mut b.large,
        &mut c.all,
        &mut c.small,
        &mut c.large,
        &mut d.all,
        &mut d.small,
        &mut d.large,
        &mut e.all,
        &mut e.small,
        &mut e.large,
        &mut f.all,
        &mut f.small,
        &mut f.large,
        &mut g.all,
        &mut g.small,
        &mut g.large,
        &mut s.oversize_allocations,
    ]
}
