//! The allocator's state under its lock: blocks, segments, free indexes and statistics, with the
//! operations every path shares (take a free block, split, free, coalesce).

use std::collections::{BTreeMap, BTreeSet};

use rustc_hash::FxHashMap;

use super::block::{Arena, Block, BlockId, BlockState, PoolKind, SegId};
use super::history::{History, TraceAction};
use super::live_bytes::LiveBytes;
use super::peaks::Peaks;
use super::pool::{FreeIndex, MIN_BLOCK, SMALL_SIZE};
use super::stats::{MemoryStats, ScopeStats};
use super::steps::{Steps, NO_SEG};
use super::thread_cache::CacheState;
use super::GrowError;
use crate::backend::handle_runs::HandleRuns;
use crate::backend::{Backend, BackendError, EventId, StreamId};
use crate::config::AllocatorConfig;

/// A segment: a fixed piece of device memory, or a growable virtual address range.
#[derive(Debug)]
pub(crate) struct Segment {
    pub base: u64,
    /// Fixed: its bytes. Growable: the reserved address range.
    pub size: u64,
    pub stream: StreamId,
    pub pool: PoolKind,
    pub growable: bool,
    /// Bytes backed by physical memory (fixed: `size`).
    pub mapped: u64,
    /// Growable: the bytes of the physical handles its maps use (`handle_size` when it was
    /// reserved, a page with a `page_recycle_threshold`: a memory limit set later does not
    /// change it, so a move reuses its handles). Fixed: the segment's size (one allocation).
    pub handle: u64,
    pub first: BlockId,
}

#[derive(Debug)]
pub(crate) struct State {
    pub cfg: AllocatorConfig,
    /// Growable segments are in use (configured and supported by the backend).
    pub growable: bool,
    pub granularity: u64,
    /// Mapped handles larger than a page: start -> bytes. Such a handle is unmapped whole or not
    /// at all, so the pages a free block can give back stop at its edges.
    pub handles: HandleRuns,
    pub blocks: Arena<Block>,
    pub segs: Arena<Segment>,
    /// The address range of every segment in `segs`: start -> end, for
    /// [`State::check_new_range`] (kept with `segs` by [`State::add_segment`] and
    /// [`State::remove_segment`]).
    seg_ranges: BTreeMap<u64, u64>,
    /// Mapped free blocks, per pool.
    pub free: [FreeIndex; 2],
    /// [`State::releasable_pages`] at the free lists' versions (a run of failures asks on
    /// every failure; the free blocks change only when something is freed or split).
    pub(super) releasable_memo: std::cell::Cell<Option<([u64; 2], u64)>>,
    /// Segments visited by scans over every segment (a diagnostic count, see
    /// `CachingAllocator::cache_entries_scanned`).
    pub segments_scanned: u64,
    /// The free lists' versions at which `release_fixed` last found no whole free segment.
    pub fixed_clean_at: Option<[u64; 2]>,
    /// Unmapped free blocks of growable segments, per pool: (stream, address, id).
    pub unmapped: [BTreeSet<(StreamId, u64, BlockId)>; 2],
    /// Blocks freed by their owner that wait for other streams' events.
    pub pending: Vec<(BlockId, Vec<EventId>)>,
    pub stats: MemoryStats,
    /// Device-wide cap on reserved bytes (`set_memory_fraction`).
    pub limit: Option<u64>,
    /// The fraction of the device that `limit` was set from, when it was set as one.
    pub fraction: Option<f64>,
    /// The most bytes ever reserved: growable segments recycle free pages rather than pass it.
    pub high_water: u64,
    /// Free pages were moved to serve a request, or the device refused a map, since the cache
    /// was last released: the allocator works at the edge of memory, where best fit alone
    /// places blocks ([`State::growable_fit`]).
    pub pressed: bool,
    /// Reserved bytes when the device last refused memory (`u64::MAX`: it has not, since the
    /// cache was last released): past it, growing needs memory the device may not have.
    pub refused_at: u64,
    /// Quick lists: blocks freed recently, by (stream, size), reused at exactly that size without
    /// a split or a merge. Flushed (merged and indexed) before anything slower happens.
    pub quick: FxHashMap<(StreamId, u64), Vec<BlockId>>,
    /// Number of parked blocks.
    pub parked: usize,
    /// The one large block parked (see `park_or_release`).
    pub large_parked: Option<BlockId>,
    /// Recorded events, when recording.
    pub history: Option<History>,
    /// The generation of the next allocation: allocations are numbered 1, 2, … and a number is
    /// never reused (2^63 of them would take centuries), so a handle names one allocation only.
    pub next_generation: u64,
    /// Open statistics scopes (`push_statistics_scope`), innermost last.
    pub scopes: Vec<ScopeStats>,
    /// The thread that allocated first ([`super::thread_cache::thread_token`]; 0: none yet).
    pub owner_thread: u64,
    /// A second thread has allocated: thread caches are in use (see `thread_cache`).
    pub multi: bool,
    /// Multi-thread mode: the peaks of the statistics the caches change (see `peaks`; each
    /// such statistic's own `peak` then holds the shared state's high since the last sync).
    pub peaks: Peaks,
    /// Multi-thread mode: allocated bytes counted in one order by every thread (see `peaks`).
    pub live: std::sync::Arc<LiveBytes>,
    /// Step marks, the current step's recording and the installed plan (`step_plan`).
    pub steps: Steps,
    /// The plan's address range ([`NO_SEG`]: none): its free blocks are not indexed.
    pub planned_seg: SegId,
}

