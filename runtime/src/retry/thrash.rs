//! Thrash detection: a step that succeeds only because the allocator freed its whole cache and
//! retried (`num_alloc_retries` rose) is one allocation away from a hard OOM, and slow (every
//! retry synchronizes the device and re-maps memory). After `window` such steps in a row the
//! engine moves to the next smaller plan pre-emptively, as Composer does.

/// Counts consecutive thrashing steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ThrashDetector {
    window: u32,
}

impl ThrashDetector {
    /// Trips after `window` consecutive thrashing steps (`window` of 0 is treated as 1).
    pub fn new(window: u32) -> Self {
        Self {
            window: window.max(1),
        }
    }

    /// Steps in a row that trip it.
    pub fn window(&self) -> u32 {
        self.window
    }

    /// Records one successful step into `streak`; `retries_before`/`retries_after` are the
    /// allocator's `num_alloc_retries` around the step. Returns `true` (and resets the streak)
    /// when the engine should move to a smaller plan.
    pub fn observe(&self, streak: &mut u32, retries_before: u64, retries_after: u64) -> bool {
        if retries_after > retries_before {
            *streak += 1;
        } else {
            *streak = 0;
        }
        if *streak >= self.window {
            *streak = 0;
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trips_after_window_consecutive() {
        let d = ThrashDetector::new(3);
        let mut s = 0;
        assert!(!d.observe(&mut s, 0, 1));
        assert!(!d.observe(&mut s, 1, 2));
        assert!(!d.observe(&mut s, 2, 2), "a clean step resets");
        assert!(!d.observe(&mut s, 2, 3));
        assert!(!d.observe(&mut s, 3, 4));
        assert!(d.observe(&mut s, 4, 5));
        assert_eq!(s, 0);
        assert_eq!(ThrashDetector::new(0).window(), 1);
    }
}
