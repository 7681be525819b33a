//! Static layouts of a repeating step: one offset for every block of the step, fixed across
//! steps, such that no two blocks live at the same time overlap. The layout's height is the
//! memory a loop of that step needs when no page ever moves: a step settles at a capacity only
//! if some layout fits under it. Finding the lowest layout is NP-hard (dynamic storage
//! allocation); [`plan_static_layout`] searches greedy placements over block orders, as offline
//! memory planners do (largest first, then randomised orders).
//!
//! Used to tell whether a loop at the edge of memory can settle at all
//! (`oomguard layout TRACE`): peak live bytes is a lower bound of every layout; the height found
//! is an upper bound of the best one.

/// One block of a step: live from event `start` (inclusive) to event `end` (exclusive),
/// `bytes` long.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LifeSpan {
    /// The event at which the block is allocated.
    pub start: usize,
    /// The event at which it is freed (`start < end`; a block live to the step's end ends
    /// after the step's last event).
    pub end: usize,
    /// Its size in bytes.
    pub bytes: u64,
}

impl LifeSpan {
    fn overlaps_in_time(&self, o: &LifeSpan) -> bool {
        self.start < o.end && o.start < self.end
    }
}

/// Where each block of a step sits: `offsets[i]` for `spans[i]`, and the highest byte used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StaticLayout {
    /// The offset of each block, in the order of the spans given.
    pub offsets: Vec<u64>,
    /// The end of the highest block: the memory the layout needs.
    pub height: u64,
    /// Block orders tried to find it.
    pub tries: u32,
}

impl StaticLayout {
    /// The first two blocks that are live at the same time and overlap in memory, if any (a
    /// layout from [`plan_static_layout`] has none).
    pub fn conflict(&self, spans: &[LifeSpan]) -> Option<(usize, usize)> {
        for i in 0..spans.len() {
            for j in i + 1..spans.len() {
                let (a, b) = (&spans[i], &spans[j]);
                let (oa, ob) = (self.offsets[i], self.offsets[j]);
                if a.overlaps_in_time(b) && oa < ob + b.bytes && ob < oa + a.bytes {
                    return Some((i, j));
                }
            }
        }
        None
    }
}

/// The most bytes live at once: a lower bound of every layout's height.
pub fn peak_live(spans: &[LifeSpan]) -> u64 {
    let mut events: Vec<(usize, bool, u64)> = spans
        .iter()
        .flat_map(|s| [(s.start, true, s.bytes), (s.end, false, s.bytes)])
        .collect();
    // frees before allocations at the same event: a block freed at `e` and one made at `e` do
    // not live at once
    events.sort_unstable_by_key(|&(at, alloc, _)| (at, alloc));
    let (mut live, mut peak) = (0u64, 0u64);
    for (_, alloc, bytes) in events {
        if alloc {
            live = live.saturating_add(bytes);
            peak = peak.max(live);
        } else {
            live = live.saturating_sub(bytes);
        }
    }
    peak
}

/// The lowest static layout found over `tries` block orders (at least one): largest first,
/// then orders by size scaled by a seeded random factor in [0.7, 1.3). Each order places every
/// block at the lowest offset where it overlaps no block already placed that is live at the
/// same time. Deterministic for a given `seed`. Stops early when a layout reaches
/// [`peak_live`] (no layout is lower).
pub fn plan_static_layout(spans: &[LifeSpan], tries: u32, seed: u64) -> StaticLayout {
    let floor = peak_live(spans);
    let mut order: Vec<usize> = (0..spans.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(spans[i].bytes), spans[i].start));
    let mut best = place(spans, &order);
    let mut tried = 1;
    let mut rng = seed | 1;
    let mut keys: Vec<(f64, usize)> = Vec::with_capacity(spans.len());
    while tried < tries.max(1) && best.1 > floor {
        keys.clear();
        keys.extend(spans.iter().enumerate().map(|(i, s)| {
            rng = xorshift(rng);
            let jitter = 0.7 + 0.6 * (rng >> 11) as f64 / (1u64 << 53) as f64;
            (-(s.bytes as f64) * jitter, i)
        }));
        keys.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        order.clear();
        order.extend(keys.iter().map(|&(_, i)| i));
        let layout = place(spans, &order);
        if layout.1 < best.1 {
            best = layout;
        }
        tried += 1;
    }
    StaticLayout {
        offsets: best.0,
        height: best.1,
        tries: tried,
    }
}