/// Most blocks parked per (stream, size).
const QUICK_CAP: usize = 8;

impl State {
    pub fn new(cfg: AllocatorConfig, growable: bool, granularity: u64) -> Self {
        let mut stats = MemoryStats {
            max_split_size: cfg.max_split_size,
            ..MemoryStats::default()
        };
        stats.max_split_size = cfg.max_split_size;
        Self {
            cfg,
            growable,
            granularity,
            handles: HandleRuns::default(),
            blocks: Arena::default(),
            segs: Arena::default(),
            seg_ranges: BTreeMap::new(),
            free: [
                FreeIndex::with_page(granularity),
                FreeIndex::with_page(granularity),
            ],
            releasable_memo: std::cell::Cell::new(None),
            segments_scanned: 0,
            fixed_clean_at: None,
            unmapped: [BTreeSet::new(), BTreeSet::new()],
            pending: Vec::new(),
            stats,
            limit: None,
            fraction: None,
            high_water: 0,
            pressed: false,
            refused_at: u64::MAX,
            quick: FxHashMap::default(),
            parked: 0,
            large_parked: None,
            history: None,
            next_generation: 1,
            scopes: Vec::new(),
            owner_thread: 0,
            multi: false,
            peaks: Peaks::default(),
            live: Default::default(),
            steps: Steps::default(),
            planned_seg: NO_SEG,
        }
    }

    /// Whether a free (cached or parked) block counts as "inactive split", as PyTorch keeps it:
    /// part of a split fixed segment, so it cannot be returned to the device as it is. Growable
    /// segments are excluded (as in PyTorch): their free pages can always be released. Whether a
    /// block has neighbours does not change while it is free, so the count is kept exactly by
    /// adding when a block becomes free and subtracting when it stops being free. (All segments
    /// of an allocator are of one kind: growable exactly when `self.growable`.)
    #[inline]
    pub fn inactive_split(&self, b: &Block) -> bool {
        !self.growable && (b.prev.is_some() || b.next.is_some())
    }

    /// Counts block `id` into (`add`) or out of the inactive-split statistics, if it is one.
    #[inline(always)]
    pub fn count_inactive_split(&mut self, id: BlockId, add: bool) {
        if self.growable {
            return;
        }
        let b = &self.blocks[id];
        if self.inactive_split(b) {
            let (small, size) = (b.pool.is_small(), b.size);
            let s = &mut self.stats;
            if add {
                s.inactive_split.add(small, 1);
                s.inactive_split_bytes.add(small, size);
            } else {
                s.inactive_split.sub(small, 1);
                s.inactive_split_bytes.sub(small, size);
            }
        }
    }

