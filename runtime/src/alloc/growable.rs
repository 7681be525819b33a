//! Growable ("expandable") segments: one large virtual address range per pool and stream,
//! physical pages mapped where blocks need them and unmapped from free space under pressure or on
//! `empty_cache`. Fragmentation of the address space costs nothing; physical memory follows live
//! bytes at page granularity.

use super::block::{Block, BlockId, BlockState, PoolKind};
use super::history::TraceAction;
use super::pool::FreeIndex;
use super::state::{Segment, State};
use super::GrowError;
use crate::backend::handle_runs::handle_size;
use crate::backend::{Backend, BackendError, StreamId};

/// The largest address range reserved for a pool and stream when the request is not larger.
const MAX_RANGE: u64 = 1 << 56;

/// Where [`State::grow_growable`] maps pages: `cost` bytes at the start of the unmapped block
/// `hole`, joining the free mapped neighbours in `uses`.
#[derive(Clone, Copy, Debug)]
struct Placement {
    hole: BlockId,
    cost: u64,
    uses: [Option<BlockId>; 2],
}

impl State {
    /// Maps pages so that a free block of at least `size` exists on (`pool`, `stream`), placing
    /// them where the fewest new pages are needed; returns that block split to `size`, not indexed.
    ///
    /// Pages move only under pressure: while the map fits under the memory limit (or the
    /// `page_recycle_threshold` share of it) and the device has the memory, new pages are
    /// mapped and free ones stay where they are, so a loop whose layout has settled makes no
    /// driver call. When the map would pass the limit, or the device refuses it, free pages
    /// are moved from holes to where the request needs them: unmapped with their physical
    /// handles kept, and mapped again at once (a remap, no release and create).
    pub fn grow_growable(
        &mut self,
        backend: &dyn Backend,
        pool: PoolKind,
        stream: StreamId,
        size: u64,
        total: u64,
    ) -> Result<BlockId, GrowError> {
        let r = self.grow_growable_inner(backend, pool, stream, size, total);
        // Handles kept by a move but not mapped again, or left by a map the backend refused
        // (the CUDA backend keeps the pages it had mapped as spares): give them back, so that
        // reserved memory is exactly the mapped pages again. (Growing maps pages anyway: one
        // more backend call here costs nothing that shows.)
        if let Err(e) = backend.release_spares() {
            tracing::warn!(error = %e, "releasing spare pages failed");
        }
        r
    }

