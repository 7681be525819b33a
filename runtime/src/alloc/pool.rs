//! Pools: the free-block index (best fit by stream, size, address) and PyTorch's size classes.

use std::collections::BTreeSet;

use super::block::{BlockId, PoolKind};
use crate::backend::StreamId;
use crate::config::AllocatorConfig;
use crate::error::ONE_EXABYTE;

/// Every block size is a multiple of this.
pub const MIN_BLOCK: u64 = 512;
/// Requests up to this size go to the small pool.
pub const SMALL_SIZE: u64 = 1 << 20;
/// Segment size of the small pool.
pub const SMALL_SEGMENT: u64 = 2 << 20;
/// Requests below this size in the large pool share 20 MiB segments.
pub const MIN_LARGE_ALLOC: u64 = 10 << 20;
/// Segment size for large requests below [`MIN_LARGE_ALLOC`].
pub const LARGE_SEGMENT: u64 = 20 << 20;
/// Larger requests get segments rounded up to this.
pub const ROUND_LARGE: u64 = 2 << 20;

/// Free blocks of one pool, ordered by (stream, size, address) so that the first entry at or
/// after `(stream, size, 0)` is the best fit.
#[derive(Debug, Default)]
pub(crate) struct FreeIndex {
    set: BTreeSet<(StreamId, u64, u64, BlockId)>,
    /// The page size of growable segments (0: count every block below).
    page: u64,
    /// Free blocks that hold at least one whole page: while none does, releasing pages has
    /// nothing to look for (without it, every new high-water mark scanned every free block:
    /// quadratic with one segment per stream).
    with_pages: usize,
    /// Changes on every insert and remove: scans over the index are remembered against it.
    version: u64,
    /// Entries visited by whole-index scans ([`FreeIndex::ids`], [`FreeIndex::largest`]): a
    /// count, not a clock, for tests that a path does not rescan every free block.
    scanned: std::cell::Cell<u64>,
    /// The largest free size and how many free blocks have it, kept on insert and remove; `None`
    /// once the last block of that size left (the next [`FreeIndex::largest`] scans). Without
    /// it, statistics read at every event (`oomguard plot`) scanned every free block each time.
    largest: std::cell::Cell<Option<(u64, usize)>>,
}

impl FreeIndex {
    /// An index counting the free blocks that hold a whole page of `page` bytes.
    pub fn with_page(page: u64) -> Self {
        Self {
            page,
            ..Self::default()
        }
    }
    #[inline]
    fn holds_a_page(&self, size: u64, addr: u64) -> bool {
        // `size < page` first: most blocks are smaller than a page, and it spares a division
        self.page == 0
            || size >= self.page
                && addr
                    .checked_next_multiple_of(self.page)
                    .and_then(|start| start.checked_add(self.page))
                    .is_some_and(|end| end <= addr.saturating_add(size))
    }
    #[inline]
    pub fn insert(&mut self, stream: StreamId, size: u64, addr: u64, id: BlockId) {
        let fresh = self.set.insert((stream, size, addr, id));
        debug_assert!(fresh, "block {id} was already free-listed");
        self.version = self.version.wrapping_add(1);
        if let Some((max, n)) = self.largest.get() {
            if size > max {
                self.largest.set(Some((size, 1)));
            } else if size == max {
                self.largest.set(Some((max, n + 1)));
            }
        }
        if fresh && self.holds_a_page(size, addr) {
            self.with_pages += 1;
        }
    }
    #[inline]
    pub fn remove(&mut self, stream: StreamId, size: u64, addr: u64, id: BlockId) {
        let was = self.set.remove(&(stream, size, addr, id));
        debug_assert!(was, "block {id} was not free-listed");
        self.version = self.version.wrapping_add(1);
        if let Some((max, n)) = self.largest.get() {
            if was && size == max {
                self.largest.set((n > 1).then_some((max, n - 1)));
            }
        }
        if was && self.holds_a_page(size, addr) {
            self.with_pages -= 1;
        }
    }
    /// A number that changes whenever a block is inserted or removed.
    pub fn version(&self) -> u64 {
        self.version
    }
    /// Whether some free block holds a whole page (see [`FreeIndex::with_page`]).
    pub fn any_whole_page(&self) -> bool {
        self.with_pages > 0
    }
    /// The smallest free block on `stream` of at least `size` bytes (lowest address on ties).
    #[inline]
    pub fn best_fit(&self, stream: StreamId, size: u64) -> Option<(u64, BlockId)> {
        self.fits(stream, size).next()
    }
    /// The free blocks on `stream` of at least `size` bytes, smallest first (lowest address on
    /// ties): [`FreeIndex::best_fit`] and the ones after it, as (size, id).
    #[inline]
    pub fn fits(&self, stream: StreamId, size: u64) -> impl Iterator<Item = (u64, BlockId)> + '_ {
        self.set
            .range((stream, size, 0, 0)..(stream, u64::MAX, u64::MAX, BlockId::MAX))
            .map(|&(_, s, _, id)| (s, id))
    }
    pub fn contains(&self, stream: StreamId, size: u64, addr: u64, id: BlockId) -> bool {
        self.set.contains(&(stream, size, addr, id))
    }
    pub fn largest(&self) -> u64 {
        if let Some((max, _)) = self.largest.get() {
            return max;
        }
        self.scanned
            .set(self.scanned.get().wrapping_add(self.set.len() as u64));
        let (max, n) = self.scan_largest();
        self.largest.set(Some((max, n)));
        max
    }
    /// The largest free size and how many free blocks have it, by a scan of every block.
    fn scan_largest(&self) -> (u64, usize) {
        self.set
            .iter()
            .fold((0, 0), |(max, n), e| match e.1.cmp(&max) {
                std::cmp::Ordering::Greater => (e.1, 1),
                std::cmp::Ordering::Equal => (max, n + 1),
                std::cmp::Ordering::Less => (max, n),
            })
    }
    /// Whether the kept largest size and its count (when known) are the index's.
    pub fn check_largest(&self) -> Result<(), String> {
        let Some((max, n)) = self.largest.get() else {
            return Ok(());
        };
        let (true_max, true_n) = self.scan_largest();
        if (max, n) != (true_max, true_n) {
            return Err(format!(
                "the free index keeps {n} block(s) of {max} bytes as its largest; it has \
                 {true_n} of {true_max}"
            ));
        }
        Ok(())
    }
    /// Every free block's id (a whole-index scan: counted in [`FreeIndex::scanned`]).
    pub fn ids(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.set.iter().map(|e| {
            self.scanned.set(self.scanned.get().wrapping_add(1));
            e.3
        })
    }
    /// Entries visited by whole-index scans so far.
    pub fn scanned(&self) -> u64 {
        self.scanned.get()
    }
    pub fn len(&self) -> usize {
        self.set.len()
    }
}