    /// Puts a free block into the index that matches its mapped state.
    pub fn index_insert(&mut self, id: BlockId) {
        self.count_inactive_split(id, true);
        let b = &self.blocks[id];
        if b.seg == self.planned_seg {
            return; // found by offset, never by best fit (`step_plan`)
        }
        let (pool, stream, size, addr) = (b.pool as usize, b.stream, b.size, b.addr);
        if b.mapped {
            self.free[pool].insert(stream, size, addr, id);
        } else {
            let fresh = self.unmapped[pool].insert((stream, addr, id));
            debug_assert!(fresh);
        }
    }

    /// Takes a free block out of its index.
    pub fn index_remove(&mut self, id: BlockId) {
        self.count_inactive_split(id, false);
        let b = &self.blocks[id];
        if b.seg == self.planned_seg {
            return;
        }
        let (pool, stream, size, addr) = (b.pool as usize, b.stream, b.size, b.addr);
        if b.mapped {
            self.free[pool].remove(stream, size, addr, id);
        } else {
            let was = self.unmapped[pool].remove(&(stream, addr, id));
            debug_assert!(was);
        }
    }

    /// The fastest path: a parked block of exactly `size` on `stream`.
    #[inline]
    pub fn take_parked(&mut self, stream: StreamId, size: u64) -> Option<BlockId> {
        let id = self.quick.get_mut(&(stream, size))?.pop()?;
        self.parked -= 1;
        if self.large_parked == Some(id) {
            self.large_parked = None;
        }
        self.count_inactive_split(id, false);
        self.blocks[id].state = BlockState::Free;
        Some(id)
    }

    /// A freed block (no longer allocated, not pending): parked for quick reuse when its list
    /// has room, otherwise merged and indexed. Kept out of line: the quick list's hash-map
    /// entry then inlines here, which measured faster than inlining this into `free`.
    #[inline(never)]
    pub fn park_or_release(&mut self, id: BlockId) {
        let b = &self.blocks[id];
        if self.multi {
            // frees reach here only when a thread cache could not take the block
            return self.release_block(id);
        }
        // Large blocks are merged, not kept in quick lists: merged, they are there for best fit
        // when a neighbour is freed later. Parked, they kept a training loop's layout from
        // settling (candle_gpt's requests at the card's limit moved 2.5-5 GiB of pages every
        // step; with them merged, none after the first step: cli/benches/page_moves.rs), and in
        // fixed segments they raise PyTorch-mode fragmentation. One exception keeps a repeated
        // large alloc+free pair off best fit: the one large block freed last, when no neighbour
        // would merge with it, is parked until a neighbour is freed (`release_block`) or the
        // next large request that it does not serve at its exact size, which merge it first
        // (`unpark_large`): best fit sees what it would see had it been merged at the free. Not
        // with steps marked (a step plan sees every large request).
        if !b.pool.is_small() {
            let merges = |n: Option<BlockId>| {
                n.is_some_and(|n| self.blocks[n].is_free() && self.blocks[n].mapped == b.mapped)
            };
            if self.large_parked.is_some() || self.steps.on || merges(b.prev) || merges(b.next) {
                return self.release_block(id);
            }
        }
        let list = self.quick.entry((b.stream, b.size)).or_default();
        if list.len() >= QUICK_CAP {
            return self.release_block(id);
        }
        list.push(id);
        if !b.pool.is_small() {
            // (set once it is in its list: never names a block that was not parked)
            self.large_parked = Some(id);
        }
        self.parked += 1;
        self.count_inactive_split(id, true);
        let b = &mut self.blocks[id];
        let (small, size) = (b.pool.is_small(), b.size);
        let (addr, stream, requested) = (b.addr, b.stream, b.requested);
        b.state = BlockState::Parked;
        b.requested = 0;
        b.other_streams.clear();
        self.stats.active_bytes.sub(small, size);
        self.stats.active.sub(small, 1);
        // PyTorch records the requested size in alloc and free events
        self.trace(TraceAction::FreeCompleted, addr, requested, stream);
    }

