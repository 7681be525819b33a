//! Fixed segments (PyTorch's native mode): one backend allocation per segment, sized by
//! [`segment_size`], split into blocks; released whole when every block in it is free.

use super::block::{Block, BlockId, BlockState, PoolKind};
use super::history::TraceAction;
use super::pool::segment_size;
use super::state::{Segment, State};
use super::GrowError;
use crate::backend::{Backend, StreamId};

impl State {
    /// Allocates a new fixed segment for a request of `size` and returns its first block,
    /// split to `size` and not indexed. `exact_under_limit`: when the rounded segment (2 or 20
    /// MiB, or a multiple of 2 MiB) would pass the memory limit and `size` would not, the
    /// segment is of exactly `size` (as rmm's pool with that maximum serves the request).
    pub fn grow_fixed(
        &mut self,
        backend: &dyn Backend,
        pool: PoolKind,
        stream: StreamId,
        size: u64,
        exact_under_limit: bool,
    ) -> Result<BlockId, GrowError> {
        let mut seg_size = segment_size(size).ok_or(GrowError::TooLarge)?;
        if exact_under_limit
            && self.check_limit(seg_size).is_err()
            && self.check_limit(size).is_ok()
        {
            seg_size = size;
        }
        self.new_segment(backend, pool, stream, size, seg_size)
    }

    /// A segment of exactly `size` bytes holding one block (`backend:cudaMallocAsync`).
    pub fn grow_exact(
        &mut self,
        backend: &dyn Backend,
        pool: PoolKind,
        stream: StreamId,
        size: u64,
    ) -> Result<BlockId, GrowError> {
        self.new_segment(backend, pool, stream, size, size)
    }

    fn new_segment(
        &mut self,
        backend: &dyn Backend,
        pool: PoolKind,
        stream: StreamId,
        size: u64,
        seg_size: u64,
    ) -> Result<BlockId, GrowError> {
        self.check_limit(seg_size)?;
        let base = backend.alloc_segment(seg_size, stream)?;
        self.check_new_range("alloc_segment", base, seg_size)?;
        let small = pool.is_small();
        let seg = self.add_segment(Segment {
            base,
            size: seg_size,
            stream,
            pool,
            growable: false,
            mapped: seg_size,
            handle: seg_size,
            first: 0,
        });
        let id = self.blocks.insert(Block {
            addr: base,
            size: seg_size,
            requested: 0,
            seg,
            prev: None,
            next: None,
            state: BlockState::Free,
            mapped: true,
            stream,
            pool,
            other_streams: Vec::new(),
            generation: 0,
            lent_to: (0, 0),
        });
        self.segs[seg].first = id;
        let s = &mut self.stats;
        s.reserved_bytes.add(small, seg_size);
        s.segment.add(small, 1);
        s.num_device_alloc += 1;
        if seg_size >= self.cfg.max_split_size {
            s.oversize_segments.add(1);
        }
        self.trace(TraceAction::SegmentAlloc, base, seg_size, stream);
        self.split_to(id, size);
        Ok(id)
    }

    /// Bytes of the fixed segments whose memory is all free: what [`State::release_fixed`]
    /// would give back.
    pub fn releasable_segments(&mut self) -> u64 {
        let whole = self.whole_free_segments();
        whole.iter().map(|&id| self.blocks[id].size).sum()
    }

    /// The free blocks that are whole fixed segments. Nothing freed or split since a scan found
    /// none: none, without a scan (a run of failing allocations asks on every failure).
    fn whole_free_segments(&mut self) -> Vec<BlockId> {
        let versions = self.free_versions();
        if self.fixed_clean_at == Some(versions) {
            return Vec::new();
        }
        let whole: Vec<BlockId> = self
            .free
            .iter()
            .flat_map(|f| f.ids())
            .filter(|&id| {
                let b = &self.blocks[id];
                b.prev.is_none() && b.next.is_none() && !self.segs[b.seg].growable
            })
            .collect();
        if whole.is_empty() {
            self.fixed_clean_at = Some(versions);
        }
        whole
    }

    /// Returns every fixed segment whose memory is all free to the backend; returns the bytes
    /// released.
    pub fn release_fixed(&mut self, backend: &dyn Backend) -> u64 {
        let whole = self.whole_free_segments();
        let mut released = 0;
        for id in whole {
            let (seg, addr, size, small, stream) = {
                let b = &self.blocks[id];
                (b.seg, b.addr, b.size, b.pool.is_small(), b.stream)
            };
            if let Err(e) = backend.free_segment(addr, size) {
                // Keep the segment: memory the device did not take back is still ours.
                tracing::warn!(error = %e, "freeing a cached segment failed; keeping it");
                continue;
            }
            self.trace(TraceAction::SegmentFree, addr, size, stream);
            self.index_remove(id);
            self.blocks.remove(id);
            self.remove_segment(seg);
            let s = &mut self.stats;
            s.reserved_bytes.sub(small, size);
            s.segment.sub(small, 1);
            s.num_device_free += 1;
            if size >= self.cfg.max_split_size {
                s.oversize_segments.sub(1);
            }
            released += size;
        }
        released
    }

    /// Fails when growing by `bytes` would pass the device-wide limit.
    pub fn check_limit(&self, bytes: u64) -> Result<(), GrowError> {
        match self.limit {
            Some(limit) if self.reserved().saturating_add(bytes) > limit => Err(GrowError::Limit),
            _ => Ok(()),
        }
    }
}
