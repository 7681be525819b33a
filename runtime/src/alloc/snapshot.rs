//! Snapshots of the allocator's segments and blocks, and a consistency check over them.

use std::collections::HashSet;

use super::block::{BlockState, PoolKind};
use super::state::State;
use super::thread_cache::{CacheState, Slot, SlotState};
use super::CachingAllocator;
use crate::backend::StreamId;

/// State of a block in a snapshot (PyTorch's names in the comments).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BlockStatus {
    /// Handed out (`active_allocated`).
    Allocated,
    /// Freed, awaiting another stream (`active_awaiting_free`).
    PendingFree,
    /// Free and backed by memory (`inactive`).
    Free,
    /// Free address space with no memory behind it (growable segments only).
    Unmapped,
}

/// A block in a snapshot.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BlockInfo {
    /// Device address.
    pub addr: u64,
    /// Bytes.
    pub size: u64,
    /// Bytes the caller asked for (allocated blocks).
    pub requested: u64,
    /// Its state.
    pub status: BlockStatus,
}

/// A segment in a snapshot, with its blocks in address order.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SegmentInfo {
    /// Base address.
    pub base: u64,
    /// Bytes (fixed) or reserved address range (growable).
    pub size: u64,
    /// Bytes backed by device memory.
    pub mapped: u64,
    /// Stream it serves.
    pub stream: StreamId,
    /// Pool it serves.
    pub pool: PoolKind,
    /// Whether it is a growable segment.
    pub growable: bool,
    /// Its blocks, tiling it.
    pub blocks: Vec<BlockInfo>,
}

impl CachingAllocator {
    /// The segments and their blocks, in address order.
    pub fn snapshot(&self) -> Vec<SegmentInfo> {
        let st = self.lock();
        // A parked block is listed as the free block it is, and stays parked: reading changes
        // nothing. (A parked large block has no free neighbour: a neighbour's free merges it. A
        // parked small block may sit beside a free one; both are listed until a flush merges
        // them.)
        self.with_caches_locked(|locked| snapshot(&st, locked))
    }

    /// Checks every internal invariant; `Err` describes the first violation. For tests and
    /// fuzzing: blocks tile their segments, neighbours link both ways, no two free neighbours of
    /// the same mapped state, free blocks indexed exactly once (those of a step plan's range in
    /// no index), statistics equal a recount.
    #[doc(hidden)]
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut st = self.lock();
        self.fold_caches(&mut st);
        self.with_caches_locked(|locked| st.check(locked))
    }
}

/// The segments and their blocks (the allocator and every cache locked).
fn snapshot(st: &State, locked: &[(u32, &mut CacheState)]) -> Vec<SegmentInfo> {
    let mut out: Vec<SegmentInfo> = st
        .segs
        .iter()
        .map(|(_, s)| {
            let mut blocks = Vec::new();
            let mut cur = Some(s.first);
            while let Some(id) = cur {
                let b = &st.blocks[id];
                let lent = (b.state == BlockState::Lent)
                    .then(|| lent_slot(locked, b.lent_to))
                    .flatten();
                blocks.push(BlockInfo {
                    addr: b.addr,
                    size: b.size,
                    requested: lent.map_or(b.requested, |s| s.requested),
                    status: match (b.state, b.mapped) {
                        (BlockState::Lent, _) => match lent.map(|s| s.state) {
                            Some(SlotState::Allocated) => BlockStatus::Allocated,
                            _ => BlockStatus::Free,
                        },
                        (BlockState::Allocated, _) => BlockStatus::Allocated,
                        (BlockState::PendingFree, _) => BlockStatus::PendingFree,
                        (BlockState::Free | BlockState::Parked, true) => BlockStatus::Free,
                        (BlockState::Free | BlockState::Parked, false) => BlockStatus::Unmapped,
                    },
                });
                cur = b.next;
            }
            SegmentInfo {
                base: s.base,
                size: s.size,
                mapped: s.mapped,
                stream: s.stream,
                pool: s.pool,
                growable: s.growable,
                blocks,
            }
        })
        .collect();
    out.sort_by_key(|s| s.base);
    out
}

/// The slot a lent block's `lent_to` names, among the locked caches.
fn lent_slot<'a>(
    caches: &'a [(u32, &mut CacheState)],
    (cache, slot): (u32, u32),
) -> Option<&'a Slot> {
    let (_, cs) = caches.iter().find(|(i, _)| *i == cache)?;
    cs.slots.get(slot as usize)
}

