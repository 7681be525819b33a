//! Step plans shared at page granularity: a repeating step whose contiguous layout is taller
//! than the card (`static_layout`: VGG-16 at 1,951 rows, 1.0103 × its peak live bytes) served
//! with no page moved all the same.
//!
//! Each planned request gets an address range of its own (its *slot*, whole pages), and the
//! slots are backed by one pool of physical pages mapped once at a *home* range: a slot's pages
//! are the pool's pages chosen for it, mapped again at the slot (`Backend::map_alias`). Two
//! requests live at the same time in the recorded step get no page in common; requests never
//! live together may share pages. Choosing pages is colouring an interval graph, which a greedy
//! pass in the step's order does with as many pages as the step ever holds at once (its peak
//! live bytes, each request rounded up to whole pages): no fragmentation to plan around.
//!
//! A slot's address range being free does not make its pages free: a block of an earlier step
//! freed later than in the recorded one may still hold a page the slot shares. So a request is
//! served at its slot only when none of the slot's pages is held (`users`); otherwise it is a
//! miss, served outside the plan as before, and the plan's free address ranges are never handed
//! to best fit. A block served from a slot holds its pages until it is released to the cache
//! (`State::release_block`).
//!
//! Dropping the plan (its misses, `empty_cache`, an out-of-memory release) stops serving from
//! it; its memory is given back once no block of it is live, at the next step mark, `empty_cache`
//! or out-of-memory release.

use rustc_hash::FxHashMap;

use super::block::{BlockId, PoolKind, SegId};
use super::state::State;
use super::static_layout::LifeSpan;
use super::steps::{SharedPages, NO_SEG};
use crate::backend::{Backend, StreamId};

/// The pool pages of each span (runs of consecutive pages) and the pool's size in pages:
/// spans taken in the step's order, each given the lowest free pages, its pages freed at its
/// end.
pub(super) fn assign_pages(spans: &[LifeSpan], page: u64) -> (Vec<Vec<(u32, u32)>>, u32) {
    let mut events: Vec<(usize, bool, usize)> = spans
        .iter()
        .enumerate()
        .flat_map(|(k, s)| [(s.start, true, k), (s.end, false, k)])
        .collect();
    // frees before allocations at the same clock (a block freed at `e` and one made at `e` do
    // not live at once)
    events.sort_unstable_by_key(|&(at, alloc, k)| (at, alloc, k));
    let mut free: std::collections::BTreeSet<u32> = std::collections::BTreeSet::new();
    let mut pool = 0u32;
    let mut runs: Vec<Vec<(u32, u32)>> = vec![Vec::new(); spans.len()];
    for (_, alloc, k) in events {
        if !alloc {
            for &(first, n) in &runs[k] {
                free.extend(first..first + n);
            }
            continue;
        }
        let mut need = spans[k].bytes.div_ceil(page) as u32;
        let mut pages: Vec<u32> = Vec::with_capacity(need as usize);
        while need > 0 {
            match free.pop_first() {
                Some(p) => pages.push(p),
                None => {
                    pages.extend(pool..pool + need);
                    pool += need;
                    break;
                }
            }
            need -= 1;
        }
        pages.sort_unstable();
        let mut r: Vec<(u32, u32)> = Vec::new();
        for p in pages {
            match r.last_mut() {
                Some((first, n)) if *first + *n == p => *n += 1,
                _ => r.push((p, 1)),
            }
        }
        runs[k] = r;
    }
    (runs, pool)
}

