//! Step plans: a repeating training step served from one fixed layout, so that a loop at the
//! edge of memory stops moving pages.
//!
//! Best fit over growable segments settles a loop when one step's requests fit in the pages the
//! step before left mapped. At the largest batch they may not: the free space a step leaves is
//! cut where that step's blocks fell, the next step's placements differ, and pages move on
//! every step (a VGG-16 step at 77.2 GiB live on an 80 GiB card moved 10-24 GiB a step, with
//! synchronisations, whether one thread or libtorch's autograd thread freed the blocks).
//!
//! With step marks ([`crate::CachingAllocator::mark_step`], called by the glue's `train_step`
//! or by a hand-written loop once per step), the allocator records each step's large requests:
//! their order, sizes and lifetimes. When a step moved pages (or retried inside the
//! allocator), it lays out that step's blocks once ([`super::static_layout`]: a fixed offset for
//! every block, no two live ones overlapping), maps one address range of the layout's height (a
//! single move, at the step boundary) and serves the k-th large request of every later step at
//! its offset. A step that repeats then maps, unmaps and waits for nothing.
//!
//! The plan's range is outside best fit: its free blocks are not indexed, so no other request
//! takes a planned offset. A request that does not match the plan (another size, another
//! stream, its offset still held) is served as before, outside the range, and counted as a
//! miss; after two steps in a row with misses the plan is dropped, as it is on `empty_cache`
//! and before an out-of-memory release (its free pages then become ordinary free pages).
//! Nothing a program computes changes: only where its blocks sit.

use rustc_hash::FxHashMap;

use super::block::{BlockId, PoolKind, SegId};
use super::growable::Release;
use super::state::State;
use super::static_layout::{plan_static_layout, LifeSpan};
use crate::backend::{Backend, StreamId};

/// Block orders tried for a step's layout: VGG-16's 127 large blocks at 1,118 rows laid out in
/// 1.0016 × peak live over 300 orders, 1.0021 × over 64 (`oomguard layout`); each try is
/// quadratic in the step's large blocks, well under a millisecond for such a step.
const LAYOUT_TRIES: u32 = 64;

/// Planned steps in a row with a miss after which the plan is dropped.
const MISSED_STEPS_TO_DROP: u32 = 2;

/// No segment: no plan is installed.
pub(crate) const NO_SEG: SegId = SegId::MAX;

/// One large request of the recorded step.
#[derive(Clone, Copy, Debug)]
struct Request {
    size: u64,
    stream: StreamId,
    /// The step's clock (large allocations and frees so far) at the allocation.
    start: usize,
    /// At the free (`usize::MAX`: still live at the step's end).
    end: usize,
}

/// The installed plan: one mapped address range and an offset for each planned request.
#[derive(Debug)]
struct Plan {
    seg: SegId,
    base: u64,
    stream: StreamId,
    /// By request index: the planned (size, offset), `None` for a request served as before.
    slots: Vec<Option<(u64, u64)>>,
}

/// Step marks, the recording of the current step and the installed plan.
#[derive(Debug, Default)]
pub(crate) struct Steps {
    /// `mark_step` was called: large requests are recorded.
    pub on: bool,
    requests: Vec<Request>,
    /// Live recorded blocks: their request index.
    open: FxHashMap<BlockId, u32>,
    clock: usize,
    /// `unmapped_bytes_total` and `num_alloc_retries` at the step's start.
    moved_at: (u64, u64),
    plan: Option<Plan>,
    misses: u64,
    missed_steps: u32,
}

impl State {
    /// Serves a large request from the installed plan, when it is the request the plan expects
    /// next and its offset is free: the block, split to `size`, not indexed.
    pub fn plan_take(&mut self, pool: PoolKind, stream: StreamId, size: u64) -> Option<BlockId> {
        if pool.is_small() {
            return None;
        }
        let k = self.steps.requests.len();
        let plan = self.steps.plan.as_ref()?;
        let slot = plan.slots.get(k).copied().flatten();
        let Some((want, off)) = slot.filter(|&(want, _)| want == size && stream == plan.stream)
        else {
            if slot.is_some() || k < plan.slots.len() {
                self.note_miss();
            }
            return None;
        };
        let (start, end) = (plan.base + off, plan.base + off + want);
        let mut at = Some(self.segs[plan.seg].first);
        while let Some(id) = at {
            if self.blocks[id].end() > start {
                break;
            }
            at = self.blocks[id].next;
        }
        let Some(mut id) = at.filter(|&id| {
            let b = &self.blocks[id];
            b.is_free() && b.addr <= start && b.end() >= end
        }) else {
            // its offset is still held (a block freed later than in the recorded step)
            self.note_miss();
            return None;
        };
        if self.blocks[id].addr < start {
            id = self.split_at(id, start);
        }
        if self.blocks[id].end() > end {
            self.split_at(id, end);
        }
        self.stats.num_plan_hits += 1;
        Some(id)
    }

