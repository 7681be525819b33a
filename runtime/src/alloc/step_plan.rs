//! Step plans: a repeating training step served from one fixed layout, so that a loop at the
//! edge of memory stops moving pages.
//!
//! Best fit over growable segments settles a loop when one step's requests fit in the pages the
//! step before left mapped. At the largest batch they may not: the free space a step leaves is
//! cut where that step's blocks fell, the next step's placements differ, and pages move on
//! every step (a VGG-16 step at 77.2 GiB live on an 80 GiB card moved 10-24 GiB a step, with
//! synchronisations, whether one thread or libtorch's autograd thread freed the blocks).
//!
//! With step marks ([`crate::CachingAllocator::mark_step`], called by the retry engine at each
//! step it runs, so by every `train_step`, or by a hand-written loop once per step), the
//! allocator records each step's large requests:
//! their order, sizes and lifetimes. When a step moved pages (or retried inside the
//! allocator) and repeated the step before it (the same large requests in the same order), it
//! lays out that step's blocks once ([`super::static_layout`]: a fixed offset for
//! every block, no two live ones overlapping), maps one address range of the layout's height (a
//! single move, at the step boundary) and serves the j-th request of each size in every later
//! step at the offset of the j-th one in the laid-out step. A step that repeats then maps,
//! unmaps and waits for nothing.
//!
//! With room to spare nothing moves, but best fit's layout can hold more than the step needs
//! (VGG-16's step at 1,118 rows on a 160 GiB card: 1.0826 × its peak live bytes; laid out,
//! 1.0016 ×). A step that repeated the one before is then laid out once per run of repeating
//! steps, and the plan is installed when it leaves at most [`ROOM_PLAN_SHARE`] of the bytes
//! reserved, its free pages given back before the range is mapped.
//!
//! The plan's range is outside best fit: its free blocks are not indexed, so no other request
//! takes a planned offset. A request that does not match the plan (a size it does not expect,
//! its offset still held) is a miss: served outside the range as before, or, when only moved
//! pages could serve it there, by best fit among the range's free blocks. After two steps in a
//! row with misses the plan is dropped, as it is on `empty_cache` and before an out-of-memory
//! release. Nothing a program computes changes: only where its blocks sit.
//!
//! The limit: the range holds the laid-out step's layout. A step that differs from it at the
//! very edge of memory (a request resized, one added) can run out of memory where best fit
//! alone, with its own layout, would not: on the simulator, 3–5 of 40 random loops with
//! changed steps, each on the tightest card where every step ran without marks; every loop of
//! repeating steps ran (`tests/step_plan.rs`, docs/BENCHMARKS.md). Under the retry engine such an out-of-memory is
//! retried like any other (the release drops the plan).
//!
//! A layout taller than the memory the step can have (a card between the step's peak live
//! bytes and the layout's height: VGG-16's step at 1,118 rows on 77.3 GiB, at 1,951 rows on the
//! H200) is planned at page granularity instead, where the backend can map a page at a second
//! address ([`super::shared_plan`]: each request its own range, over the step's peak live pages).
//! When that does not fit either, or the backend cannot alias pages, there is no plan: it is
//! tried once per run of repeating steps (a try gives the free pages back first), and the loop
//! runs by best fit, moving pages in each step.

use rustc_hash::FxHashMap;

use super::block::{BlockId, PoolKind};
use super::growable::Release;
use super::state::State;
use super::static_layout::{plan_static_layout_within, LifeSpan, StaticLayout};
use super::steps::{Plan, Request, NO_SEG};
use crate::backend::{Backend, StreamId};

/// Block orders tried for a step's layout: VGG-16's step at 1,118 rows lays out in 1.0016 × its
/// peak live bytes over 64 orders as over 300 (`oomguard layout --tries`); each try is
/// quadratic in the step's large blocks (127 here).
const LAYOUT_TRIES: u32 = 64;

/// The work after which no new block order is tried for a step's layout
/// (`plan_static_layout_within`: a block tested against one placed before it), so that the
/// mark that plans a step stays short whatever the step's shape: about 0.5 s of a release
/// build. The recorded traces' steps get their 64 orders within it (their replays are
/// unchanged); 11,000 large blocks with random lifetimes took 20 s without it.
const LAYOUT_WORK: u64 = 250_000_000;

/// Most blocks a step's layout plans: each order costs up to the square of them (the first one
/// runs whatever the work bound). A larger step is served by best fit, as without a plan.
const MAX_PLANNED: usize = 20_000;

