//! Peaks of the statistics thread caches change, in multi-thread mode.
//!
//! A statistic's true value is the shared state's value plus every cache's delta (see
//! `thread_cache`). Caches move their deltas without the shared lock, so the true value's
//! highest point is not seen as it happens; it is bounded from what is seen.
//!
//! - *Sync*: under the shared lock and a cache's lock, the cache's delta moves into the shared
//!   value, once (a block lent earlier and freed through the shared state is then subtracted
//!   from the shared value: nothing is counted twice). Between two syncs of a cache, its
//!   *window*, the cache keeps the highest its delta reached, and the shared value its highest
//!   (`Stat::peak`, restarted at every sync). A window's true peak is at most the sum of the
//!   two highs, and exactly that when only one of them moved in it.
//! - The calling thread's cache is synced before and after every locked operation that
//!   changes the shared statistics on its behalf (a slow allocation, up to the lend; a free
//!   through the shared state; a drain), and every cache before and after operations made on
//!   behalf of none (`empty_cache`, a free of a block the shared state handed out): with one
//!   thread allocating and freeing, the shared value and its cache never move in one window.
//! - *Fold* (every read of the statistics): every cache synced; the interval's peak is the
//!   highest window sum when one cache was active since the last fold (exact for one thread;
//!   never below the true peak: every moment lies in one window of that cache), otherwise the
//!   shared value's highest plus each cache's highest delta (never below the true peak,
//!   possibly above it; reads cap it at the reserved peak of its pool, which no true value
//!   passes).
//! - Allocated bytes of all pools are also counted in one order ([`LiveBytes`]): their peak,
//!   the figure every budget, leak check and report reads, is exact with any number of threads.

use super::live_bytes::LiveBytes;
use super::stats::{MemoryStats, Stat};
use super::thread_cache::{cache_stats_mut, CacheState, Delta, CACHE_STATS};

/// Which caches had windows since the last fold (their deltas moved, or their thread's
/// operation changed the shared statistics).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Active {
    None,
    /// One cache, by index.
    One(u32),
    Many,
}

/// The peak bookkeeping of the statistics caches change (in the allocator's state).
#[derive(Debug)]
pub(crate) struct Peaks {
    /// The peak of each statistic as of the last fold (reported peaks never go below it until
    /// a reset).
    floor: [u64; CACHE_STATS],
    /// One cache active: the highest (shared high + delta high) over its windows since the
    /// last fold.
    solo: [u64; CACHE_STATS],
    /// The shared value's highest since the last fold, over every window.
    shared: [u64; CACHE_STATS],
    active: Active,
}

impl Default for Peaks {
    fn default() -> Self {
        Self {
            floor: [0; CACHE_STATS],
            solo: [0; CACHE_STATS],
            shared: [0; CACHE_STATS],
            active: Active::None,
        }
    }
}

impl Peaks {
    /// Moves cache `index`'s deltas into `stats` and starts a new window for it (the caller
    /// holds the shared lock and the cache's). `own`: the cache of the calling thread, whose
    /// locked operation is about to change (or has just changed) the shared statistics; its
    /// window is closed even when its deltas did not move, so that the shared changes of the
    /// operation do not share a window with the deltas' later moves. Any other cache whose
    /// deltas did not move is left alone.
    pub fn sync(&mut self, stats: &mut MemoryStats, index: u32, cs: &mut CacheState, own: bool) {
        let changed = cs.stats.changed();
        self.active = match self.active {
            Active::None if changed || own => Active::One(index),
            Active::One(i) if i == index && (changed || own) => Active::One(i),
            _ if changed => Active::Many,
            // another cache's window is open (or several): closing none keeps every bound
            _ => return,
        };
        for (k, s) in cache_stats_mut(stats).into_iter().enumerate() {
            let d = std::mem::take(&mut cs.stats.0[k]);
            // `max` starts at 0 in every window: never negative
            let high = d.max as u64;
            self.solo[k] = self.solo[k].max(s.peak.saturating_add(high));
            self.shared[k] = self.shared[k].max(s.peak);
            cs.highs[k] = cs.highs[k].max(high);
            apply(s, &d);
        }
    }

    /// Syncs every cache (all locked by the caller, the shared lock held) and records the peak
    /// of the interval since the last fold; a new interval starts.
    pub fn fold(&mut self, stats: &mut MemoryStats, caches: &mut [(u32, &mut CacheState)]) {
        for (index, cs) in caches.iter_mut() {
            self.sync(stats, *index, cs, false);
        }
        for (k, s) in cache_stats_mut(stats).into_iter().enumerate() {
            let high = match self.active {
                Active::Many => {
                    let deltas: u64 = caches.iter().map(|(_, c)| c.highs[k]).sum();
                    self.shared[k].max(s.peak).saturating_add(deltas)
                }
                Active::One(_) | Active::None => self.solo[k].max(s.peak),
            };
            self.floor[k] = self.floor[k].max(high);
            s.peak = s.current;
        }
        for (_, c) in caches.iter_mut() {
            c.highs = [0; CACHE_STATS];
        }
        self.solo = [0; CACHE_STATS];
        self.shared = [0; CACHE_STATS];
        self.active = Active::None;
    }

    /// Raises the peaks of `s` (a copy of the statistics, just folded) to the floors; in
    /// multi-thread mode (`live`), the allocated bytes' peak is the exact one, and the peaks
    /// that remain bounds are capped by the reserved peak of their pool (every moment's true
    /// value is at most what was reserved then, so the cap keeps them bounds).
    pub fn apply_floors(&self, s: &mut MemoryStats, live: Option<&LiveBytes>) {
        for (stat, floor) in cache_stats_mut(s).into_iter().zip(self.floor) {
            stat.peak = stat.peak.max(floor);
        }
        let Some(live) = live else { return };
        s.allocated_bytes.all.peak = live.peak().max(s.allocated_bytes.all.current);
        let reserved = s.reserved_bytes;
        let exact = s.allocated_bytes.all.peak;
        for stat in [
            &mut s.allocated_bytes,
            &mut s.active_bytes,
            &mut s.requested_bytes,
        ] {
            stat.all.peak = stat.all.peak.min(reserved.all.peak).max(stat.all.current);
            stat.small.peak = stat
                .small
                .peak
                .min(reserved.small.peak)
                .max(stat.small.current);
            stat.large.peak = stat
                .large
                .peak
                .min(reserved.large.peak)
                .max(stat.large.current);
        }
        // requested bytes never exceed the blocks that hold them
        s.requested_bytes.all.peak = s
            .requested_bytes
            .all
            .peak
            .min(exact)
            .max(s.requested_bytes.all.current);
    }

    /// Forgets every peak (after a fold: the statistics' own peaks reset to their values).
    pub fn reset(&mut self) {
        self.floor = [0; CACHE_STATS];
    }
}

/// Adds a cache's delta to a shared statistic (the window's high is recorded by the caller;
/// the shared high restarts from the new value).
fn apply(s: &mut Stat, d: &Delta) {
    // A sum of live counts: never negative (the shared value holds every block moved back to
    // it, and a cache's positive delta counts only blocks it holds).
    s.current = (s.current as i64 + d.cur) as u64;
    s.allocated = s.allocated.wrapping_add(d.allocated);
    s.freed = s.freed.wrapping_add(d.freed);
    s.peak = s.current;
}
