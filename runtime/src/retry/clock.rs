//! The engine's clock: how long attempts take (reports, and the time per row that decides
//! between plans when the allocator thrashes). Injectable so that tests decide the times
//! instead of measuring them.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

/// A monotonic clock for the retry engine ([`RetryEngine::with_clock`](super::RetryEngine)).
#[doc(hidden)]
pub trait Clock: Send + Sync + fmt::Debug {
    /// Now; never earlier than a previous reading.
    fn now(&self) -> Instant;
}

/// The system's monotonic clock (the default).
#[doc(hidden)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// A clock that moves only when told ([`ManualClock::advance`]): for tests of what the engine
/// does with the times it measures, without measuring any.
#[doc(hidden)]
#[derive(Debug)]
pub struct ManualClock {
    origin: Instant,
    nanos: AtomicU64,
}

impl Default for ManualClock {
    fn default() -> Self {
        Self::new()
    }
}

impl ManualClock {
    /// A clock standing at an arbitrary origin.
    pub fn new() -> Self {
        Self {
            origin: Instant::now(),
            nanos: AtomicU64::new(0),
        }
    }

    /// Moves the clock `by` forward.
    pub fn advance(&self, by: Duration) {
        let n = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        self.nanos.fetch_add(n, Relaxed);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        self.origin + Duration::from_nanos(self.nanos.load(Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_when_told() {
        let c = ManualClock::new();
        let t0 = c.now();
        assert_eq!(c.now(), t0);
        c.advance(Duration::from_millis(7));
        assert_eq!(c.now() - t0, Duration::from_millis(7));
        let a = SystemClock.now();
        assert!(SystemClock.now() >= a);
    }
}