    fn note_miss(&mut self) {
        self.steps.misses += 1;
        self.stats.num_plan_misses += 1;
    }

    /// Records an allocation of the current step (block `id`, `size` bytes rounded), when it is
    /// a large one.
    pub fn step_allocated(&mut self, id: BlockId, pool: PoolKind, size: u64, stream: StreamId) {
        if pool.is_small() {
            return;
        }
        let s = &mut self.steps;
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
    /// one when the step moved pages or retried and none is installed.
    pub fn mark_step(&mut self, backend: &dyn Backend, total: u64) {
        self.stats.num_step_marks += 1;
        if self.steps.on {
            if self.steps.plan.is_some() {
                if self.steps.misses > 0 {
                    self.steps.missed_steps += 1;
                    if self.steps.missed_steps >= MISSED_STEPS_TO_DROP {
                        self.drop_plan();
                    }
                } else {
                    self.steps.missed_steps = 0;
                }
            } else {
                let moved = (
                    self.stats.unmapped_bytes_total,
                    self.stats.num_alloc_retries,
                ) != self.steps.moved_at;
                if moved && self.growable {
                    self.install_plan(backend, total);
                }
            }
        }
        let s = &mut self.steps;
        s.on = true;
        s.requests.clear();
        s.open.clear();
        s.clock = 0;
        s.misses = 0;
        s.moved_at = (
            self.stats.unmapped_bytes_total,
            self.stats.num_alloc_retries,
        );
    }

    /// Lays out the recorded step's large blocks (those freed within it, on its busiest stream)
    /// and maps one range of the layout's height for them.
    fn install_plan(&mut self, backend: &dyn Backend, total: u64) {
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
        let layout = plan_static_layout(&spans, LAYOUT_TRIES, 0x5eed);
        let height = layout.height.next_multiple_of(self.granularity);
        let Some(base) = self.map_plan_range(backend, stream, height, total) else {
            self.stats.num_plans_refused += 1;
            return;
        };
        let mut slots = vec![None; self.steps.requests.len()];
        for (&k, &off) in planned.iter().zip(&layout.offsets) {
            slots[k] = Some((self.steps.requests[k].size, off));
        }
        let seg = self.planned_seg;
        self.steps.plan = Some(Plan {
            seg,
            base,
            stream,
            slots,
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
    ) -> Option<u64> {
        let over = self
            .reserved()
            .saturating_add(height)
            .saturating_sub(self.soft_cap(total));
        if over > 0 {
            self.release_pages(backend, over, [None, None], Release::Move(stream));
        }
        let mut mapped = self.check_limit(height).is_ok() && {
            let r = self.reserve_range(backend, PoolKind::Large, stream, height);
            match r {
                Ok(hole) => self.map_whole(backend, hole, height, stream),
                Err(_) => false,
            }
        };
        if !mapped && self.releasable_pages() > 0 {
            // the device refused: move every free page, then try once more
            self.release_pages(backend, u64::MAX, [None, None], Release::Move(stream));
            mapped = self.check_limit(height).is_ok()
                && match self.reserve_range(backend, PoolKind::Large, stream, height) {
                    Ok(hole) => self.map_whole(backend, hole, height, stream),
                    Err(_) => false,
                };
        }
        if let Err(e) = backend.release_spares() {
            tracing::warn!(error = %e, "releasing spare pages failed");
        }
        self.release_empty_ranges_of(backend, PoolKind::Large, stream);
        mapped.then(|| self.segs[self.planned_seg].base)
    }

    /// Maps the whole of the just-reserved range `hole`; on success it becomes the plan's
    /// range (`planned_seg`), its one free block unindexed.
    fn map_whole(
        &mut self,
        backend: &dyn Backend,
        hole: BlockId,
        height: u64,
        stream: StreamId,
    ) -> bool {
        let addr = self.blocks[hole].addr;
        if backend.map(addr, height).is_err() {
            return false;
        }
        let id = self.mapped(hole, height, height, stream);
        self.planned_seg = self.blocks[id].seg;
        true
    }

    /// Drops the installed plan: its range becomes an ordinary growable segment (its free
    /// blocks indexed, its free pages releasable).
    pub fn drop_plan(&mut self) {
        let Some(plan) = self.steps.plan.take() else {
            return;
        };
        self.planned_seg = NO_SEG;
        let mut at = Some(self.segs[plan.seg].first);
        while let Some(id) = at {
            at = self.blocks[id].next;
            if self.blocks[id].is_free() {
                self.index_insert(id);
            }
        }
        self.steps.missed_steps = 0;
        self.stats.num_plans_dropped += 1;
    }
}