impl State {
    /// Maps a shared plan for `spans` on `stream`: the pool at a home range (free pages moved
    /// out first as the memory limit requires, all of them if the device refuses), then each
    /// slot as aliases of its pages; the slots' range becomes the plan's (`planned_seg`).
    /// Returns its base address, each span's offset in it, and the pages; `None` (nothing left
    /// mapped) when the pool does not fit.
    pub(super) fn map_shared_plan(
        &mut self,
        backend: &dyn Backend,
        stream: StreamId,
        spans: &[LifeSpan],
        total: u64,
    ) -> Option<(u64, Vec<u64>, SharedPages)> {
        let g = self.granularity;
        let (runs, pool) = assign_pages(spans, g);
        let home_bytes = u64::from(pool) * g;
        let reserved = self.reserved();
        // What the step needs outside the plan stays: the small pool's pages and a page of
        // headroom for each pool (the step's small blocks, and large ones the plan leaves out,
        // grow there as before); only the large pool's free pages count as movable.
        let movable: u64 = self
            .free_runs()
            .filter(|&(_, id)| !self.blocks[id].pool.is_small())
            .map(|(n, _)| n)
            .sum();
        let after = (reserved - movable.min(reserved))
            .saturating_add(home_bytes)
            .saturating_add(2 * g);
        // not above what the device is known to hold: a pool that cannot be mapped costs its
        // mapping and undoing, seconds at this size
        if pool == 0 || after > self.known_cap(total) {
            return None;
        }
        let over = reserved
            .saturating_add(home_bytes)
            .saturating_sub(self.soft_cap(total));
        if over > 0 {
            self.release_pages(
                backend,
                over,
                [None, None],
                super::growable::Release::Move(stream),
            );
        }
        if self.check_limit(home_bytes).is_err() {
            return None;
        }
        let home = backend.reserve(home_bytes).ok()?;
        if let Err(e) = self.check_new_range("reserve", home, home_bytes) {
            tracing::warn!(error = %e, "a shared plan's home range was refused");
            return None;
        }
        // The driver maps a handle at a second address only whole (`cuMemMap`'s offset must be
        // 0): a group of pages becomes one larger handle only when every slot that uses it
        // takes it whole, the rest are single pages. Fewer handles, fewer driver calls.
        let handle = match self.cfg.page_recycle_threshold {
            None => crate::backend::handle_runs::handle_size(g, self.cap(total)),
            Some(_) => g,
        };
        let whole = whole_groups(&runs, pool, (handle / g) as u32);
        let mut mapped = self.map_home(backend, home, &whole, handle);
        if mapped.is_err() && self.releasable_pages() > 0 {
            self.release_pages(
                backend,
                u64::MAX,
                [None, None],
                super::growable::Release::Move(stream),
            );
            mapped = self.map_home(backend, home, &whole, handle);
        }
        if let Err(e) = backend.release_spares() {
            tracing::warn!(error = %e, "releasing spare pages failed");
        }
        if mapped.is_err() {
            let _ = backend.release(home, home_bytes);
            return None;
        }
        let va: u64 = spans.iter().map(|s| s.bytes.next_multiple_of(g)).sum();
        let undo_home = |st: &mut State| {
            st.handles.remove(home, home + home_bytes);
            let _ = backend.unmap(home, home_bytes);
            let _ = backend.release(home, home_bytes);
        };
        let Ok(hole) = self.reserve_range(backend, PoolKind::Large, stream, va, total) else {
            undo_home(self);
            return None;
        };
        let base = self.blocks[hole].addr;
        let mut offsets = Vec::with_capacity(spans.len());
        let mut slots = FxHashMap::default();
        let mut at = 0u64;
        let mut aliased: Vec<(u64, u64)> = Vec::new();
        let mut ok = true;
        'spans: for (s, r) in spans.iter().zip(runs) {
            let bytes = s.bytes.next_multiple_of(g);
            let mut off = 0u64;
            for &(first, n) in &r {
                let len = u64::from(n) * g;
                if let Err(e) = backend.map_alias(base + at + off, home + u64::from(first) * g, len)
                {
                    tracing::warn!(error = %e, "mapping a shared plan's slot failed");
                    ok = false;
                    break 'spans;
                }
                aliased.push((base + at + off, len));
                off += len;
            }
            offsets.push(at);
            slots.insert(at, (bytes, r));
            at += bytes;
        }
        if !ok {
            for (a, len) in aliased {
                let _ = backend.unmap_alias(a, len);
            }
            self.release_empty_ranges_of(backend, PoolKind::Large, stream);
            undo_home(self);
            return None;
        }
        // The range's one free block: mapped (through the aliases), in no index.
        let seg = self.blocks[hole].seg;
        self.index_remove(hole);
        self.planned_seg = seg; // (after: the index skips the plan's blocks)
        self.blocks[hole].mapped = true;
        self.segs[seg].mapped = home_bytes;
        let s = &mut self.stats;
        s.reserved_bytes.add(false, home_bytes);
        s.num_device_alloc += 1;
        s.num_map += 1;
        s.mapped_bytes_total += home_bytes;
        self.high_water = self.high_water.max(s.reserved_bytes.all.current);
        self.stats.num_plans_shared += 1;
        let shared = SharedPages {
            home,
            home_bytes,
            slots,
            users: vec![0; pool as usize],
            live: FxHashMap::default(),
        };
        Some((base, offsets, shared))
    }

    /// The pages of the plan's range when it is shared at page granularity (installed or
    /// draining).
    pub(super) fn shared_pages(&self) -> Option<&SharedPages> {
        match (&self.steps.plan, &self.steps.draining) {
            (Some(p), _) if p.shared.is_some() => p.shared.as_ref(),
            (_, d) => d.as_ref(),
        }
    }

    /// Maps the pool at `home`: each run of `whole` (first page, pages, whether in handles of
    /// `handle` bytes) with handles of `handle` bytes, the rest with pages. On
    /// failure nothing stays mapped.
    fn map_home(
        &mut self,
        backend: &dyn Backend,
        home: u64,
        whole: &[(u64, u64, bool)],
        handle: u64,
    ) -> Result<(), crate::backend::BackendError> {
        let g = self.granularity;
        for (i, &(first, pages, big)) in whole.iter().enumerate() {
            let (at, bytes) = (home + first * g, pages * g);
            if let Err(e) = self.map_pages(backend, at, bytes, if big { handle } else { g }) {
                for &(first, pages, _) in &whole[..i] {
                    let (at, bytes) = (home + first * g, pages * g);
                    self.handles.remove(at, at + bytes);
                    let _ = backend.unmap(at, bytes);
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// The shared plan holding segment `seg`'s blocks (installed or draining), if any.
    fn shared_of(&mut self, seg: SegId) -> Option<&mut SharedPages> {
        if seg == NO_SEG || seg != self.planned_seg {
            return None;
        }
        match (&mut self.steps.plan, &mut self.steps.draining) {
            (Some(p), _) if p.shared.is_some() => p.shared.as_mut(),
            (_, d) => d.as_mut(),
        }
    }

    /// Whether the slot at `off` can be served now: none of its pages is held. `true` for a
    /// plan that is not shared.
    pub(super) fn shared_slot_free(&mut self, seg: SegId, off: u64) -> bool {
        let Some(sh) = self.shared_of(seg) else {
            return true;
        };
        let Some((_, runs)) = sh.slots.get(&off) else {
            return false;
        };
        runs.iter().all(|&(first, n)| {
            sh.users[first as usize..(first + n) as usize]
                .iter()
                .all(|&u| u == 0)
        })
    }

    /// Block `id`, just served from the slot at `off`, holds the slot's pages.
    pub(super) fn shared_slot_taken(&mut self, seg: SegId, off: u64, id: BlockId) {
        let Some(sh) = self.shared_of(seg) else {
            return;
        };
        let SharedPages {
            slots, users, live, ..
        } = sh;
        if let Some((_, runs)) = slots.get(&off) {
            for &(first, n) in runs {
                users[first as usize..(first + n) as usize].fill(1);
            }
            live.insert(id, off);
        }
    }

    /// Block `id` of a shared plan's range goes back to the cache: its slot's pages are free.
    pub(super) fn shared_block_released(&mut self, id: BlockId) {
        let seg = self.blocks[id].seg;
        let Some(sh) = self.shared_of(seg) else {
            return;
        };
        let SharedPages {
            slots, users, live, ..
        } = sh;
        if let Some(off) = live.remove(&id) {
            if let Some((_, runs)) = slots.get(&off) {
                for &(first, n) in runs {
                    users[first as usize..(first + n) as usize].fill(0);
                }
            }
        }
    }

    /// Gives back a dropped shared plan's memory when no block of it is live: the slots'
    /// aliases, the pool and both address ranges.
    pub fn release_drained_plan(&mut self, backend: &dyn Backend) {
        let idle = self
            .steps
            .draining
            .as_ref()
            .is_some_and(|d| d.live.is_empty());
        if !idle {
            return;
        }
        let d = self.steps.draining.take().expect("checked above");
        let seg = self.planned_seg;
        let first = self.segs[seg].first;
        let (base, stream) = (self.segs[seg].base, self.segs[seg].stream);
        debug_assert!(self.blocks[first].next.is_none() && self.blocks[first].is_free());
        // every slot is covered by its aliases: unmap them slot by slot
        let mut offs: Vec<(u64, u64)> = d.slots.iter().map(|(&o, (b, _))| (o, *b)).collect();
        offs.sort_unstable();
        for (o, bytes) in offs {
            if let Err(e) = backend.unmap_alias(base + o, bytes) {
                tracing::warn!(error = %e, "unmapping a shared plan's slot failed; keeping its memory");
                return;
            }
        }
        if let Err(e) = backend.unmap(d.home, d.home_bytes) {
            tracing::warn!(error = %e, "unmapping a shared plan's pool failed; keeping it");
            return;
        }
        self.handles.remove(d.home, d.home + d.home_bytes);
        if let Err(e) = backend.release(d.home, d.home_bytes) {
            tracing::warn!(error = %e, "releasing a shared plan's pool range failed");
        }
        let s = &mut self.stats;
        s.reserved_bytes.sub(false, d.home_bytes);
        s.num_device_free += 1;
        s.num_unmap += 1;
        s.unmapped_bytes_total += d.home_bytes;
        // the slots' range: one unmapped free block, released as an empty range
        self.planned_seg = NO_SEG;
        self.segs[seg].mapped = 0;
        self.blocks[first].mapped = false;
        self.index_insert(first);
        self.release_empty_ranges_of(backend, PoolKind::Large, stream);
    }
}

/// The pool cut into runs `(first page, pages, one handle per group)`: a group of `per` pages is
/// one handle when every slot run that touches it covers it whole (and it lies inside the
/// pool); runs of such groups alternate with runs of single pages.
fn whole_groups(runs: &[Vec<(u32, u32)>], pool: u32, per: u32) -> Vec<(u64, u64, bool)> {
    let groups = pool.div_ceil(per.max(1)) as usize;
    let mut split = vec![per <= 1; groups];
    if per > 1 {
        if let Some(last) = split.last_mut() {
            *last |= pool % per != 0;
        }
        for r in runs.iter().flatten() {
            let (first, end) = (r.0, r.0 + r.1);
            if first % per != 0 {
                split[(first / per) as usize] = true;
            }
            if end % per != 0 {
                split[(end / per) as usize] = true;
            }
        }
    }
    let mut out: Vec<(u64, u64, bool)> = Vec::new();
    for (i, &cut) in split.iter().enumerate() {
        let start = u64::from(i as u32 * per);
        let len = u64::from(per.min(pool - i as u32 * per));
        match out.last_mut() {
            Some((_, n, big)) if *big != cut => *n += len,
            _ => out.push((start, len, !cut)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random steps: no two spans live at once get a page in common, each span gets the pages
    /// it needs, and the pool is the most pages live at once (the colouring is exact).
    #[test]
    fn pages_go_to_spans_never_live_together_and_the_pool_is_the_peak() {
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let page = 2u64 << 20;
        for _ in 0..200 {
            let n = 1 + (next() % 40) as usize;
            let mut clock = 0usize;
            let mut spans: Vec<LifeSpan> = Vec::new();
            let mut open: Vec<usize> = Vec::new();
            for _ in 0..n {
                spans.push(LifeSpan {
                    start: clock,
                    end: usize::MAX,
                    bytes: 1 + next() % (40 * page),
                });
                clock += 1;
                open.push(spans.len() - 1);
                while open.len() > (next() % 6) as usize {
                    let k = open.swap_remove((next() as usize) % open.len());
                    spans[k].end = clock;
                    clock += 1;
                }
            }
            let (runs, pool) = assign_pages(&spans, page);
            let mut peak = 0u64;
            for t in 0..clock {
                let live: u64 = spans
                    .iter()
                    .filter(|s| s.start <= t && t < s.end)
                    .map(|s| s.bytes.div_ceil(page))
                    .sum();
                peak = peak.max(live);
            }
            assert_eq!(u64::from(pool), peak);
            for (k, s) in spans.iter().enumerate() {
                let got: u32 = runs[k].iter().map(|&(_, n)| n).sum();
                assert_eq!(u64::from(got), s.bytes.div_ceil(page));
                assert!(runs[k].iter().all(|&(f, n)| f + n <= pool));
                for (j, o) in spans.iter().enumerate().skip(k + 1) {
                    if s.start < o.end && o.start < s.end {
                        for &(a, an) in &runs[k] {
                            for &(b, bn) in &runs[j] {
                                assert!(
                                    a + an <= b || b + bn <= a,
                                    "spans {k} and {j} share a page"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