/// A step's layout over [`LAYOUT_TRIES`] orders within [`LAYOUT_WORK`]; `None` for a step of
/// more than [`MAX_PLANNED`] blocks.
fn step_layout(spans: &[LifeSpan]) -> Option<StaticLayout> {
    (spans.len() <= MAX_PLANNED)
        .then(|| plan_static_layout_within(spans, LAYOUT_TRIES, 0x5eed, LAYOUT_WORK))
}

/// A step with room to spare gets a plan only when the plan leaves at most this share of the
/// bytes reserved (saves at least 2 %): VGG-16's step at 1,118 rows, laid out by best fit on a
/// card with room, reserves 1.0826 × its peak live bytes, laid out once 1.0016 ×.
const ROOM_PLAN_SHARE: f64 = 0.98;

/// Planned steps in a row with a miss after which the plan is dropped.
const MISSED_STEPS_TO_DROP: u32 = 2;

impl State {
    /// Serves a large request from the installed plan: at its offset when it is the request the
    /// plan expects next and that offset is free (a hit). A request the plan does not serve
    /// (another size, its offset still held) goes outside the range while a free block or new
    /// pages can take it there; under pressure (only moved pages could), it takes the best fit
    /// among the range's free blocks instead: no page moves, no release, and the plan stays for
    /// the requests that still match (`total`: the device's capacity). The block is split to
    /// `size` and not indexed.
    pub fn plan_take(
        &mut self,
        pool: PoolKind,
        stream: StreamId,
        size: u64,
        total: u64,
    ) -> Option<BlockId> {
        if pool.is_small() {
            return None;
        }
        let plan = self.steps.plan.as_ref()?;
        let (seg, shared) = (plan.seg, plan.shared.is_some());
        let plan_stream = self.segs[seg].stream;
        let slot = self.planned_slot(size, stream);
        if let Some(Some(off)) = slot {
            // (a shared plan's slot also needs its pages free: see `shared_plan`)
            if self.shared_slot_free(seg, off) {
                if let Some(id) = self.take_at(off, size) {
                    self.shared_slot_taken(seg, off, id);
                    self.steps.hit = true;
                    self.stats.num_plan_hits += 1;
                    return Some(id);
                }
            }
        }
        if slot == Some(None) || stream != plan_stream || shared {
            // served as before, as in the laid-out step; a shared plan's free ranges may
            // share pages with live blocks, so nothing but a slot is served there
            return None;
        }
        if self.under_pressure(size, total)
            && self.free[pool as usize].best_fit(stream, size).is_none()
        {
            return self.best_fit_in_plan(size);
        }
        None
    }