    /// Merges and indexes every parked block.
    pub fn flush_parked(&mut self) {
        if self.parked == 0 {
            return;
        }
        self.large_parked = None;
        let mut lists = std::mem::take(&mut self.quick);
        for list in lists.values_mut() {
            for id in list.drain(..) {
                self.unpark(id);
            }
        }
        self.parked = 0;
        // Keep the map's allocations for the next round while it is small. Its keys are every
        // (stream, size) parked since: a trace of 40,000 streams made every flush walk 40,000
        // empty lists (91 % of its replay's time), one flush per new stream.
        if lists.len() <= Self::QUICK_KEYS_KEPT {
            self.quick = lists;
        }
    }

    /// Most (stream, size) lists a flush keeps for reuse (see [`State::flush_parked`]).
    const QUICK_KEYS_KEPT: usize = 64;

    /// Merges and indexes the parked large block, if there is one (before a large request that
    /// it did not serve looks for a free block or grows, and at a step mark).
    pub fn unpark_large(&mut self) {
        let Some(id) = self.large_parked.take() else {
            return;
        };
        let b = &self.blocks[id];
        if let Some(list) = self.quick.get_mut(&(b.stream, b.size)) {
            list.retain(|&j| j != id);
        }
        self.parked -= 1;
        self.unpark(id);
    }

    /// The free block the parked large block would be once merged (`unpark_large`), without
    /// merging it: 0 when none is parked. Its counters are the same parked or merged (parked, it
    /// counts as the free block it would be).
    pub fn parked_large_merged(&self) -> u64 {
        let Some(id) = self.large_parked else {
            return 0;
        };
        let b = &self.blocks[id];
        let merging = |n: Option<BlockId>| {
            n.map(|n| &self.blocks[n])
                .filter(|n| n.is_free() && n.mapped == b.mapped)
                .map_or(0, |n| n.size)
        };
        b.size + merging(b.next) + merging(b.prev)
    }

    /// A parked block (counted as parked: inactive split where it is one) merged and indexed.
    pub fn unpark(&mut self, id: BlockId) {
        self.count_inactive_split(id, false);
        self.blocks[id].state = BlockState::Free;
        let id = self.coalesce(id);
        self.index_insert(id);
    }

    /// The cache-hit path: the best-fitting free block for `size` on `stream`, taken out of the
    /// index and split to size. PyTorch's rules: a request below `max_split_size` never takes an
    /// oversize block, an oversize request takes one only within 20 MiB of its size; and a free
    /// block that borders unmapped address space counts as large as it could grow
    /// ([`State::growable_fit`]; `total`: the device's capacity).
    #[inline]
    pub fn take_free(
        &mut self,
        pool: PoolKind,
        stream: StreamId,
        size: u64,
        total: u64,
    ) -> Option<BlockId> {
        let (found, id) = self.growable_fit(pool, stream, size, total)?;
        let max_split = self.cfg.max_split_size;
        if (size < max_split && found >= max_split)
            || (size >= max_split && found >= size.saturating_add(self.cfg.max_non_split_rounding))
        {
            return None;
        }
        self.index_remove(id);
        self.split_to(id, size);
        Some(id)
    }

