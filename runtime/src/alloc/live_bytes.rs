//! The count of allocated bytes that every thread keeps in one order in multi-thread mode (see
//! `peaks` for the other statistics' peaks, and `thread_cache` for the caches that count here).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Allocated bytes of every pool, counted in one order by every thread in multi-thread mode, so
/// that their peak is exact there as it is on one thread: the figure budgets, leak checks, the
/// batch finder and every report read (`MemorySource::usage().used_peak`). Each change is made
/// inside the critical section that hands a block out or takes it back (a cache's lock or the
/// allocator's), so a block's bytes are uncounted before any thread can be handed them again:
/// the count never holds the same memory twice and so never passes reserved memory. Off (not
/// touched) in one-thread mode, where the statistics under the lock are exact already.
#[derive(Debug, Default)]
pub(crate) struct LiveBytes {
    current: Line,
    // on a line of its own: read on every count, written only when a new peak is reached
    peak: Line,
}

/// An atomic on a cache line (two, against adjacent-line prefetch) of its own.
#[derive(Debug, Default)]
#[repr(align(128))]
struct Line(AtomicU64);

impl std::ops::Deref for Line {
    type Target = AtomicU64;
    fn deref(&self) -> &AtomicU64 {
        &self.0
    }
}

impl LiveBytes {
    /// `bytes` handed out.
    #[inline]
    pub fn add(&self, bytes: u64) {
        let now = self.current.fetch_add(bytes, Relaxed).wrapping_add(bytes);
        // every value of the count is seen by the thread that made it: the peak is exact
        if now > self.peak.load(Relaxed) {
            self.peak.fetch_max(now, Relaxed);
        }
    }

    /// `bytes` taken back.
    #[inline]
    pub fn sub(&self, bytes: u64) {
        self.current.fetch_sub(bytes, Relaxed);
    }

    /// Starts counting from the (exact) one-thread figures (under the allocator's lock, before
    /// any cache exists).
    pub fn start(&self, current: u64, peak: u64) {
        self.current.store(current, Relaxed);
        self.peak.store(peak.max(current), Relaxed);
    }

    /// The peak since the start or the last reset.
    pub fn peak(&self) -> u64 {
        self.peak.load(Relaxed)
    }

    /// Restarts the peak from the present count.
    pub fn reset_peak(&self) {
        self.peak.store(self.current.load(Relaxed), Relaxed);
    }
}
