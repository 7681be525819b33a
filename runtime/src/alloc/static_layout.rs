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
    /// The end of the highest block: the memory the layout needs; `u64::MAX` when that end is
    /// 2^64 or more. Past 2^64 the layout does not fit in 64-bit offsets: they saturate and
    /// blocks overlap ([`StaticLayout::conflict`] says which).
    pub height: u64,
    /// Block orders tried to find it.
    pub tries: u32,
}

impl StaticLayout {
    /// The first two blocks that are live at the same time and overlap in memory, if any (a
    /// layout from [`plan_static_layout`] has none, unless it does not fit in 64-bit offsets:
    /// see [`StaticLayout::height`]).
    pub fn conflict(&self, spans: &[LifeSpan]) -> Option<(usize, usize)> {
        for i in 0..spans.len() {
            for j in i + 1..spans.len() {
                let (a, b) = (&spans[i], &spans[j]);
                // in u128: a block may end at 2^64 (a top block of a valid layout)
                let (oa, ob) = (self.offsets[i] as u128, self.offsets[j] as u128);
                if a.overlaps_in_time(b) && oa < ob + b.bytes as u128 && ob < oa + a.bytes as u128 {
                    return Some((i, j));
                }
            }
        }
        None
    }
}

/// The most bytes live at once: a lower bound of every layout's height. A span that ends at
/// or before its start is live at no event and counts for nothing.
pub fn peak_live(spans: &[LifeSpan]) -> u64 {
    let mut events: Vec<(usize, bool, u64)> = spans
        .iter()
        .filter(|s| s.start < s.end)
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
/// [`peak_live`] (no layout is lower). Blocks live at once whose sizes add up past 2^64 have
/// no layout in 64-bit offsets: the height is then `u64::MAX` and blocks overlap (the CLI's
/// `layout` refuses such a step).
pub fn plan_static_layout(spans: &[LifeSpan], tries: u32, seed: u64) -> StaticLayout {
    plan_static_layout_within(spans, tries, seed, u64::MAX)
}

/// [`plan_static_layout`], starting no new order once the orders tried have cost `work` steps
/// (a step: a block tested against one placed before it, or one comparison sorting the blocks
/// in its way): a bound on the time whatever the step's shape, the same on every run. The
/// first order always runs; [`StaticLayout::tries`] says how many did.
pub fn plan_static_layout_within(
    spans: &[LifeSpan],
    tries: u32,
    seed: u64,
    work: u64,
) -> StaticLayout {
    let floor = peak_live(spans);
    let mut spent = 0u64;
    let mut order: Vec<usize> = (0..spans.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(spans[i].bytes), spans[i].start));
    // the first order tests every placed block: the lists pay off only over several orders
    let mut best = place(spans, &Together(None), &order, None, &mut spent)
        .expect("an order with nothing to beat is never dropped");
    let mut together = None;
    let mut tried = 1;
    let mut rng = seed | 1;
    let mut keys: Vec<(f64, usize)> = Vec::with_capacity(spans.len());
    while tried < tries.max(1) && best.1 > floor && spent < work {
        keys.clear();
        keys.extend(spans.iter().enumerate().map(|(i, s)| {
            rng = xorshift(rng);
            let jitter = 0.7 + 0.6 * (rng >> 11) as f64 / (1u64 << 53) as f64;
            (-(s.bytes as f64) * jitter, i)
        }));
        keys.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        order.clear();
        order.extend(keys.iter().map(|&(_, i)| i));
        let together = together.get_or_insert_with(|| Together::of(spans));
        if let Some(layout) = place(spans, together, &order, Some(best.1), &mut spent) {
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

/// Most pairs of blocks live at the same time that [`Together`] lists (8 bytes each); a step
/// with more is placed by testing every placed block instead.
const MAX_PAIRS: usize = 32 << 20;

/// For each block, the blocks live at the same time as it, listed once for all orders: a
/// placement then walks a block's own list instead of testing every block placed before it
/// (a step's blocks overlap in time in a quarter to two fifths of all pairs on the recorded
/// traces). `None` when there would be more than [`MAX_PAIRS`] pairs.
struct Together(Option<(Vec<usize>, Vec<u32>)>);

impl Together {
    fn of(spans: &[LifeSpan]) -> Self {
        let mut by_start: Vec<usize> = (0..spans.len()).collect();
        by_start.sort_by_key(|&i| spans[i].start);
        let starts: Vec<usize> = by_start.iter().map(|&i| spans[i].start).collect();
        // the blocks that start while `by_start[p]` is live, after it in start order: every pair
        // live at the same time is among these, once (the later start's block)
        let later = |p: usize| {
            let end = spans[by_start[p]].end;
            &by_start[p + 1..p + 1 + starts[p + 1..].partition_point(|&x| x < end)]
        };
        let candidates: usize = (0..by_start.len()).map(|p| later(p).len()).sum();
        if candidates > MAX_PAIRS || spans.len() > u32::MAX as usize {
            return Together(None);
        }
        // each pair in both directions, counted first, then written into each block's slice
        let for_each_pair = |each: &mut dyn FnMut(usize, usize)| {
            for (p, &i) in by_start.iter().enumerate() {
                for &j in later(p) {
                    if spans[i].overlaps_in_time(&spans[j]) {
                        each(i, j);
                        each(j, i);
                    }
                }
            }
        };
        let mut first = vec![0usize; spans.len() + 1];
        for_each_pair(&mut |i, _| first[i + 1] += 1);
        for i in 0..spans.len() {
            first[i + 1] += first[i];
        }
        let mut list = vec![0u32; first[spans.len()]];
        let mut next = first.clone();
        for_each_pair(&mut |i, j| {
            list[next[i]] = j as u32;
            next[i] += 1;
        });
        Together(Some((first, list)))
    }
}

/// Greedy placement in `order`: each block at the lowest offset clear of the blocks placed
/// before it that live at the same time. Returns the offsets and the height, or `None` as soon
/// as the height reaches `beat` (the order cannot give a lower layout: heights only grow;
/// `None`: never).
/// Adds its work to `spent` (see [`plan_static_layout_within`]).
fn place(
    spans: &[LifeSpan],
    together: &Together,
    order: &[usize],
    beat: Option<u64>,
    spent: &mut u64,
) -> Option<(Vec<u64>, u64)> {
    let mut offsets = vec![0u64; spans.len()];
    let mut is_placed = vec![false; spans.len()];
    let mut placed: Vec<usize> = Vec::with_capacity(spans.len());
    let mut busy: Vec<(u64, u64)> = Vec::new();
    let mut height = 0u64;
    for &i in order {
        let s = &spans[i];
        let extent = |j: usize| (offsets[j], offsets[j].saturating_add(spans[j].bytes));
        busy.clear();
        let tested = match &together.0 {
            Some((first, list)) => {
                let mine = &list[first[i]..first[i + 1]];
                busy.extend(
                    mine.iter()
                        .map(|&j| j as usize)
                        .filter(|&j| is_placed[j])
                        .map(extent),
                );
                mine.len()
            }
            None => {
                busy.extend(
                    placed
                        .iter()
                        .copied()
                        .filter(|&j| spans[j].overlaps_in_time(s))
                        .map(extent),
                );
                placed.len()
            }
        };
        let d = busy.len() as u64;
        *spent = spent
            .saturating_add(tested as u64)
            .saturating_add(d * u64::from(d.max(1).ilog2() + 1));
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
        if beat.is_some_and(|b| height >= b) {
            return None;
        }
        is_placed[i] = true;
        placed.push(i);
    }
    Some((offsets, height))
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

    /// `n` seeded spans: starts below `starts`, lengths in `lens`, 1 to `units` × 512 bytes.
    fn random_spans(
        rng: &mut u64,
        n: usize,
        starts: u64,
        lens: std::ops::Range<u64>,
        units: u64,
    ) -> Vec<LifeSpan> {
        let mut next = || {
            *rng = xorshift(*rng);
            *rng
        };
        (0..n)
            .map(|_| {
                let start = (next() % starts) as usize;
                let len = (lens.start + next() % (lens.end - lens.start)) as usize;
                span(start, start + len, 512 * (1 + next() % units))
            })
            .collect()
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

    /// Five blocks with staggered lifetimes.
    fn five_staggered() -> [LifeSpan; 5] {
        [
            span(0, 2, 40),
            span(1, 3, 30),
            span(2, 4, 30),
            span(3, 5, 40),
            span(0, 5, 10),
        ]
    }

    #[test]
    fn the_search_is_never_worse_than_largest_first() {
        let spans = five_staggered();
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
            let spans = random_spans(&mut rng, 40, 100, 1..31, 64);
            let l = plan_static_layout(&spans, 20, rng);
            assert_eq!(l.conflict(&spans), None);
            assert!(l.height >= peak_live(&spans));
            assert!(l.height <= spans.iter().map(|s| s.bytes).sum::<u64>());
        }
    }

    /// The blocks listed per block (`Together`) and the test of every placed block give the
    /// same layouts, and an order that cannot beat the best is dropped without changing it.
    #[test]
    fn listing_the_blocks_live_together_changes_no_layout() {
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..30 {
            // zero-length spans included
            let spans = random_spans(&mut rng, 60, 80, 0..25, 16);
            let order: Vec<usize> = (0..spans.len()).rev().collect();
            let (mut a, mut b) = (0, 0);
            let listed = place(&spans, &Together::of(&spans), &order, None, &mut a);
            let tested = place(&spans, &Together(None), &order, None, &mut b);
            assert_eq!(listed, tested);
            let height = listed.unwrap().1;
            assert_eq!(
                place(&spans, &Together::of(&spans), &order, Some(height), &mut a),
                None
            );
        }
    }

    /// The work bound stops new orders (the first always runs) and changes nothing when it is
    /// not reached.
    #[test]
    fn the_work_bound_stops_new_orders() {
        let spans = five_staggered();
        let first = plan_static_layout_within(&spans, 200, 7, 0);
        assert_eq!(first.tries, 1);
        assert_eq!(first, plan_static_layout(&spans, 1, 7));
        assert_eq!(
            plan_static_layout_within(&spans, 200, 7, u64::MAX),
            plan_static_layout(&spans, 200, 7)
        );
    }

    /// A height that saturates (a block of nearly 2^64 bytes) is the layout's, not dropped.
    #[test]
    fn a_saturated_height_is_kept() {
        let spans = [span(0, 2, u64::MAX), span(1, 3, 512)];
        let l = plan_static_layout(&spans, 5, 3);
        assert_eq!((l.height, l.offsets.len()), (u64::MAX, 2));
    }

    #[test]
    fn no_blocks_no_height() {
        let l = plan_static_layout(&[], 10, 1);
        assert_eq!((l.height, l.offsets.len()), (0, 0));
        assert_eq!(peak_live(&[]), 0);
    }
}
