//! Where physical handles larger than a page lie: runs of equal handles, one entry per map,
//! so that mapping a huge range costs one entry, not one per handle.
//!
//! A handle is unmapped whole or not at all (`cuMemUnmap` takes exactly what one `cuMemMap`
//! mapped), so whoever unmaps needs to know where handles begin and end.

use std::collections::BTreeMap;

/// Runs of physical handles: start -> (end, bytes of each handle). Runs do not overlap.
#[derive(Clone, Debug, Default)]
pub struct HandleRuns {
    runs: BTreeMap<u64, (u64, u64)>,
}

impl HandleRuns {
    /// Notes the whole handles of `handle` bytes that a map of `bytes` at `start` puts first:
    /// `bytes / handle` of them (none when `handle` is 0).
    pub fn insert(&mut self, start: u64, bytes: u64, handle: u64) {
        let n = bytes.checked_div(handle).unwrap_or(0);
        if n > 0 {
            self.runs.insert(start, (start + n * handle, handle));
        }
    }

    /// The run whose handles `x` falls strictly inside: (the run's start, the handle's bytes).
    fn cutting(&self, x: u64) -> Option<(u64, u64)> {
        self.runs
            .range(..x)
            .next_back()
            .filter(|&(&s, &(e, h))| x < e && (x - s) % h != 0)
            .map(|(&s, &(_, h))| (s, h))
    }

    /// Whether `x` falls inside a handle (not on its edge).
    pub fn cuts(&self, x: u64) -> bool {
        self.cutting(x).is_some()
    }

    /// The part of `[lo, hi)` that whole handles and pages cover: shrunk past the handles that
    /// reach out of it (empty, `(lo, lo)`, when no whole handle or page is left).
    pub fn inward(&self, lo: u64, hi: u64) -> (u64, u64) {
        let start = lo;
        let lo = self
            .cutting(lo)
            .map_or(lo, |(s, h)| s + (lo - s).div_ceil(h) * h);
        let hi = self.cutting(hi).map_or(hi, |(s, h)| s + (hi - s) / h * h);
        if hi <= lo {
            return (start, start); // inside one handle, or an empty range
        }
        (lo, hi)
    }

    /// Forgets the handles inside `[lo, hi)`, which cuts none (see [`HandleRuns::inward`]).
    pub fn remove(&mut self, lo: u64, hi: u64) {
        if hi <= lo {
            return;
        }
        let touched: Vec<(u64, (u64, u64))> = self
            .runs
            .range(..hi)
            .rev()
            .take_while(|(_, &(e, _))| e > lo)
            .map(|(&s, &r)| (s, r))
            .collect();
        for (s, (e, h)) in touched {
            self.runs.remove(&s);
            if s < lo {
                self.runs.insert(s, (lo, h));
            }
            if e > hi {
                self.runs.insert(hi, (e, h));
            }
        }
    }

    /// The runs: `(start, end, bytes of each handle)`, by address.
    pub fn runs(&self) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        self.runs.iter().map(|(&s, &(e, h))| (s, e, h))
    }

    /// Handles noted now.
    #[cfg(test)]
    pub fn count(&self) -> u64 {
        self.runs.iter().map(|(&s, &(e, h))| (e - s) / h).sum()
    }
}

/// PyTorch's expandable segments back the large pool with handles of this size
/// (`kLargeBuffer`); oomguard's maps do too, on a device of at least [`HANDLE_SHARE`] times it.
pub const LARGE_HANDLE: u64 = 20 << 20;

/// A handle is at most this share of the memory the allocator may use when it reserves the
/// range (the device's capacity, or the memory limit then; 1/2048): a free run gives back only
/// whole handles, so each one it cuts holds back at most 0.05 % of it. On a card of
/// 40 GiB and more that is [`LARGE_HANDLE`]; on a small simulated device, pages.
pub const HANDLE_SHARE: u64 = 2048;