    fn grow_growable_inner(
        &mut self,
        backend: &dyn Backend,
        pool: PoolKind,
        stream: StreamId,
        size: u64,
        total: u64,
    ) -> Result<BlockId, GrowError> {
        let g = self.granularity;
        // Whole pages must be able to hold the request (within a page of 2^64 they cannot).
        let pages = size
            .checked_next_multiple_of(g)
            .ok_or(GrowError::TooLarge)?;
        // More than the device has can never be mapped: fail before reserving address space
        // for it (a reservation of the request's size would otherwise stay until empty_cache).
        // The capacity seen at start-up is re-read before refusing (a simulated device's can
        // change).
        if total > 0 && pages > total && backend.mem_info().map_or(true, |m| pages > m.total) {
            return Err(GrowError::Backend(BackendError::oom(
                "map",
                format!(
                    "the request needs {} of pages, more than the device's capacity of {}",
                    crate::ByteSize(pages),
                    crate::ByteSize(total)
                ),
            )));
        }
        // Pages are mapped freely up to the memory limit (the device's capacity without one);
        // with `page_recycle_threshold`, only up to that share of it (or the high-water mark,
        // when higher): past it, free pages are moved instead.
        let soft = self.soft_cap(total);
        // Moving every free page would not make room: move none (each move waits for streams,
        // and the pages would be mapped back by the requests that follow).
        if self.reserved().saturating_add(pages) > soft {
            if let Some(why) = self.release_cannot_serve(backend, pool, stream, size) {
                return Err(why);
            }
        }
        // First under `soft`; after a map the device refused (memory outside this allocator, or
        // a capacity below the reported total), under what is held now and the pages already
        // moved: every page the request needs is moved.
        let unmapped = self.stats.unmapped_bytes_total;
        match self.place_and_map(backend, pool, stream, size, total, soft)? {
            Ok(id) => Ok(id),
            Err(e) if e.is_oom() && self.releasable_pages() > 0 => {
                // pages the first attempt moved are spares the backend still holds for the map
                let moved = self.stats.unmapped_bytes_total.wrapping_sub(unmapped);
                let now = self.reserved().saturating_add(moved);
                self.refused_at = self.refused_at.min(now);
                self.pressed = true;
                self.place_and_map(backend, pool, stream, size, total, now)?
                    .map_err(GrowError::from)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Places `size` bytes in a hole (moving free pages when reserved memory would pass
    /// `floor`) and maps the pages it needs. The outer error is the allocator's (the limit, an
    /// address range); the inner one is the backend's refusal of the map.
    fn place_and_map(
        &mut self,
        backend: &dyn Backend,
        pool: PoolKind,
        stream: StreamId,
        size: u64,
        total: u64,
        floor: u64,
    ) -> Result<Result<BlockId, BackendError>, GrowError> {
        let g = self.granularity;
        // (the caller checked that whole pages can hold the request)
        let pages = size.next_multiple_of(g);
        let mut choice = self.cheapest_hole(pool, stream, size, floor);
        let need = choice.map_or(pages, |p| p.cost);
        let over = self.reserved().saturating_add(need).saturating_sub(floor);
        if over > 0 {
            // The free mapped neighbours the placement uses stay mapped: unmapping one (the
            // largest free run is often the hole's neighbour) would make it need more new
            // pages than were released.
            let keep = choice.map_or([None, None], |p| p.uses);
            if self.release_pages(backend, over, keep, Release::Move(stream)) > 0 {
                self.pressed = true;
                choice = self.cheapest_hole(pool, stream, size, floor);
            }
        }
        let (hole, cost) = match choice {
            Some(p) => (p.hole, p.cost),
            None => {
                // A range as large as the device, at most 2^56 bytes (no card comes near): a
                // simulated device near 2^64 bytes still has room for its pools' and
                // streams' ranges in the 64-bit space.
                let va = pages.max(total.min(MAX_RANGE).next_multiple_of(g));
                let id = self.reserve_range(backend, pool, stream, va, total)?;
                (id, pages)
            }
        };
        self.check_limit(cost)?;
        let addr = self.blocks[hole].addr;
        // The segment's handles under pressure too: a move then unmaps and maps handles of one
        // size, reusing every one (pages mapped where handles were unmapped would release and
        // create them all; on the H200 that made VGG-16's step at its largest batch 1.27 x
        // expandable segments', against 0.83 x with handles throughout, docs/GPU.md runs 82-83).
        let handle = self.segs[self.blocks[hole].seg].handle;
        Ok(self
            .map_pages(backend, addr, cost, handle)
            .map(|()| self.mapped(hole, cost, size, stream)))
    }

    /// Maps `[addr, addr + bytes)`: whole handles of `handle` bytes (a segment's, 20 MiB on a
    /// card of 40 GiB or more) from `addr` and pages for the rest (`Backend::map_handles`),
    /// noting the handles, which are then unmapped only whole; pages only when `handle` is the
    /// page size. A driver call costs about the same for a page as for a handle, so handles make
    /// growth ten times cheaper (docs/BENCHMARKS.md); pages let the free space at the edge of
    /// memory move page by page.
    pub(super) fn map_pages(
        &mut self,
        backend: &dyn Backend,
        addr: u64,
        bytes: u64,
        handle: u64,
    ) -> Result<(), BackendError> {
        if handle <= self.granularity || bytes < handle {
            return backend.map(addr, bytes);
        }
        backend.map_handles(addr, bytes, handle)?;
        self.handles.insert(addr, bytes, handle);
        Ok(())
    }

    /// Bytes of whole pages inside block `b` that can be unmapped: whole pages of
    /// `granularity`, and no part of a handle that reaches out of the block.
    pub(super) fn whole_pages(&self, b: &Block) -> u64 {
        let g = self.granularity;
        let (lo, hi) = (b.addr.next_multiple_of(g), b.end() / g * g);
        if hi <= lo {
            return 0;
        }
        let (lo, hi) = self.handles.inward(lo, hi);
        hi - lo
    }

    /// Books `cost` bytes just mapped at the start of the unmapped block `hole` and returns the
    /// free block of at least `size` they make, split to `size`, not indexed.
    pub(super) fn mapped(
        &mut self,
        hole: BlockId,
        cost: u64,
        size: u64,
        stream: StreamId,
    ) -> BlockId {
        let addr = self.blocks[hole].addr;
        let small = self.blocks[hole].pool.is_small();
        let s = &mut self.stats;
        s.reserved_bytes.add(small, cost);
        s.num_device_alloc += 1;
        s.num_map += 1;
        s.mapped_bytes_total += cost;
        self.high_water = self.high_water.max(s.reserved_bytes.all.current);
        self.trace(TraceAction::SegmentMap, addr, cost, stream);
        let seg = self.blocks[hole].seg;
        self.segs[seg].mapped += cost;

        // The hole becomes [mapped part][rest, still unmapped].
        self.index_remove(hole);
        if cost < self.blocks[hole].size {
            let rest = self.split_at(hole, addr + cost);
            self.index_insert(rest);
        }
        self.blocks[hole].mapped = true;
        let id = self.coalesce(hole);
        debug_assert!(
            self.blocks[id].size >= size,
            "mapped enough for the request"
        );
        self.split_to(id, size);
        id
    }

    /// Where to map pages for a request of `size`: an unmapped free block (hole). A hole right
    /// after a free mapped block needs only the pages that block lacks; a hole between two of
    /// them may be mapped whole to join them. Below the high-water mark the fewest new pages
    /// win; past it, where reserved memory ends once the free pages the placement does not use
    /// are unmapped (the placement's own neighbours stay mapped, so a cheap-looking hole next to
    /// the largest free run may end higher than one that lets that run be moved). `floor`: the
    /// high-water mark, or the `page_recycle_threshold` share of the device when higher.
    fn cheapest_hole(
        &self,
        pool: PoolKind,
        stream: StreamId,
        size: u64,
        floor: u64,
    ) -> Option<Placement> {
        let g = self.granularity;
        let mut best: Option<((u64, u64, u64), Placement)> = None;
        let reserved = self.reserved();
        // Needed only past the mark (it scans every free block): computed at most once.
        let mut releasable = None;
        // Inclusive upper bound: `stream + 1` would overflow for stream u64::MAX.
        let stream_blocks = (stream, 0, 0)..=(stream, u64::MAX, BlockId::MAX);
        for &(_, addr, id) in self.unmapped[pool as usize].range(stream_blocks) {
            let u = &self.blocks[id];
            let free_mapped = |n: Option<BlockId>| {
                n.filter(|&n| self.blocks[n].is_free() && self.blocks[n].mapped)
                    .map_or((0, None), |n| (self.blocks[n].size, Some(n)))
            };
            let (before, prev) = free_mapped(u.prev);
            let (after, next) = free_mapped(u.next);
            // A free neighbour that alone fits was refused by the allocator's rules
            // (max_split_size): map nothing next to it.
            if before >= size {
                continue;
            }
            let head = (size - before).next_multiple_of(g);
            let option = if head <= u.size {
                Placement {
                    hole: id,
                    cost: head,
                    uses: [prev, None],
                }
            } else if before + u.size + after >= size {
                Placement {
                    hole: id,
                    cost: u.size,
                    uses: [prev, next],
                }
            } else {
                continue;
            };
            // Past the high-water mark, the pages of free blocks the placement does not use are
            // unmapped first: rank by where reserved memory ends, then by pages mapped.
            let ends = if reserved + option.cost <= floor {
                floor
            } else {
                let kept: u64 = option
                    .uses
                    .iter()
                    .flatten()
                    .map(|&n| self.whole_pages(&self.blocks[n]))
                    .sum();
                let releasable = *releasable.get_or_insert_with(|| self.releasable_pages());
                (reserved + option.cost)
                    .saturating_sub(releasable.saturating_sub(kept))
                    .max(floor)
            };
            let key = (ends, option.cost, addr);
            if best.as_ref().is_none_or(|&(k, _)| key < k) {
                best = Some((key, option));
            }
        }
        best.map(|(_, p)| p)
    }

    /// The fewest new pages' bytes a request of `size` on (`pool`, `stream`) needs: where a
    /// hole next to free mapped blocks lets it use them, fewer than its own pages.
    pub(super) fn least_new_pages(&self, pool: PoolKind, stream: StreamId, size: u64) -> u64 {
        self.cheapest_hole(pool, stream, size, u64::MAX)
            .map_or(size.next_multiple_of(self.granularity), |p| p.cost)
    }

    /// Bytes of whole pages in free blocks of growable segments: what
    /// [`State::release_pages`] could unmap.
    pub(super) fn releasable_pages(&self) -> u64 {
        if !self.free.iter().any(FreeIndex::any_whole_page) {
            return 0; // (without a scan: a run of failures asks once per attempt)
        }
        let versions = self.free_versions();
        if let Some((at, bytes)) = self.releasable_memo.get() {
            if at == versions {
                return bytes;
            }
        }
        let bytes = self.free_runs().map(|(n, _)| n).sum();
        self.releasable_memo.set(Some((versions, bytes)));
        bytes
    }

    /// The free blocks of growable segments that hold whole pages, with those pages' bytes.
    pub(super) fn free_runs(&self) -> impl Iterator<Item = (u64, BlockId)> + '_ {
        self.free
            .iter()
            .flat_map(|f| f.ids())
            .filter(|&id| self.segs[self.blocks[id].seg].growable)
            .map(move |id| (self.whole_pages(&self.blocks[id]), id))
            .filter(|&(n, _)| n > 0)
    }

    /// Reserves a new address range of `va` bytes: one unmapped free block, indexed.
    pub(super) fn reserve_range(
        &mut self,
        backend: &dyn Backend,
        pool: PoolKind,
        stream: StreamId,
        va: u64,
        total: u64,
    ) -> Result<BlockId, GrowError> {
        let base = backend.reserve(va)?;
        self.check_new_range("reserve", base, va)?;
        // With a `page_recycle_threshold`, pages: that mode trades moves for memory that
        // follows live bytes, which whole handles would hold back.
        let handle = match self.cfg.page_recycle_threshold {
            None => handle_size(self.granularity, self.cap(total)),
            Some(_) => self.granularity,
        };
        let seg = self.add_segment(Segment {
            base,
            size: va,
            stream,
            pool,
            growable: true,
            mapped: 0,
            handle,
            first: 0,
        });
        let id = self.blocks.insert(Block {
            addr: base,
            size: va,
            requested: 0,
            seg,
            prev: None,
            next: None,
            state: BlockState::Free,
            mapped: false,
            stream,
            pool,
            other_streams: Vec::new(),
            generation: 0,
            lent_to: (0, 0),
        });
        self.segs[seg].first = id;
        self.stats.segment.add(pool.is_small(), 1);
        self.index_insert(id);
        Ok(id)
    }

    /// Unmaps pages of growable segments that hold no live byte, the largest free runs first,
    /// until at least `budget` bytes are unmapped (`u64::MAX`: all), leaving the blocks in `keep`
    /// alone; returns the bytes unmapped. The work that may still use the pages is waited for
    /// first (see [`Release`]).
    pub fn release_pages(
        &mut self,
        backend: &dyn Backend,
        budget: u64,
        keep: [Option<BlockId>; 2],
        how: Release,
    ) -> u64 {
        if !self.free.iter().any(FreeIndex::any_whole_page) {
            return 0;
        }
        let g = self.granularity;
        let mut candidates: Vec<(u64, BlockId)> = self
            .free_runs()
            .filter(|&(_, id)| !keep.contains(&Some(id)))
            .collect();
        if budget != u64::MAX {
            candidates.sort_unstable_by(|a, b| b.cmp(a));
            let mut sum = 0;
            let cut = candidates
                .iter()
                .position(|&(n, _)| {
                    sum += n;
                    sum >= budget
                })
                .map_or(candidates.len(), |i| i + 1);
            candidates.truncate(cut);
        }
        if !candidates.is_empty() {
            // Queued work may still touch these pages: wait before unmapping. A free block's
            // pages are used only by its segment's stream (a block used on other streams is
            // free only once their events completed), so a move waits for those streams alone.
            let device_wide = match how {
                Release::Move(calling) => {
                    let mut streams: Vec<StreamId> = candidates
                        .iter()
                        .map(|&(_, id)| self.segs[self.blocks[id].seg].stream)
                        .collect();
                    streams.sort_unstable();
                    streams.dedup();
                    backend.synchronize_streams(&streams, calling)
                }
                Release::All { .. } => backend.synchronize().map(|()| true),
            };
            match device_wide {
                Err(e) => {
                    tracing::warn!(error = %e, "synchronize before unmapping failed; keeping pages");
                    return 0;
                }
                Ok(false) => self.stats.num_stream_syncs += 1,
                Ok(true) if how != (Release::All { sync_counted: true }) => {
                    self.stats.num_sync_all_streams += 1;
                }
                Ok(true) => {}
            }
        }
        let keep_handles = matches!(how, Release::Move(_));
        let mut released = 0;
        for (_, id) in candidates {
            let (lo, hi) = {
                let b = &self.blocks[id];
                self.handles
                    .inward(b.addr.next_multiple_of(g), b.end() / g * g)
            };
            let r = if keep_handles {
                backend.unmap_keep(lo, hi - lo)
            } else {
                backend.unmap(lo, hi - lo)
            };
            if let Err(e) = r {
                tracing::warn!(error = %e, "unmapping free pages failed; keeping them");
                continue;
            }
            self.handles.remove(lo, hi);
            self.index_remove(id);
            // [head, still mapped][lo..hi unmapped][tail, still mapped]
            let mut mid = id;
            if self.blocks[id].addr < lo {
                mid = self.split_at(id, lo);
                self.index_insert(id);
            }
            if hi < self.blocks[mid].end() {
                let tail = self.split_at(mid, hi);
                self.index_insert(tail);
            }
            let (small, seg, stream) = {
                let b = &mut self.blocks[mid];
                b.mapped = false;
                (b.pool.is_small(), b.seg, b.stream)
            };
            self.trace(TraceAction::SegmentUnmap, lo, hi - lo, stream);
            let mid = self.coalesce(mid);
            self.index_insert(mid);
            self.segs[seg].mapped -= hi - lo;
            let s = &mut self.stats;
            s.reserved_bytes.sub(small, hi - lo);
            s.num_device_free += 1;
            s.num_unmap += 1;
            s.unmapped_bytes_total += hi - lo;
            released += hi - lo;
        }
        released
    }

    /// Releases growable address ranges that hold no block and no mapped page.
    pub fn release_empty_ranges(&mut self, backend: &dyn Backend) {
        self.segments_scanned = self.segments_scanned.wrapping_add(self.segs.len() as u64);
        let empty: Vec<(u32, BlockId)> = self
            .segs
            .iter()
            .filter(|(_, s)| s.growable && s.mapped == 0)
            .filter(|(_, s)| {
                let b = &self.blocks[s.first];
                b.is_free() && b.next.is_none()
            })
            .map(|(i, s)| (i, s.first))
            .collect();
        self.release_ranges(backend, empty);
    }

    /// [`State::release_empty_ranges`] for the ranges of one pool and stream only (those a
    /// failed request may have reserved), without a look at every segment.
    pub fn release_empty_ranges_of(
        &mut self,
        backend: &dyn Backend,
        pool: PoolKind,
        stream: StreamId,
    ) {
        let stream_blocks = (stream, 0, 0)..=(stream, u64::MAX, BlockId::MAX);
        let empty: Vec<(u32, BlockId)> = self.unmapped[pool as usize]
            .range(stream_blocks)
            .map(|&(_, _, id)| (self.blocks[id].seg, id))
            .filter(|&(seg, id)| {
                let b = &self.blocks[id];
                b.prev.is_none() && b.next.is_none() && self.segs[seg].mapped == 0
            })
            .collect();
        self.release_ranges(backend, empty);
    }

    /// Releases the empty ranges `empty` (segment, its one block).
    fn release_ranges(&mut self, backend: &dyn Backend, empty: Vec<(u32, BlockId)>) {
        for (seg, first) in empty {
            let (base, size, small) = {
                let s = &self.segs[seg];
                (s.base, s.size, s.pool.is_small())
            };
            if let Err(e) = backend.release(base, size) {
                tracing::warn!(error = %e, "releasing an address range failed; keeping it");
                continue;
            }
            self.index_remove(first);
            self.blocks.remove(first);
            self.remove_segment(seg);
            self.stats.segment.sub(small, 1);
        }
    }
}

/// Why [`State::release_pages`] unmaps, which decides what it waits for and what it keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Release {
    /// Pages moved to where a request on this stream needs them: the streams of the pages'
    /// segments are waited for (the device, when the backend cannot name one from this
    /// thread), and the physical handles are kept for the map that follows.
    Move(StreamId),
    /// Memory given back to the device (`empty_cache`, out-of-memory): the device is
    /// synchronised and the handles released. `sync_counted`: the caller counted that
    /// synchronisation already (one `empty_cache` counts one, as in PyTorch).
    All {
        /// The caller counted the synchronisation.
        sync_counted: bool,
    },
}