    /// Best fit, where a free block of a growable segment followed by unmapped address space
    /// counts as large as it could grow (its size and the part of the hole that could still
    /// be mapped), as PyTorch's expandable segments rank it: from the best fit, the next larger
    /// block is taken while it is smaller by that count. So a request takes a free block inside
    /// the mapped space before the one at the edge of a hole, which later requests can extend
    /// without cutting new free space. Replayed on the simulator (docs/BENCHMARKS.md), the
    /// first five steps of VGG-16 at 128 rows reserve 1.1256 × their peak live bytes with the
    /// rule, 1.3032 × without (PyTorch's rule in a model of its allocator: 1.1266 ×), and
    /// vit_b16 1.0194 × against 1.0413 × (PyTorch measured 1.0206 ×).
    ///
    /// Not at the edge of memory ([`State::pressed`]): there the rule's other layout made a
    /// VGG-16 step at 1,118 rows run out of memory on cards up to 40 MiB larger than best fit
    /// needed (the smallest card of ten repeated steps, 77.27 GiB, 0.1 % above the step's peak
    /// live bytes).
    #[inline]
    fn growable_fit(
        &self,
        pool: PoolKind,
        stream: StreamId,
        size: u64,
        total: u64,
    ) -> Option<(u64, BlockId)> {
        let mut fits = self.free[pool as usize].fits(stream, size);
        let mut best = fits.next()?;
        if self.pressed || !self.growable {
            return Some(best);
        }
        if self.hole_after(best.1).is_none() {
            return Some(best); // the common case
        }
        // what could still be mapped before the soft cap (not pressed: nothing was refused)
        let room = self.soft_cap(total).saturating_sub(self.reserved());
        let mut best_reach = self.reach(best, room);
        for next in fits {
            let reach = self.reach(next, room);
            if reach >= best_reach {
                break;
            }
            (best, best_reach) = (next, reach);
        }
        Some(best)
    }

    /// How large free block `id` of `size` bytes could grow in place: its size, and as much of
    /// the unmapped block right after it as `room` allows.
    #[inline]
    fn reach(&self, (size, id): (u64, BlockId), room: u64) -> u64 {
        size.saturating_add(self.hole_after(id).map_or(0, |hole| hole.min(room)))
    }

    /// The size of the unmapped block right after block `id`, if there is one.
    #[inline]
    fn hole_after(&self, id: BlockId) -> Option<u64> {
        let n = self.blocks[id].next?;
        (!self.blocks[n].mapped).then(|| self.blocks[n].size)
    }

    /// Splits free block `id` (not indexed) so that it is `size` bytes, when the rest is worth
    /// keeping as a block of its own; the rest goes back into the index.
    pub fn split_to(&mut self, id: BlockId, size: u64) {
        let b = &self.blocks[id];
        let rest = b.size - size;
        let worth = if b.pool.is_small() || self.segs[b.seg].growable {
            rest >= MIN_BLOCK
        } else {
            size < self.cfg.max_split_size && rest > SMALL_SIZE
        };
        if worth {
            let tail = self.split_at(id, b.addr + size);
            self.index_insert(tail);
        }
    }

    /// Marks a taken block allocated and counts it.
    #[inline]
    pub fn mark_allocated(&mut self, id: BlockId, requested: u64) {
        let b = &mut self.blocks[id];
        b.state = BlockState::Allocated;
        b.requested = requested;
        b.generation = self.next_generation;
        self.next_generation += 1;
        let (small, size) = (b.pool.is_small(), b.size);
        if self.multi {
            self.live.add(size);
        }
        let s = &mut self.stats;
        s.allocated_bytes.add(small, size);
        s.allocation.add(small, 1);
        s.active_bytes.add(small, size);
        s.active.add(small, 1);
        s.requested_bytes.add(small, requested);
        if size >= self.cfg.max_split_size {
            s.oversize_allocations.add(1);
        }
        if let Some(scope) = self.scopes.last_mut() {
            scope.allocated(requested);
        }
    }

    /// Uncounts an allocated block as allocated (it stays active until [`State::release_block`]).
    pub fn unmark_allocated(&mut self, id: BlockId) {
        let b = &self.blocks[id];
        let (small, size, req) = (b.pool.is_small(), b.size, b.requested);
        if self.multi {
            self.live.sub(size);
        }
        let s = &mut self.stats;
        s.allocated_bytes.sub(small, size);
        s.allocation.sub(small, 1);
        s.requested_bytes.sub(small, req);
        if size >= self.cfg.max_split_size {
            s.oversize_allocations.sub(1);
        }
        if let Some(scope) = self.scopes.last_mut() {
            scope.freed(req);
        }
    }