/// Greedy placement in `order`: each block at the lowest offset clear of the blocks placed
/// before it that live at the same time. Returns the offsets and the height.
fn place(spans: &[LifeSpan], order: &[usize]) -> (Vec<u64>, u64) {
    let mut offsets = vec![0u64; spans.len()];
    let mut placed: Vec<usize> = Vec::with_capacity(spans.len());
    let mut busy: Vec<(u64, u64)> = Vec::new();
    let mut height = 0u64;
    for &i in order {
        let s = &spans[i];
        busy.clear();
        busy.extend(
            placed
                .iter()
                .filter(|&&j| spans[j].overlaps_in_time(s))
                .map(|&j| (offsets[j], offsets[j].saturating_add(spans[j].bytes))),
        );
        busy.sort_unstable();
        let mut at = 0u64;
        for &(lo, hi) in &busy {
            if at.saturating_add(s.bytes) <= lo {
                break;
            }
            at = at.max(hi);
        }
        offsets[i] = at;
        height = height.max(at.saturating_add(s.bytes));
        placed.push(i);
    }
    (offsets, height)
}

fn xorshift(mut x: u64) -> u64 {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    x
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(start: usize, end: usize, bytes: u64) -> LifeSpan {
        LifeSpan { start, end, bytes }
    }

    #[test]
    fn blocks_apart_in_time_share_memory() {
        let spans = [span(0, 2, 100), span(2, 4, 100), span(4, 6, 60)];
        let l = plan_static_layout(&spans, 1, 1);
        assert_eq!(l.height, 100);
        assert_eq!(peak_live(&spans), 100);
        assert_eq!(l.conflict(&spans), None);
    }

    #[test]
    fn blocks_live_together_stack() {
        let spans = [span(0, 4, 100), span(1, 3, 50), span(2, 5, 30)];
        let l = plan_static_layout(&spans, 1, 1);
        assert_eq!(l.height, 180);
        assert_eq!(l.conflict(&spans), None);
    }

    #[test]
    fn the_search_is_never_worse_than_largest_first() {
        let spans = [
            span(0, 2, 40),
            span(1, 3, 30),
            span(2, 4, 30),
            span(3, 5, 40),
            span(0, 5, 10),
        ];
        let first = plan_static_layout(&spans, 1, 7);
        let searched = plan_static_layout(&spans, 200, 7);
        assert!(searched.height <= first.height);
        assert!(searched.height >= peak_live(&spans));
        assert_eq!(searched.conflict(&spans), None);
        assert_eq!(first.conflict(&spans), None);
    }

    #[test]
    fn random_steps_get_valid_layouts_between_the_bounds() {
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..50 {
            let mut spans = Vec::new();
            for _ in 0..40 {
                rng = xorshift(rng);
                let start = (rng % 100) as usize;
                rng = xorshift(rng);
                let len = 1 + (rng % 30) as usize;
                rng = xorshift(rng);
                spans.push(span(start, start + len, 512 * (1 + rng % 64)));
            }
            let l = plan_static_layout(&spans, 20, rng);
            assert_eq!(l.conflict(&spans), None);
            assert!(l.height >= peak_live(&spans));
            assert!(l.height <= spans.iter().map(|s| s.bytes).sum::<u64>());
        }
    }

    #[test]
    fn no_blocks_no_height() {
        let l = plan_static_layout(&[], 10, 1);
        assert_eq!((l.height, l.offsets.len()), (0, 0));
        assert_eq!(peak_live(&[]), 0);
    }
}