/// Checks the caches against the blocks: every slot in use names a block lent to it, every
/// cached slot is in its list once, the counts match.
fn check_caches(st: &State, caches: &[(u32, &mut CacheState)]) -> Result<(), String> {
    for (index, cs) in caches {
        let (mut cached, mut live) = (0, 0);
        for (i, s) in cs.slots.iter().enumerate() {
            match s.state {
                SlotState::Vacant => continue,
                SlotState::Cached => {
                    cached += 1;
                    let n = cs
                        .lists
                        .get(&(s.stream, s.size))
                        .map_or(0, |l| l.iter().filter(|&&j| j as usize == i).count());
                    if n != 1 {
                        return Err(format!("cache {index}: slot {i} is in its list {n} times"));
                    }
                }
                SlotState::Allocated => live += 1,
            }
            let b = st.blocks.get(s.block);
            if !b.is_some_and(|b| {
                b.state == BlockState::Lent
                    && b.lent_to == (*index, i as u32)
                    && b.addr == s.addr
                    && b.size == s.size
            }) {
                return Err(format!(
                    "cache {index}: slot {i} names block {} which is not lent to it",
                    s.block
                ));
            }
        }
        let listed: usize = cs.lists.values().map(Vec::len).sum();
        if cached != cs.cached || listed != cached || live != cs.live {
            return Err(format!(
                "cache {index}: {cached} cached ({listed} listed, count {}), {live} live (count {})",
                cs.cached, cs.live
            ));
        }
    }
    Ok(())
}