    /// Returns a block (allocated or pending) to the cache: merges it with free neighbours.
    pub fn release_block(&mut self, id: BlockId) {
        if let Some(p) = self.large_parked {
            let b = &self.blocks[id];
            if b.prev == Some(p) || b.next == Some(p) {
                // merged as it would have been at its free
                self.unpark_large();
            }
        }
        let b = &mut self.blocks[id];
        let (small, size) = (b.pool.is_small(), b.size);
        let (addr, stream, requested) = (b.addr, b.stream, b.requested);
        b.state = BlockState::Free;
        b.requested = 0;
        b.other_streams.clear();
        self.stats.active_bytes.sub(small, size);
        self.stats.active.sub(small, 1);
        self.trace(TraceAction::FreeCompleted, addr, requested, stream);
        if self.blocks[id].seg == self.planned_seg {
            self.shared_block_released(id);
        }
        let id = self.coalesce(id);
        self.index_insert(id);
    }

    /// Merges free block `id` (not indexed) with free neighbours of the same mapped state;
    /// returns the surviving block (the lowest one).
    pub fn coalesce(&mut self, mut id: BlockId) -> BlockId {
        if let Some(n) = self.blocks[id].next {
            if self.mergeable(id, n) {
                self.index_remove(n);
                self.absorb_next(id);
            }
        }
        if let Some(p) = self.blocks[id].prev {
            if self.mergeable(p, id) {
                self.index_remove(p);
                self.absorb_next(p);
                id = p;
            }
        }
        id
    }

    fn mergeable(&self, a: BlockId, b: BlockId) -> bool {
        let (a, b) = (&self.blocks[a], &self.blocks[b]);
        a.is_free() && b.is_free() && a.mapped == b.mapped
    }

    /// Block `id` takes over its next neighbour.
    fn absorb_next(&mut self, id: BlockId) {
        let n = self.blocks[id].next.expect("has a next block");
        let next = self.blocks.remove(n);
        let b = &mut self.blocks[id];
        b.size += next.size;
        b.next = next.next;
        if let Some(nn) = next.next {
            self.blocks[nn].prev = Some(id);
        }
    }

    /// Splits free block `id` (not indexed) at `addr`; returns the upper part's id (not indexed).
    pub fn split_at(&mut self, id: BlockId, addr: u64) -> BlockId {
        let b = &self.blocks[id];
        debug_assert!(addr > b.addr && addr < b.end());
        let upper = Block {
            addr,
            size: b.end() - addr,
            requested: 0,
            seg: b.seg,
            prev: Some(id),
            next: b.next,
            state: BlockState::Free,
            mapped: b.mapped,
            stream: b.stream,
            pool: b.pool,
            other_streams: Vec::new(),
            generation: 0,
            lent_to: (0, 0),
        };
        let uid = self.blocks.insert(upper);
        if let Some(n) = self.blocks[uid].next {
            self.blocks[n].prev = Some(uid);
        }
        let b = &mut self.blocks[id];
        b.size = addr - b.addr;
        b.next = Some(uid);
        uid
    }

    /// Records an event when history is on.
    #[inline]
    pub fn trace(&mut self, action: TraceAction, addr: u64, size: u64, stream: StreamId) {
        if let Some(h) = &mut self.history {
            h.record(action, addr, size, stream, None);
        }
    }

