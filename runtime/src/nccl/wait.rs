//! Waiting for a collective without waiting forever: the calling thread polls the collective's
//! completion (a CUDA event recorded after it, NCCL's asynchronous error) and the liveness links,
//! and gives up with a one-line reason when a rank is reported gone (after a grace period, so a
//! collective that was about to complete still does) or when the timeout passes. The caller then
//! aborts the communicator (`ncclCommAbort`), which stops the kernels still waiting for the
//! missing rank.
//!
//! Polling instead of a blocking `cuStreamSynchronize` keeps the waiting thread free to give up,
//! so no second thread ever calls into a communicator that is in use.

use std::thread;
use std::time::{Duration, Instant};

/// The limits of one wait.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Limits {
    /// The longest a collective may take (from its launch).
    pub timeout: Duration,
    /// How long a collective may still take after a rank was reported gone.
    pub grace: Duration,
}

impl Limits {
    /// `timeout` with a grace of 2 s (at most the timeout).
    pub(crate) fn new(timeout: Duration) -> Self {
        Self {
            timeout,
            grace: timeout.min(Duration::from_secs(2)),
        }
    }
}

/// Polls `done` until it says the collective completed (`Ok(true)`), failed (`Err`), a rank has
/// been gone (`peer_gone`) for longer than the grace, or the timeout passed. The messages read
/// after the collective's name (`ncclAllReduce: aborted after ...`).
pub(crate) fn wait_collective(
    limits: Limits,
    mut done: impl FnMut() -> Result<bool, String>,
    peer_gone: impl Fn() -> Option<String>,
) -> Result<(), String> {
    let start = Instant::now();
    let mut gone_since: Option<Instant> = None;
    let mut polls: u32 = 0;
    loop {
        if done()? {
            return Ok(());
        }
        let now = Instant::now();
        if let Some(why) = peer_gone() {
            let since = *gone_since.get_or_insert(now);
            if now.duration_since(since) >= limits.grace {
                return Err(format!(
                    "aborted after {:.1} s: {why}",
                    now.duration_since(start).as_secs_f64()
                ));
            }
        }
        let waited = now.duration_since(start);
        if waited >= limits.timeout {
            return Err(format!(
                "did not complete within {:.1} s: another rank failed, hung or is that far behind \
                 (OOMGUARD_NCCL_TIMEOUT sets the limit)",
                limits.timeout.as_secs_f64()
            ));
        }
        // Yield for the first ~1000 polls (a collective on NVLink takes microseconds), then sleep
        // up to 1 ms between polls.
        polls = polls.saturating_add(1);
        if polls < 1000 {
            thread::yield_now();
        } else {
            let step = Duration::from_micros(u64::from(polls.min(2000) - 999));
            thread::sleep(step.min(limits.timeout - waited));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    fn limits(timeout_ms: u64, grace_ms: u64) -> Limits {
        Limits {
            timeout: Duration::from_millis(timeout_ms),
            grace: Duration::from_millis(grace_ms),
        }
    }

    /// A fake collective that completes once `at` has passed.
    fn completes_at(at: Instant) -> impl FnMut() -> Result<bool, String> {
        move || Ok(Instant::now() >= at)
    }

    #[test]
    fn a_collective_that_completes_is_waited_for() {
        let t0 = Instant::now();
        let r = wait_collective(
            limits(5_000, 1_000),
            completes_at(t0 + Duration::from_millis(50)),
            || None,
        );
        // Ok: it ended before the 5 s timeout (no upper clock: a loaded machine may be slow)
        assert_eq!(r, Ok(()));
        let took = t0.elapsed();
        assert!(took >= Duration::from_millis(50), "{took:?}");
    }

    #[test]
    fn a_collective_that_never_completes_times_out_in_bounded_time() {
        let t0 = Instant::now();
        let r = wait_collective(limits(300, 100), || Ok(false), || None);
        let took = t0.elapsed();
        let m = r.unwrap_err();
        assert!(m.starts_with("did not complete within 0.3 s"), "{m}");
        assert!(m.contains("OOMGUARD_NCCL_TIMEOUT"), "{m}");
        assert!(!m.contains('\n'));
        // at least the timeout; the upper bound is a hang guard only
        assert!(
            took >= Duration::from_millis(300) && took < Duration::from_secs(120),
            "{took:?}"
        );
    }

    #[test]
    fn a_gone_peer_aborts_after_the_grace_not_the_timeout() {
        let t0 = Instant::now();
        let gone_at = t0 + Duration::from_millis(100);
        let r = wait_collective(
            limits(600_000, 200),
            || Ok(false),
            || (Instant::now() >= gone_at).then(|| "rank 1's connection closed".to_string()),
        );
        let took = t0.elapsed();
        let m = r.unwrap_err();
        assert!(m.starts_with("aborted after 0."), "{m}");
        assert!(m.ends_with(" s: rank 1's connection closed"), "{m}");
        // the grace, far from the 600 s timeout (a bound a loaded machine cannot reach)
        assert!(
            took >= Duration::from_millis(300) && took < Duration::from_secs(120),
            "{took:?}"
        );
    }

    #[test]
    fn a_collective_completing_within_the_grace_succeeds() {
        // A peer that finished its last collective and left: ours completes just after.
        let t0 = Instant::now();
        let r = wait_collective(
            limits(60_000, 1_000),
            completes_at(t0 + Duration::from_millis(100)),
            || Some("rank 1 left the group".to_string()),
        );
        // Ok, not the peer's failure after the grace: no clock needed
        assert_eq!(r, Ok(()));
    }

    #[test]
    fn a_failing_poll_is_returned_at_once() {
        let calls = Cell::new(0);
        let r = wait_collective(
            limits(60_000, 1_000),
            || {
                calls.set(calls.get() + 1);
                if calls.get() < 3 {
                    Ok(false)
                } else {
                    Err("NCCL async error: remote process exited".to_string())
                }
            },
            || None,
        );
        assert_eq!(r.unwrap_err(), "NCCL async error: remote process exited");
        assert_eq!(calls.get(), 3);
    }

    #[test]
    fn the_default_grace_is_short_and_never_above_the_timeout() {
        assert_eq!(
            Limits::new(Duration::from_secs(60)).grace,
            Duration::from_secs(2)
        );
        assert_eq!(
            Limits::new(Duration::from_millis(500)).grace,
            Duration::from_millis(500)
        );
    }
}