impl State {
    fn check(&self, caches: &[(u32, &mut CacheState)]) -> Result<(), String> {
        check_caches(self, caches)?;
        self.check_seg_ranges()?;
        let mut seen = HashSet::new();
        // Recounts, per pool (0: small, 1: large).
        let mut c = Recount::default();
        for (sid, s) in self.segs.iter() {
            let p = s.pool as usize;
            if s.growable != self.growable {
                return Err(format!("segment {sid}: not of the allocator's kind"));
            }
            c.segment[p] += 1;
            if !s.growable && s.size >= self.cfg.max_split_size {
                c.oversize_segments += 1;
            }
            let mut cur = Some(s.first);
            let mut expect_addr = s.base;
            let mut prev = None;
            let mut mapped = 0;
            while let Some(id) = cur {
                let b = self
                    .blocks
                    .get(id)
                    .ok_or(format!("segment {sid}: dangling block {id}"))?;
                if !seen.insert(id) {
                    return Err(format!("block {id} reached twice"));
                }
                if b.seg != sid || b.addr != expect_addr || b.prev != prev || b.size == 0 {
                    return Err(format!(
                        "segment {sid}: block {id} breaks the tiling: {b:?}"
                    ));
                }
                if b.stream != s.stream || b.pool != s.pool {
                    return Err(format!(
                        "block {id} has another stream or pool than its segment"
                    ));
                }
                if b.mapped {
                    mapped += b.size;
                } else if !s.growable
                    || b.addr % self.granularity != 0
                    || b.size % self.granularity != 0
                {
                    return Err(format!(
                        "block {id}: unmapped but not whole pages of a growable segment"
                    ));
                }
                if let Some(p) = prev {
                    let pb = &self.blocks[p];
                    if pb.is_free() && b.is_free() && pb.mapped == b.mapped {
                        return Err(format!("free neighbours {p} and {id} not merged"));
                    }
                }
                let lent = (b.state == BlockState::Lent)
                    .then(|| lent_slot(caches, b.lent_to))
                    .flatten();
                let lent_state = lent.map(|s| s.state);
                if (matches!(b.state, BlockState::Free | BlockState::Parked)
                    || lent_state == Some(SlotState::Cached))
                    && self.inactive_split(b)
                {
                    c.inactive_split[p] += 1;
                    c.inactive_split_bytes[p] += b.size;
                }
                match b.state {
                    BlockState::Allocated => {
                        c.allocated_bytes[p] += b.size;
                        c.allocation[p] += 1;
                        c.active_bytes[p] += b.size;
                        c.active[p] += 1;
                        c.requested_bytes[p] += b.requested;
                        if b.size >= self.cfg.max_split_size {
                            c.oversize_allocations += 1;
                        }
                    }
                    BlockState::PendingFree => {
                        c.active_bytes[p] += b.size;
                        c.active[p] += 1;
                    }
                    BlockState::Parked => {
                        let n = self
                            .quick
                            .get(&(b.stream, b.size))
                            .map_or(0, |l| l.iter().filter(|&&i| i == id).count());
                        if n != 1 || !b.mapped {
                            return Err(format!(
                                "parked block {id} is in its quick list {n} times"
                            ));
                        }
                    }
                    BlockState::Lent => match lent {
                        Some(s) if s.state == SlotState::Allocated => {
                            c.allocated_bytes[p] += b.size;
                            c.allocation[p] += 1;
                            c.active_bytes[p] += b.size;
                            c.active[p] += 1;
                            c.requested_bytes[p] += s.requested;
                            if b.size >= self.cfg.max_split_size {
                                c.oversize_allocations += 1;
                            }
                        }
                        Some(s) if s.state == SlotState::Cached && b.mapped => {}
                        _ => return Err(format!("lent block {id} has no slot in use")),
                    },
                    BlockState::Free if b.seg == self.planned_seg => {
                        // a step plan's range: found by offset, in no index, always mapped
                        let listed = self.free[b.pool as usize]
                            .contains(b.stream, b.size, b.addr, id)
                            || self.unmapped[b.pool as usize].contains(&(b.stream, b.addr, id));
                        if listed || !b.mapped {
                            return Err(format!(
                                "free block {id} of the plan's range is indexed or unmapped"
                            ));
                        }
                    }
                    BlockState::Free => {
                        let indexed = if b.mapped {
                            self.free[b.pool as usize].contains(b.stream, b.size, b.addr, id)
                        } else {
                            self.unmapped[b.pool as usize].contains(&(b.stream, b.addr, id))
                        };
                        if !indexed {
                            return Err(format!("free block {id} is not indexed"));
                        }
                    }
                }
                expect_addr = b.end();
                prev = Some(id);
                cur = b.next;
            }
            if expect_addr != s.base + s.size {
                return Err(format!(
                    "segment {sid}: blocks end at {expect_addr:#x}, not at its end"
                ));
            }
            // Mapped pages of a growable segment cover the mapped blocks, rounded out to pages.
            // (a shared plan's range maps each of its pool's pages at several addresses: its
            // blocks may exceed the pages behind it)
            let shared = sid == self.planned_seg && self.shared_pages().is_some();
            if s.growable {
                if mapped > s.mapped && !shared {
                    return Err(format!("segment {sid}: mapped blocks exceed mapped pages"));
                }
            } else if s.mapped != s.size {
                return Err(format!("fixed segment {sid} is not fully mapped"));
            }
            c.reserved_bytes[p] += s.mapped;
        }
        if seen.len() != self.blocks.len() {
            return Err(format!(
                "{} blocks belong to no segment",
                self.blocks.len() - seen.len()
            ));
        }
        for f in &self.free {
            f.check_largest()?;
        }
        let indexed = self.free[0].len()
            + self.free[1].len()
            + self.unmapped[0].len()
            + self.unmapped[1].len();
        let free_blocks = self
            .blocks
            .iter()
            .filter(|(_, b)| b.is_free() && b.seg != self.planned_seg)
            .count();
        let parked = self
            .blocks
            .iter()
            .filter(|(_, b)| b.state == BlockState::Parked)
            .count();
        if parked != self.parked || self.quick.values().map(Vec::len).sum::<usize>() != parked {
            return Err(format!(
                "{parked} parked blocks, count says {}",
                self.parked
            ));
        }
        if indexed != free_blocks {
            return Err(format!(
                "{indexed} indexed free blocks, {free_blocks} free blocks"
            ));
        }
        // Every statistic that describes the present is recounted from the blocks, per pool.
        let st = &self.stats;
        let pooled = [
            ("allocated_bytes", &st.allocated_bytes, c.allocated_bytes),
            ("allocation", &st.allocation, c.allocation),
            ("reserved_bytes", &st.reserved_bytes, c.reserved_bytes),
            ("segment", &st.segment, c.segment),
            ("active_bytes", &st.active_bytes, c.active_bytes),
            ("active", &st.active, c.active),
            ("requested_bytes", &st.requested_bytes, c.requested_bytes),
            (
                "inactive_split_bytes",
                &st.inactive_split_bytes,
                c.inactive_split_bytes,
            ),
            ("inactive_split", &st.inactive_split, c.inactive_split),
        ];
        for (name, kept, [small, large]) in pooled {
            let kept = [kept.small.current, kept.large.current, kept.all.current];
            if kept != [small, large, small + large] {
                return Err(format!(
                    "stat {name} (small, large, all): kept {kept:?}, recounted {:?}",
                    [small, large, small + large]
                ));
            }
        }
        let single = [
            (
                "oversize_allocations",
                st.oversize_allocations.current,
                c.oversize_allocations,
            ),
            (
                "oversize_segments",
                st.oversize_segments.current,
                c.oversize_segments,
            ),
        ];
        for (name, kept, counted) in single {
            if kept != counted {
                return Err(format!("stat {name}: kept {kept}, recounted {counted}"));
            }
        }
        Ok(())
    }
}

/// Statistics recounted from the blocks: `[small pool, large pool]`.
#[derive(Default)]
struct Recount {
    allocated_bytes: [u64; 2],
    allocation: [u64; 2],
    reserved_bytes: [u64; 2],
    segment: [u64; 2],
    active_bytes: [u64; 2],
    active: [u64; 2],
    requested_bytes: [u64; 2],
    inactive_split_bytes: [u64; 2],
    inactive_split: [u64; 2],
    oversize_allocations: u64,
    oversize_segments: u64,
}