    /// Refuses a range a backend call just handed out (`op`: `alloc_segment`, `reserve`) when it
    /// overlaps a live range of this allocator: every block is placed by address, so two
    /// buffers would share memory ([`Backend::alloc_segment`] forbids it). The range is not
    /// given back: a backend that returned it may free the live one instead. A lookup in the
    /// ordered index of the segments' ranges, on the path of a driver call.
    pub fn check_new_range(
        &self,
        op: &'static str,
        base: u64,
        bytes: u64,
    ) -> Result<(), BackendError> {
        let end = base.saturating_add(bytes);
        let below = self
            .seg_ranges
            .range(..end)
            .next_back()
            .map(|(&b, &e)| (b, e));
        let homes = [
            self.steps.plan.as_ref().and_then(|p| p.shared.as_ref()),
            self.steps.draining.as_ref(),
        ]
        .into_iter()
        .flatten()
        .map(|s| (s.home, s.home.saturating_add(s.home_bytes)));
        match below
            .into_iter()
            .chain(homes)
            .find(|&(b, e)| b < end && base < e)
        {
            None => Ok(()),
            Some((b, e)) => Err(BackendError::new(
                crate::backend::BackendErrorKind::Other,
                op,
                format!(
                    "the backend handed out [{base:#x}, {end:#x}), which overlaps the live range \
                     [{b:#x}, {e:#x}) of this allocator: two buffers would share memory (a bug \
                     in the backend; the range was not used)"
                ),
            )),
        }
    }

    /// Adds a segment, its range indexed.
    pub fn add_segment(&mut self, seg: Segment) -> SegId {
        self.seg_ranges
            .insert(seg.base, seg.base.saturating_add(seg.size));
        self.segs.insert(seg)
    }

    /// Removes a segment and its range.
    pub fn remove_segment(&mut self, seg: SegId) -> Segment {
        let s = self.segs.remove(seg);
        self.seg_ranges.remove(&s.base);
        s
    }

    /// Whether the index of ranges holds every segment's range and nothing else, no two
    /// overlapping (for `check_invariants`).
    pub fn check_seg_ranges(&self) -> Result<(), String> {
        let mut want: Vec<(u64, u64)> = self
            .segs
            .iter()
            .map(|(_, s)| (s.base, s.base.saturating_add(s.size)))
            .collect();
        want.sort_unstable();
        let have: Vec<(u64, u64)> = self.seg_ranges.iter().map(|(&b, &e)| (b, e)).collect();
        if have != want {
            return Err(format!(
                "segment ranges {have:x?} against segments {want:x?}"
            ));
        }
        match want.windows(2).find(|w| w[1].0 < w[0].1) {
            Some(w) => Err(format!("segments overlap: {:x?} and {:x?}", w[0], w[1])),
            None => Ok(()),
        }
    }

    /// Bytes of device memory held (fixed segments plus mapped pages).
    pub fn reserved(&self) -> u64 {
        self.stats.reserved_bytes.all.current
    }

    /// The most this allocator may hold: the memory limit, or the device's capacity `total`
    /// without one (0: unknown, no cap).
    pub fn cap(&self, total: u64) -> u64 {
        match (self.limit, total) {
            (Some(l), 0) => l,
            (Some(l), t) => l.min(t),
            (None, 0) => u64::MAX,
            (None, t) => t,
        }
    }

    /// What the device is known to hold for this allocator: [`State::cap`] until the device
    /// refused a map, then the most this allocator held or the level of the refusal, whichever
    /// is higher (a card's reported total counts memory held outside the allocator, e.g. a
    /// framework's context). A step plan above it is not tried: the try moves every free page
    /// and creates memory until the device refuses, seconds at the edge of a large card.
    pub fn known_cap(&self, total: u64) -> u64 {
        match self.refused_at {
            u64::MAX => self.cap(total),
            refused => self.high_water.max(refused).min(self.cap(total)),
        }
    }

    /// Where growing stops being free: the memory limit (the device's capacity `total` without
    /// one; 0: unknown), lowered to the `page_recycle_threshold` share of it (or the high-water
    /// mark, when higher). Past it, growable segments move free pages instead of mapping new ones.
    pub fn soft_cap(&self, total: u64) -> u64 {
        let cap = self.cap(total);
        match self.cfg.page_recycle_threshold {
            Some(t) => ((cap as f64 * t) as u64).max(self.high_water),
            None => cap,
        }
    }