/// The pool a request of `size` (rounded) bytes goes to.
#[inline]
pub(crate) fn pool_for(size: u64) -> PoolKind {
    if size <= SMALL_SIZE {
        PoolKind::Small
    } else {
        PoolKind::Large
    }
}

/// Rounds a request as PyTorch does: to 512 bytes, or to the next power-of-two division when
/// `roundup_power2_divisions` asks for it. `None` for 1 EB or more, which PyTorch refuses (the
/// one test also keeps the rounding from overflowing).
#[inline]
pub(crate) fn round_size(size: u64, cfg: &AllocatorConfig) -> Option<u64> {
    if size <= MIN_BLOCK {
        return Some(MIN_BLOCK);
    }
    if size >= ONE_EXABYTE {
        return None;
    }
    let div = cfg.divisions_for(size);
    // saturating: a configured division count near 2^63 means "never" rather than an overflow
    if div > 1 && size > MIN_BLOCK.saturating_mul(div) {
        return Some(next_division(size, div).next_multiple_of(MIN_BLOCK));
    }
    Some(size.next_multiple_of(MIN_BLOCK))
}

/// Rounds `size` up to the next of `divisions` equal steps between two powers of two.
fn next_division(size: u64, divisions: u64) -> u64 {
    if size.is_power_of_two() {
        return size;
    }
    let floor = 1u64 << (63 - size.leading_zeros());
    let step = floor / divisions;
    if step == 0 {
        return floor.saturating_mul(2);
    }
    let down = size & !(step - 1);
    if down == size {
        size
    } else {
        down.saturating_add(step)
    }
}

/// Size of a fixed segment for a rounded request, as PyTorch: 2 MiB for the small pool, 20 MiB
/// for large requests under 10 MiB, otherwise the request rounded up to 2 MiB.
#[inline]
pub(crate) fn segment_size(size: u64) -> Option<u64> {
    if size <= SMALL_SIZE {
        Some(SMALL_SEGMENT)
    } else if size < MIN_LARGE_ALLOC {
        Some(LARGE_SEGMENT)
    } else {
        size.checked_next_multiple_of(ROUND_LARGE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_matches_pytorch() {
        let cfg = AllocatorConfig::default();
        assert_eq!(round_size(0, &cfg), Some(512));
        assert_eq!(round_size(1, &cfg), Some(512));
        assert_eq!(round_size(513, &cfg), Some(1024));
        assert_eq!(round_size(u64::MAX, &cfg), None);
        // 1 EB or more is refused (PyTorch's one_exa_bytes); just below rounds as usual
        assert_eq!(round_size(1 << 60, &cfg), None);
        assert_eq!(round_size((1 << 60) - 1, &cfg), Some(1 << 60));
        let cfg = AllocatorConfig::parse("roundup_power2_divisions:4").unwrap();
        // 1.1 GiB rounds to 1.25 GiB with 4 divisions
        assert_eq!(round_size(1_181_116_006, &cfg), Some(1_342_177_280));
        assert_eq!(round_size(1 << 30, &cfg), Some(1 << 30));
        // small sizes (<= 512 * divisions) keep plain rounding
        assert_eq!(round_size(1500, &cfg), Some(1536));
    }

    #[test]
    fn segment_sizes() {
        assert_eq!(segment_size(512), Some(2 << 20));
        assert_eq!(segment_size(3 << 20), Some(20 << 20));
        assert_eq!(segment_size((10 << 20) + 512), Some(12 << 20));
    }

    #[test]
    fn best_fit_prefers_smallest_then_lowest() {
        let mut f = FreeIndex::default();
        f.insert(0, 4096, 100, 1);
        f.insert(0, 2048, 300, 2);
        f.insert(0, 2048, 200, 3);
        f.insert(1, 1024, 0, 4);
        assert_eq!(f.best_fit(0, 1000), Some((2048, 3)));
        assert_eq!(f.best_fit(0, 3000), Some((4096, 1)));
        assert_eq!(f.best_fit(0, 5000), None);
        assert_eq!(f.best_fit(1, 1024), Some((1024, 4)));
        assert_eq!(f.best_fit(2, 1), None);
        f.remove(0, 2048, 200, 3);
        assert_eq!(f.best_fit(0, 1000), Some((2048, 2)));
    }
}