    /// The blocks of the plan's range, in address order (none without a plan).
    fn plan_blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        let first = self.steps.plan.as_ref().map(|p| self.segs[p.seg].first);
        std::iter::successors(first, |&id| self.blocks[id].next)
    }

    /// The smallest free block of the plan's range that holds `size`, split to it.
    fn best_fit_in_plan(&mut self, size: u64) -> Option<BlockId> {
        let (found, id) = self
            .plan_blocks()
            .map(|id| (self.blocks[id].size, id))
            .filter(|&(s, id)| self.blocks[id].is_free() && s >= size)
            .min_by_key(|&(s, _)| s)?;
        if found > size {
            let end = self.blocks[id].addr + size;
            self.split_at(id, end);
        }
        Some(id)
    }

    /// The free block at `off` of the plan's range split to `size` (`None`: that range is
    /// still held, by a block freed later than in the laid-out step).
    fn take_at(&mut self, off: u64, size: u64) -> Option<BlockId> {
        let base = self.steps.plan.as_ref()?.base;
        let (start, end) = (base + off, base + off + size);
        let mut id = self
            .plan_blocks()
            .find(|&id| self.blocks[id].end() > start)
            .filter(|&id| {
                let b = &self.blocks[id];
                b.is_free() && b.addr <= start && b.end() >= end
            })?;
        if self.blocks[id].addr < start {
            id = self.split_at(id, start);
        }
        if self.blocks[id].end() > end {
            self.split_at(id, end);
        }
        Some(id)
    }

    /// What the plan holds for the next request of `size` on `stream`: `None` when the
    /// recorded step had no such request (a step that differs), `Some(None)` when it had one
    /// that is served as before (live past the step's end, or on another stream).
    fn planned_slot(&self, size: u64, stream: StreamId) -> Option<Option<u64>> {
        let plan = self.steps.plan.as_ref()?;
        let j = self.steps.seen.get(&(size, stream)).copied().unwrap_or(0);
        plan.slots.get(&(size, stream))?.get(j as usize).copied()
    }

    /// Records an allocation of the current step (block `id`, `size` bytes rounded), when it is
    /// a large one.
    pub fn step_allocated(&mut self, id: BlockId, pool: PoolKind, size: u64, stream: StreamId) {
        if pool.is_small() {
            return;
        }
        // a miss: a request the plan has an offset for, or does not know, not served at its
        // offset (a request it leaves to best fit, as in the laid-out step, is none)
        let hit = std::mem::take(&mut self.steps.hit);
        let missed =
            self.steps.plan.is_some() && !hit && self.planned_slot(size, stream) != Some(None);
        if missed {
            self.steps.misses += 1;
            self.stats.num_plan_misses += 1;
        }
        let s = &mut self.steps;
        *s.seen.entry((size, stream)).or_default() += 1;
        s.open.insert(id, s.requests.len() as u32);
        s.requests.push(Request {
            size,
            stream,
            start: s.clock,
            end: usize::MAX,
        });
        s.clock += 1;
    }

    /// Records the free of block `id`, when it is a recorded one.
    pub fn step_freed(&mut self, id: BlockId) {
        let s = &mut self.steps;
        if let Some(k) = s.open.remove(&id) {
            s.requests[k as usize].end = s.clock;
            s.clock += 1;
        }
    }

    /// Ends a step and starts the next: drops a plan that keeps missing; lays out and installs
    /// one when none is installed and the step repeated the one before it, and either moved
    /// pages or retried, or had room to spare and its plan would reserve 2 % less (checked once
    /// per run of repeating steps, and not after a plan was dropped for its misses).
    pub fn mark_step(&mut self, backend: &dyn Backend, total: u64) {
        self.stats.num_step_marks += 1;
        // (parking stops while steps are marked: the plan sees every large request)
        self.unpark_large();
        self.release_drained_plan(backend);
        if self.steps.on && self.steps.draining.is_none() {
            if self.steps.plan.is_some() {
                if self.steps.misses > 0 {
                    self.steps.missed_steps += 1;
                    if self.steps.missed_steps >= MISSED_STEPS_TO_DROP {
                        self.drop_plan();
                        self.steps.room_refused = true;
                    }
                } else {
                    self.steps.missed_steps = 0;
                }
            } else {
                let moved = self.steps.moved_before_empty || self.moved_since_mark();
                // Only a step that repeats the one before it is laid out: a first step (the
                // optimizer's state made, cuDNN's algorithms probed) or one with a failed
                // attempt and its retry would give a plan the next steps miss.
                let repeats = self.steps.previous.len() == self.steps.requests.len()
                    && self
                        .steps
                        .previous
                        .iter()
                        .zip(&self.steps.requests)
                        .all(|(&(size, stream), r)| size == r.size && stream == r.stream);
                self.steps.repeated = if repeats { self.steps.repeated + 1 } else { 0 };
                if !repeats {
                    self.steps.room_checked = false;
                    self.steps.plan_unfit = false;
                } else if moved && !self.steps.plan_unfit {
                    self.install_plan(backend, total, false);
                } else if !self.steps.room_checked && !self.steps.room_refused {
                    self.steps.room_checked = true;
                    self.install_plan(backend, total, true);
                }
            }
        }
        let on = self.plans_possible();
        let s = &mut self.steps;
        s.on = on;
        s.previous.clear();
        s.previous
            .extend(s.requests.iter().map(|r| (r.size, r.stream)));
        s.requests.clear();
        s.open.clear();
        s.seen.clear();
        s.clock = 0;
        s.misses = 0;
        s.moved_before_empty = false;
        s.moved_at = (
            self.stats.unmapped_bytes_total,
            self.stats.num_alloc_retries,
        );
    }

    /// Whether marked steps can get a plan (growable segments, `step_plans` on): otherwise marks
    /// are only counted and nothing is recorded.
    pub fn plans_possible(&self) -> bool {
        self.growable && self.cfg.step_plans
    }

    fn moved_since_mark(&self) -> bool {
        (
            self.stats.unmapped_bytes_total,
            self.stats.num_alloc_retries,
        ) != self.steps.moved_at
    }

    /// `empty_cache` gives pages back: drops the plan; what it unmaps is not a move of the
    /// step's (a finder empties the cache between trials). Call before the release.
    pub fn step_before_empty_cache(&mut self) {
        self.drop_plan();
        self.steps.plan_unfit = false;
        self.steps.moved_before_empty |= self.moved_since_mark();
    }

    /// Call after `empty_cache`'s release.
    pub fn step_after_empty_cache(&mut self) {
        self.steps.moved_at = (
            self.stats.unmapped_bytes_total,
            self.stats.num_alloc_retries,
        );
    }

    /// Lays out the recorded step's large blocks (those freed within it, on its busiest stream)
    /// and maps one range of the layout's height for them. `for_room`: nothing moved (the step
    /// had room to spare), so the plan is only worth its one move when it shrinks the memory
    /// reserved: installed only when giving back every free page and mapping the range leaves
    /// at most [`ROOM_PLAN_SHARE`] of the bytes reserved now (the free pages are given back
    /// before the range is mapped, so reserved memory never rises for it).
    fn install_plan(&mut self, backend: &dyn Backend, total: u64, for_room: bool) {
        let mut per_stream: FxHashMap<StreamId, u64> = FxHashMap::default();
        for r in &self.steps.requests {
            *per_stream.entry(r.stream).or_default() += r.size;
        }
        let Some(stream) = per_stream
            .into_iter()
            .max_by_key(|&(s, bytes)| (bytes, std::cmp::Reverse(s)))
            .map(|(s, _)| s)
        else {
            return;
        };
        let planned: Vec<usize> = (0..self.steps.requests.len())
            .filter(|&k| {
                let r = &self.steps.requests[k];
                r.stream == stream && r.end != usize::MAX
            })
            .collect();
        if planned.len() < 2 {
            return;
        }
        let spans: Vec<LifeSpan> = planned
            .iter()
            .map(|&k| {
                let r = &self.steps.requests[k];
                LifeSpan {
                    start: r.start,
                    end: r.end,
                    bytes: r.size,
                }
            })
            .collect();
        let Some(layout) = step_layout(&spans) else {
            return;
        };
        let height = layout.height.next_multiple_of(self.granularity);
        // what stays mapped once every free page is given back, with the range beside it
        let reserved = self.reserved();
        let after = (reserved - self.releasable_pages().min(reserved)).saturating_add(height);
        if for_room && after as f64 > ROOM_PLAN_SHARE * reserved as f64 {
            return;
        }
        // a range that cannot fit is not tried: the try would give every free page back first,
        // then create memory until the device refused (`known_cap`: after a refusal, what the
        // device held, not the card's reported total)
        let mapped = if after > self.known_cap(total) {
            None
        } else {
            self.map_plan_range(backend, stream, height, total, for_room)
        };
        let installed = match mapped {
            Some(base) => Some((base, layout.offsets, None)),
            // too tall for the card: the same step at page granularity (`shared_plan`), which
            // needs only its peak live pages
            // (only once the step has repeated twice: mapping the pool and its aliases costs
            // seconds at the edge, and a loop whose retry engine changes its split at the next
            // step, as after an out-of-memory, would drop it at once; the next mark tries again)
            None if !for_room && backend.supports_alias() && self.steps.repeated < 2 => return,
            None if !for_room && backend.supports_alias() => self
                .map_shared_plan(backend, stream, &spans, total)
                .map(|(base, offsets, pages)| (base, offsets, Some(pages))),
            None => None,
        };
        let Some((base, planned_offsets, shared)) = installed else {
            self.stats.num_plans_refused += 1;
            self.steps.plan_unfit = true;
            return;
        };
        let mut offsets = vec![None; self.steps.requests.len()];
        for (&k, &off) in planned.iter().zip(&planned_offsets) {
            offsets[k] = Some(off);
        }
        let mut slots: FxHashMap<(u64, StreamId), Vec<Option<u64>>> = FxHashMap::default();
        for (r, off) in self.steps.requests.iter().zip(offsets) {
            slots.entry((r.size, r.stream)).or_default().push(off);
        }
        let seg = self.planned_seg;
        self.steps.plan = Some(Plan {
            seg,
            base,
            slots,
            shared,
        });
        self.steps.missed_steps = 0;
        self.stats.num_plans_installed += 1;
    }

    /// Maps a new address range of `height` bytes on `stream`, whole, from free pages moved out
    /// of the growable segments (as many as the memory limit requires; all of them if the device
    /// refuses); its one free block is left unindexed. `None`: it could not be mapped.
    fn map_plan_range(
        &mut self,
        backend: &dyn Backend,
        stream: StreamId,
        height: u64,
        total: u64,
        release_free: bool,
    ) -> Option<u64> {
        let over = if release_free {
            u64::MAX
        } else {
            self.reserved()
                .saturating_add(height)
                .saturating_sub(self.soft_cap(total))
        };
        if over > 0 {
            self.release_pages(backend, over, [None, None], Release::Move(stream));
        }
        // The range maps its segment's handles, at the edge too: the free memory a move gives
        // back is handles, kept as spares, which the range then maps again without creating
        // any. Pages there released every spare and created the range page by page: GPT-2
        // small's 2 x 80 step on the H200 took 7.8 s with its install against 3.6 s settled
        // (docs/GPU.md run 97). Pages only once the device refused the handles.
        let mut mapped = self.map_whole(backend, stream, height, true, total);
        if !mapped && self.releasable_pages() > 0 {
            // the device refused: move every free page, then try once more
            self.release_pages(backend, u64::MAX, [None, None], Release::Move(stream));
            mapped = self.map_whole(backend, stream, height, false, total);
        }
        if let Err(e) = backend.release_spares() {
            tracing::warn!(error = %e, "releasing spare pages failed");
        }
        self.release_empty_ranges_of(backend, PoolKind::Large, stream);
        mapped.then(|| self.segs[self.planned_seg].base)
    }

    /// Reserves a range of `height` bytes on `stream` and maps the whole of it, under the
    /// memory limit; on success it becomes the plan's range (`planned_seg`), its one free block
    /// unindexed. (A range reserved but not mapped is left for the caller's
    /// `release_empty_ranges_of`.)
    fn map_whole(
        &mut self,
        backend: &dyn Backend,
        stream: StreamId,
        height: u64,
        handles: bool,
        total: u64,
    ) -> bool {
        if self.check_limit(height).is_err() {
            return false;
        }
        let Ok(hole) = self.reserve_range(backend, PoolKind::Large, stream, height, total) else {
            return false;
        };
        let addr = self.blocks[hole].addr;
        let handle = if handles {
            self.segs[self.blocks[hole].seg].handle
        } else {
            self.granularity
        };
        if self.map_pages(backend, addr, height, handle).is_err() {
            return false;
        }
        let id = self.mapped(hole, height, height, stream);
        self.planned_seg = self.blocks[id].seg;
        true
    }

    /// Bytes of whole pages in the plan's free blocks: what dropping it would let a release
    /// return (0 without a plan).
    pub fn plan_free_pages(&self) -> u64 {
        if let Some(sh) = self.shared_pages() {
            return sh.releasable();
        }
        self.plan_blocks()
            .map(|id| &self.blocks[id])
            .filter(|b| b.is_free())
            .map(|b| self.whole_pages(b))
            .sum()
    }

    /// Drops the installed plan: its range becomes an ordinary growable segment (its free
    /// blocks indexed, its free pages releasable).
    pub fn drop_plan(&mut self) {
        let free: Vec<BlockId> = self
            .plan_blocks()
            .filter(|&id| self.blocks[id].is_free())
            .collect();
        let Some(plan) = self.steps.plan.take() else {
            return;
        };
        if let Some(shared) = plan.shared {
            // its free ranges stay out of every index until its memory is given back
            self.steps.draining = Some(shared);
            self.steps.missed_steps = 0;
            self.stats.num_plans_dropped += 1;
            return;
        }
        self.planned_seg = NO_SEG;
        for id in free {
            self.index_insert(id);
        }
        self.steps.missed_steps = 0;
        self.stats.num_plans_dropped += 1;
    }
}

#[cfg(test)]
mod layout_bound_tests {
    use super::*;

    /// 4,000 blocks all live at once (each order tests every pair): the orders stop at the
    /// work bound instead of running all 64 (before: 64 orders, 20 s for 11,000 such blocks in
    /// a release build); a step larger than the cap gets no layout.
    #[test]
    fn a_large_steps_layout_stops_at_the_work_bound() {
        let spans: Vec<LifeSpan> = (0..4_000)
            .map(|i| LifeSpan {
                start: i,
                end: 10_000 + i % 7,
                bytes: (2 << 20) + (i as u64 % 13) * 4096,
            })
            .collect();
        let layout = step_layout(&spans).unwrap();
        assert!(
            (1..LAYOUT_TRIES).contains(&layout.tries),
            "{}",
            layout.tries
        );
        let too_many = vec![spans[0]; MAX_PLANNED + 1];
        assert!(step_layout(&too_many).is_none());
    }
}