    /// Whether serving `size` more bytes from the device would pass the soft cap, or the level
    /// at which the device last refused memory: the point where memory must be moved or
    /// released rather than mapped.
    pub fn under_pressure(&self, size: u64, total: u64) -> bool {
        self.reserved().saturating_add(size) > self.soft_cap(total).min(self.refused_at)
    }

    /// Why giving the whole cache back could not leave room for a request of `size` bytes on
    /// (`pool`, `stream`) (`None`: it could): the memory limit, or the device, whose free memory
    /// plus what a release would return (whole free pages and whole free segments) is less than
    /// what the request needs from the device (in growable segments, the fewest new pages of any
    /// placement: free mapped neighbours serve the rest). Unknown device memory counts as room.
    pub fn release_cannot_serve(
        &mut self,
        backend: &dyn Backend,
        pool: PoolKind,
        stream: StreamId,
        size: u64,
    ) -> Option<GrowError> {
        let need = if self.growable {
            self.least_new_pages(pool, stream, size)
        } else {
            size
        };
        // every cached byte: an upper bound of what a release returns, without a scan
        let cached = self
            .reserved()
            .saturating_sub(self.stats.allocated_bytes.all.current);
        if let Some(l) = self.limit {
            if need > l.saturating_sub(self.reserved()).saturating_add(cached) {
                return Some(GrowError::Limit);
            }
        }
        let free = backend.mem_info().ok()?.free;
        // When the bound could do, what a release would return: whole free pages and whole
        // free segments (bytes in pages or segments that live blocks share stay).
        let returned = if need > free.saturating_add(cached) {
            cached
        } else {
            self.releasable_pages()
                .saturating_add(self.releasable_segments())
                .saturating_add(self.plan_free_pages())
        };
        (need > free.saturating_add(returned)).then(|| {
            GrowError::Backend(BackendError::oom(
                "map",
                format!(
                    "{} do not fit: the device's free memory ({}) and what a release would return ({}) are less",
                    crate::ByteSize(need),
                    crate::ByteSize(free),
                    crate::ByteSize(returned)
                ),
            ))
        })
    }

    /// The largest free block as figures report it: the free lists' largest, or the parked
    /// large block as it would be merged.
    pub fn largest_free_block(&self) -> u64 {
        self.largest_free().max(self.parked_large_merged())
    }

    /// The largest mapped free block (each free index keeps its own as blocks come and go:
    /// out-of-memory errors and statistics read it without scanning).
    pub fn largest_free(&self) -> u64 {
        self.free[0].largest().max(self.free[1].largest())
    }

    /// Moves cache `index`'s statistics deltas into the shared statistics (see `peaks`; `own`:
    /// the calling thread's cache).
    pub fn sync_cache(&mut self, index: u32, cs: &mut CacheState, own: bool) {
        self.peaks.sync(&mut self.stats, index, cs, own);
    }

    /// The free lists' versions (see [`FreeIndex::version`]).
    pub fn free_versions(&self) -> [u64; 2] {
        [self.free[0].version(), self.free[1].version()]
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use crate::alloc::CachingAllocator;
    use crate::backend::sim::SimDevice;
    use crate::{AllocatorConfig, ByteSize};

    /// An alloc+free pair on each of 2,000 streams: every miss flushes the parked blocks, and
    /// the flush no longer keeps an empty list per stream ever seen (each flush walked them
    /// all: quadratic in the streams).
    #[test]
    fn a_flush_keeps_few_empty_lists() {
        for cfg in ["expandable_segments:True", "expandable_segments:False"] {
            let sim = SimDevice::new(ByteSize::gib(80));
            let a = CachingAllocator::new(Arc::new(sim), AllocatorConfig::parse(cfg).unwrap());
            for s in 0..2_000u64 {
                let x = a.allocate(512, s).unwrap();
                a.free(x).unwrap();
                let keys = a.lock().quick.len();
                assert!(
                    keys <= super::State::QUICK_KEYS_KEPT + 1,
                    "{cfg}: {keys} lists"
                );
            }
        }
    }
}
