//! Blocks: contiguous pieces of a segment, free or handed out, kept in an index arena.
//!
//! Invariants: the blocks of a segment tile it exactly, in address order, linked by `prev`/`next`;
//! two neighbours are never both free with the same `mapped` state (they are merged); an unmapped
//! block starts and ends on page boundaries.

use crate::backend::StreamId;

/// Index of a block in the arena.
pub(crate) type BlockId = u32;
/// Index of a segment in the arena.
pub(crate) type SegId = u32;

/// Which pool a block belongs to.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum PoolKind {
    /// Requests of 1 MiB or less, served from 2 MiB segments.
    Small = 0,
    /// Everything larger.
    Large = 1,
}

impl PoolKind {
    pub(crate) fn is_small(self) -> bool {
        self == PoolKind::Small
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BlockState {
    Free,
    Allocated,
    /// Freed by its owner, waiting for other streams' work (`record_stream`) before reuse.
    PendingFree,
    /// Freed and parked in a quick list for reuse at exactly its size: not merged with its
    /// neighbours and not indexed until the quick lists are flushed.
    Parked,
    /// Lent to a thread's cache (`thread_cache`), which says whether it is allocated or cached:
    /// not merged with its neighbours and not indexed until it comes back.
    Lent,
}

#[derive(Clone, Debug)]
pub(crate) struct Block {
    pub addr: u64,
    pub size: u64,
    /// Bytes the caller asked for (allocated blocks only).
    pub requested: u64,
    pub seg: SegId,
    pub prev: Option<BlockId>,
    pub next: Option<BlockId>,
    pub state: BlockState,
    /// Whether physical memory backs the block (always true in fixed segments).
    pub mapped: bool,
    pub stream: StreamId,
    pub pool: PoolKind,
    /// Streams other than `stream` that used the block (`record_stream`).
    pub other_streams: Vec<StreamId>,
    /// The allocation's number, unique over the allocator's life (set when the block is handed
    /// out; 0 while free), so that a stale handle never matches a later allocation.
    pub generation: u64,
    /// While `Lent`: the cache's index and the slot in it.
    pub lent_to: (u32, u32),
}

impl Block {
    pub fn end(&self) -> u64 {
        self.addr + self.size
    }
    pub fn is_free(&self) -> bool {
        self.state == BlockState::Free
    }
}

/// A slab of `T` with reusable slots, addressed by `u32`.
#[derive(Debug)]
pub(crate) struct Arena<T> {
    items: Vec<Option<T>>,
    vacant: Vec<u32>,
}

impl<T> Default for Arena<T> {
    fn default() -> Self {
        Self {
            items: Vec::new(),
            vacant: Vec::new(),
        }
    }
}

impl<T> Arena<T> {
    pub fn insert(&mut self, t: T) -> u32 {
        if let Some(i) = self.vacant.pop() {
            self.items[i as usize] = Some(t);
            i
        } else {
            self.items.push(Some(t));
            (self.items.len() - 1) as u32
        }
    }
    pub fn remove(&mut self, i: u32) -> T {
        let t = self.items[i as usize].take().expect("arena slot is live");
        self.vacant.push(i);
        t
    }
    #[inline]
    pub fn get(&self, i: u32) -> Option<&T> {
        self.items.get(i as usize).and_then(Option::as_ref)
    }
    pub fn iter(&self) -> impl Iterator<Item = (u32, &T)> {
        self.items
            .iter()
            .enumerate()
            .filter_map(|(i, t)| t.as_ref().map(|t| (i as u32, t)))
    }
    pub fn len(&self) -> usize {
        self.items.len() - self.vacant.len()
    }
}

impl<T> std::ops::Index<u32> for Arena<T> {
    type Output = T;
    #[inline]
    fn index(&self, i: u32) -> &T {
        self.items[i as usize].as_ref().expect("arena slot is live")
    }
}

impl<T> std::ops::IndexMut<u32> for Arena<T> {
    #[inline]
    fn index_mut(&mut self, i: u32) -> &mut T {
        self.items[i as usize].as_mut().expect("arena slot is live")
    }
}