/// The handle size for maps on a device whose pages are `page` bytes, where the allocator may
/// use `cap` bytes: [`LARGE_HANDLE`], or `cap / HANDLE_SHARE` when smaller, in whole pages (a page,
/// when that is less than two).
pub fn handle_size(page: u64, cap: u64) -> u64 {
    let h = LARGE_HANDLE.min(cap / HANDLE_SHARE);
    match h.checked_div(page) {
        Some(n) if n >= 2 => n * page,
        _ => page,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const M: u64 = 1 << 20;

    #[test]
    fn inward_stops_at_handle_edges_and_remove_splits_runs() {
        let mut r = HandleRuns::default();
        r.insert(100 * M, 70 * M, 20 * M); // handles at 100, 120, 140; 10 MiB of pages after
        assert_eq!(r.count(), 3);
        assert!(r.cuts(110 * M) && !r.cuts(120 * M) && !r.cuts(160 * M) && !r.cuts(165 * M));
        assert_eq!(r.inward(102 * M, 170 * M), (120 * M, 170 * M));
        assert_eq!(r.inward(100 * M, 150 * M), (100 * M, 140 * M));
        assert_eq!(
            r.inward(104 * M, 118 * M),
            (104 * M, 104 * M),
            "inside one handle: empty"
        );
        r.remove(120 * M, 140 * M);
        assert_eq!(r.count(), 2);
        assert_eq!(r.inward(100 * M, 150 * M), (100 * M, 140 * M));
        assert_eq!(r.inward(110 * M, 130 * M), (120 * M, 130 * M));
        r.remove(100 * M, 160 * M);
        assert_eq!(r.count(), 0);
        assert_eq!(r.inward(101 * M, 159 * M), (101 * M, 159 * M));
    }

    #[test]
    fn handles_are_20_mib_on_a_large_card_and_pages_on_a_small_one() {
        assert_eq!(handle_size(2 * M, 80 << 30), 20 * M);
        assert_eq!(handle_size(2 * M, u64::MAX), 20 * M);
        assert_eq!(handle_size(2 * M, 16 << 30), 8 * M);
        assert_eq!(handle_size(2 * M, 842 * M), 2 * M);
        assert_eq!(handle_size(0, 80 << 30), 0);
        assert_eq!(handle_size(1 << 30, 80 << 30), 1 << 30);
    }

    proptest::proptest! {
        /// Against a model that lists every handle: maps of 0–99 pages at page-aligned places
        /// (skipped where they overlap), then unmaps of `inward` ranges. `inward` never cuts a
        /// handle and keeps every handle inside the range; `remove` forgets exactly those.
        #[test]
        fn inward_and_remove_agree_with_a_list_of_handles(
            ops in proptest::collection::vec((0u64..400, 0u64..100, 1u64..12, proptest::bool::ANY), 1..60)
        ) {
            let page = 2 * M;
            let mut runs = HandleRuns::default();
            let mut model: std::collections::BTreeMap<u64, u64> = Default::default();
            let mut mapped: Vec<(u64, u64)> = Vec::new();
            for (at, pages, h, unmap) in ops {
                let (lo, hi) = (at * page, (at + pages) * page);
                if !unmap {
                    let handle = h * page;
                    if pages == 0 || mapped.iter().any(|&(a, b)| lo < b && a < hi) {
                        continue;
                    }
                    mapped.push((lo, hi));
                    runs.insert(lo, hi - lo, handle);
                    for i in 0..(hi - lo) / handle {
                        model.insert(lo + i * handle, handle);
                    }
                    continue;
                }
                let (a, b) = runs.inward(lo, hi);
                proptest::prop_assert!(lo <= a && a <= b && b <= hi.max(lo));
                proptest::prop_assert!(a == b || (!runs.cuts(a) && !runs.cuts(b)));
                // every handle wholly inside [lo, hi) is inside [a, b)
                for (&s, &n) in &model {
                    if lo <= s && s + n <= hi {
                        proptest::prop_assert!(a <= s && s + n <= b, "{s:#x}+{n:#x} outside");
                    }
                }
                runs.remove(a, b);
                model.retain(|&s, &mut n| !(a <= s && s + n <= b));
                proptest::prop_assert_eq!(runs.count(), model.len() as u64);
                mapped.retain(|&(x, y)| !(a <= x && y <= b));
            }
        }
    }

    #[test]
    fn a_huge_map_is_one_entry() {
        let mut r = HandleRuns::default();
        r.insert(0, 1 << 60, 20 * M);
        assert_eq!(r.count(), (1 << 60) / (20 * M));
        assert_eq!(r.runs.len(), 1);
        r.insert(1 << 61, 19 * M, 20 * M); // smaller than a handle: nothing
        assert_eq!(r.runs.len(), 1);
    }
}
