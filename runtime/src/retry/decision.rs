//! What the retry engine does after an attempt, as pure functions of the loop's state, the
//! attempt's outcome and the ranks' agreement: no clock, no thread-local, no device. The
//! engine's loop (`engine/`) reads the clock and the source, empties caches, agrees with the
//! other ranks and writes the report around them; what to do next is decided here.
//!
//! Two steps: [`vote`], this rank's status and proposed plan from its own attempt; then
//! [`settle`], the action once the ranks agreed (the worst status of all, the smallest plan).

use super::policy::{Pressure, RetryContext};
use crate::retry_report::{BatchPlan, OomRequest, StopReason};

/// Most failed attempts of one step, whatever the policy says: a policy that never gives up
/// cannot loop forever.
pub const MAX_ATTEMPTS: u32 = 64;

/// A rank's status, ordered so that the maximum over ranks is the one that counts.
pub(crate) type Status = u64;
/// The attempt succeeded.
/// The `u64` words every rank sends in an agreement (status, micro-batch, rows dropped, keeps
/// every row, the step's tag and its complement): the NCCL consensus allocates them on the
/// device up front.
pub(crate) const VOTE_WORDS: usize = 6;
pub(crate) const OK: Status = 0;
/// Out of memory: retry with the proposed plan.
pub(crate) const OOM: Status = 1;
/// Out of memory, and no plan is left: give up.
pub(crate) const GIVE_UP: Status = 2;
/// Another error, or an error after a nested step committed: stop, not retried.
pub(crate) const FATAL: Status = 3;

/// What this rank's attempt did, as the decision needs it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Outcome {
    /// It succeeded.
    Ok,
    /// It failed after a step nested in it committed: rerunning would commit that again.
    FailedAfterCommit,
    /// It ran out of memory.
    Oom {
        /// A memory budget refused it (emptying the cache cannot help).
        budget: bool,
        /// The failed request, when it is larger than the whole capacity.
        too_large: Option<OomRequest>,
        /// The bytes in use when it failed, when the error says.
        in_use: Option<u64>,
    },
    /// Another error.
    Failed,
}

/// The facts of the loop that the decision reads.
#[derive(Clone, Debug)]
pub(crate) struct Facts<'a> {
    /// The plan the attempt ran.
    pub plan: BatchPlan,
    /// The step's rows.
    pub batch: usize,
    /// The plan that worked before a regrow was tried (a failed regrow falls back to it).
    pub good: BatchPlan,
    /// This attempt tried one size up (a regrow).
    pub regrowing: bool,
    /// Out-of-memory attempts so far, this one included.
    pub oom_count: u32,
    /// Bytes held when each attempt started, in order (after this one's failure).
    pub held: &'a [u64],
    /// Stop when held memory grew twice ([`super::RetryEngine::stop_when_held_grows`]).
    pub stop_on_growth: bool,
    /// The last attempt's request larger than the capacity, with its bytes in use and plan.
    pub last_too_large: Option<(OomRequest, Option<u64>, BatchPlan)>,
    /// The policy's limit on retries in one step ([`super::RetryPolicy::retry_limit`]).
    pub retry_limit: Option<u32>,
}

/// This rank's vote: its status and the plan it proposes (the attempt's own plan unless it
/// retries), why it stopped when a stop rule did, and the too-large request to remember.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Vote {
    /// [`OK`], [`OOM`], [`GIVE_UP`] or [`FATAL`].
    pub status: Status,
    /// The plan to retry with (the attempt's plan when not retrying).
    pub proposal: BatchPlan,
    /// A stop rule, a limit or the engine's cap ([`MAX_ATTEMPTS`]) ended the step.
    pub stop: Option<StopReason>,
    /// What the next attempt's stop rule compares with.
    pub last_too_large: Option<(OomRequest, Option<u64>, BatchPlan)>,
}

/// This rank's vote on its attempt. `next_plan` is the policy (its proposal already checked):
/// asked only when the attempt ran out of memory and no rule stops the step.
pub(crate) fn vote(
    outcome: Outcome,
    s: &Facts<'_>,
    next_plan: impl FnOnce(&RetryContext) -> Option<BatchPlan>,
) -> Vote {
    let keep = |status| Vote {
        status,
        proposal: s.plan,
        stop: None,
        last_too_large: s.last_too_large,
    };
    let (budget, too_large, in_use) = match outcome {
        Outcome::Ok => return keep(OK),
        Outcome::FailedAfterCommit | Outcome::Failed => return keep(FATAL),
        Outcome::Oom {
            budget,
            too_large,
            in_use,
        } => (budget, too_large, in_use),
    };
    let last_too_large = too_large.map(|r| (r, in_use, s.plan));
    let rose_now = matches!(s.held, [.., a, b] if b > a);
    let held_grew = s.held.windows(2).filter(|w| w[1] > w[0]).count() >= 2;
    // A request larger than the whole capacity that the same allocation made again (it did not
    // shrink when the plan did): no plan can serve it. Another allocation's may still shrink.
    let stop = if s.stop_on_growth && rose_now && held_grew {
        Some(StopReason::HeldGrew {
            held: s.held.to_vec(),
        })
    } else {
        match (too_large, s.last_too_large) {
            (Some(r), Some((prev, prev_in_use, prev_plan)))
                if shrank(prev_plan, s.plan)
                    && same_allocation_again(
                        (r.requested, in_use),
                        (prev.requested, prev_in_use),
                    ) =>
            {
                Some(StopReason::TooLarge {
                    request: r,
                    plans: (prev_plan, s.plan),
                })
            }
            _ => None,
        }
    };
    let exhausted = stop.is_none() && !s.regrowing && s.oom_count > MAX_ATTEMPTS;
    let next = if stop.is_some() || exhausted {
        None
    } else if s.regrowing {
        Some(s.good)
    } else {
        // A budget, or a request larger than the whole, is not helped by emptying the cache:
        // the policy skips that retry.
        let pressure = if too_large.is_some() {
            Pressure::TooLarge
        } else if budget {
            Pressure::Budget
        } else {
            Pressure::Oom
        };
        next_plan(&RetryContext::new(s.plan, s.batch, s.oom_count, pressure))
    };
    // The engine's cap, or the policy's own limit past which it gave up, stopped the step,
    // whatever plans are left.
    let stop = match (stop, next) {
        (None, None) if exhausted => Some(StopReason::AttemptCap { max: MAX_ATTEMPTS }),
        (None, None) => s
            .retry_limit
            .filter(|&max| s.oom_count > max)
            .map(|max| StopReason::RetryLimit { max }),
        (stop, _) => stop,
    };
    Vote {
        status: if next.is_some() { OOM } else { GIVE_UP },
        proposal: next.unwrap_or(s.plan),
        stop,
        last_too_large,
    }
}

/// Whether `now` runs fewer rows at once than `before` (a smaller micro-batch or batch): only
/// then does a request that failed again say it does not depend on the plan (a policy that
/// proposed the same plan again proved nothing).
fn shrank(before: BatchPlan, now: BatchPlan) -> bool {
    now.micro_batch() < before.micro_batch() || now.batch() < before.batch()
}

/// Whether a request larger than the whole capacity that failed after a smaller plan
/// (`(bytes, in use when it failed)`) is the one that failed before it, failing again: then it
/// does not depend on the plan, and no plan can serve it.
///
/// The two failing requests need not be the same allocation: a step whose layers widen fails
/// first on a narrow layer, then, its chunk halved, on a wider one. A larger request proves
/// they differ (the allocation that failed before got past, so it shrank with the plan: keep
/// splitting); a smaller one shrank. The same size is the same allocation unless another one
/// happens to be exactly that much wider than the chunk is smaller; that one is reached only
/// after the first got past, with its memory (or what followed it) in use, so the same size
/// counts as the same allocation only with no more in use than at the first failure (the rows
/// before a fixed weight shrink with the chunk; unknown in-use figures compare as equal).
/// Keeping on splitting is bounded by the policy and [`MAX_ATTEMPTS`].
pub(crate) fn same_allocation_again(now: (u64, Option<u64>), before: (u64, Option<u64>)) -> bool {
    now.0 == before.0
        && match (now.1, before.1) {
            (Some(now), Some(before)) => now <= before,
            _ => true,
        }
}

/// What the loop does once the ranks agreed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Settled {
    /// Every rank succeeded: commit this attempt's value.
    Commit,
    /// This rank's attempt failed for good: return its error, not retried.
    Fatal,
    /// Retry with the agreed plan.
    Retry,
    /// This rank's policy gave up.
    GaveUp,
    /// Another rank gave up or failed.
    PeerFailed,
}

/// The action for this rank's `local` status once the ranks agreed on `agreed` (the worst).
pub(crate) fn settle(local: Status, agreed: Status) -> Settled {
    if agreed == OK {
        Settled::Commit
    } else if local == FATAL {
        Settled::Fatal
    } else if agreed == OOM {
        Settled::Retry
    } else if agreed == FATAL || (agreed == GIVE_UP && local != GIVE_UP && local != OOM) {
        Settled::PeerFailed
    } else {
        Settled::GaveUp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(batch: usize, micro: usize) -> BatchPlan {
        BatchPlan::with_micro_batch(batch, micro).unwrap()
    }

    fn state(held: &[u64]) -> Facts<'_> {
        Facts {
            plan: plan(64, 64),
            batch: 64,
            good: plan(64, 32),
            regrowing: false,
            oom_count: 1,
            held,
            stop_on_growth: false,
            last_too_large: None,
            retry_limit: None,
        }
    }

    fn oom() -> Outcome {
        Outcome::Oom {
            budget: false,
            too_large: None,
            in_use: None,
        }
    }

    fn too_large(requested: u64, in_use: Option<u64>) -> Outcome {
        Outcome::Oom {
            budget: false,
            too_large: Some(OomRequest {
                requested,
                capacity: 100,
                budget: false,
            }),
            in_use,
        }
    }

    fn halve(ctx: &RetryContext) -> Option<BatchPlan> {
        let m = ctx.plan.micro_batch() / 2;
        (m >= 1).then(|| plan(ctx.requested_batch, m))
    }

    /// Every outcome against the policy's answer: the status, the proposal, and when the
    /// policy is asked and with which pressure.
    #[test]
    fn the_vote_of_each_outcome() {
        let held = [10];
        let s = state(&held);
        let never = |_: &RetryContext| -> Option<BatchPlan> { panic!("the policy is not asked") };
        for (outcome, status) in [
            (Outcome::Ok, OK),
            (Outcome::Failed, FATAL),
            (Outcome::FailedAfterCommit, FATAL),
        ] {
            let v = vote(outcome, &s, never);
            assert_eq!((v.status, v.proposal, v.stop), (status, s.plan, None));
        }
        let cases = [
            (oom(), Pressure::Oom),
            (
                Outcome::Oom {
                    budget: true,
                    too_large: None,
                    in_use: None,
                },
                Pressure::Budget,
            ),
            (too_large(200, None), Pressure::TooLarge),
        ];
        for (outcome, pressure) in cases {
            for answer in [Some(plan(64, 32)), None] {
                let mut asked = None;
                let v = vote(outcome, &s, |ctx| {
                    asked = Some((ctx.pressure, ctx.attempt, ctx.plan));
                    answer
                });
                assert_eq!(asked, Some((pressure, 1, s.plan)), "{outcome:?}");
                match answer {
                    Some(p) => assert_eq!((v.status, v.proposal), (OOM, p)),
                    None => assert_eq!((v.status, v.proposal), (GIVE_UP, s.plan)),
                }
                assert_eq!(v.stop, None);
            }
        }
    }

    #[test]
    fn a_failed_regrow_falls_back_to_the_plan_that_worked() {
        let held = [10];
        let s = Facts {
            regrowing: true,
            ..state(&held)
        };
        let v = vote(oom(), &s, |_| panic!("not asked"));
        assert_eq!((v.status, v.proposal), (OOM, s.good));
    }

    #[test]
    fn the_policy_is_asked_at_most_max_attempts_times() {
        let held = [10];
        let s = Facts {
            oom_count: MAX_ATTEMPTS + 1,
            ..state(&held)
        };
        let v = vote(oom(), &s, |_| panic!("not asked"));
        assert_eq!(v.status, GIVE_UP);
        let cap = Some(StopReason::AttemptCap { max: MAX_ATTEMPTS });
        assert_eq!(v.stop, cap);
        let s = Facts {
            oom_count: MAX_ATTEMPTS,
            ..state(&held)
        };
        assert_eq!(vote(oom(), &s, halve).status, OOM);
    }

    #[test]
    fn held_memory_that_grew_twice_stops_only_when_asked() {
        let held = [10, 20, 30];
        let s = state(&held);
        assert_eq!(vote(oom(), &s, halve).status, OOM);
        let s = Facts {
            stop_on_growth: true,
            ..state(&held)
        };
        let v = vote(oom(), &s, |_| panic!("not asked"));
        assert_eq!(v.status, GIVE_UP);
        assert_eq!(
            v.stop,
            Some(StopReason::HeldGrew {
                held: held.to_vec()
            })
        );
        // grew twice, but not at this attempt: goes on
        let held = [10, 20, 30, 30];
        let s = Facts {
            stop_on_growth: true,
            ..state(&held)
        };
        assert_eq!(vote(oom(), &s, halve).status, OOM);
    }

    /// A policy that gives up past its retry limit is reported as stopped by the limit; one
    /// that gives up within it (no smaller plan) is not, nor is a retry the policy still makes.
    #[test]
    fn giving_up_past_the_retry_limit_is_named() {
        let held = [10];
        let s = |oom_count| Facts {
            oom_count,
            retry_limit: Some(2),
            ..state(&held)
        };
        let v = vote(oom(), &s(3), |_| None);
        assert_eq!(v.status, GIVE_UP);
        assert_eq!(v.stop, Some(StopReason::RetryLimit { max: 2 }));
        let v = vote(oom(), &s(2), |_| None);
        assert_eq!((v.status, v.stop), (GIVE_UP, None));
        let v = vote(oom(), &s(3), halve);
        assert_eq!((v.status, v.stop), (OOM, None));
        // no limit: giving up is the policy's own
        let v = vote(
            oom(),
            &Facts {
                oom_count: 3,
                ..state(&held)
            },
            |_| None,
        );
        assert_eq!((v.status, v.stop), (GIVE_UP, None));
    }

    /// The stop rule compares the same allocation: two different requests larger than the
    /// capacity (a layer 4 × as wide fails after the split) keep splitting.
    #[test]
    fn a_too_large_request_stops_only_when_the_same_allocation_failed_again() {
        let held = [10];
        let first = state(&held);
        let v1 = vote(too_large(200, Some(50)), &first, halve);
        assert_eq!(v1.status, OOM);
        let second = Facts {
            plan: v1.proposal,
            last_too_large: v1.last_too_large,
            ..state(&held)
        };
        // another allocation (another size): the split goes on
        let v2 = vote(too_large(400, Some(50)), &second, halve);
        assert_eq!((v2.status, v2.stop.is_none()), (OOM, true));
        // the same size with no more in use: the same allocation, no plan shrinks it
        let v3 = vote(too_large(200, Some(40)), &second, |_| panic!("not asked"));
        assert_eq!(v3.status, GIVE_UP);
        assert!(
            matches!(v3.stop, Some(StopReason::TooLarge { .. })),
            "{v3:?}"
        );
        // the same size with more in use: another allocation, reached after the first got
        // past; the split goes on
        let v4 = vote(too_large(200, Some(60)), &second, halve);
        assert_eq!(v4.status, OOM);
        // an out-of-memory that is not too large forgets the last too-large request
        let v5 = vote(oom(), &second, halve);
        assert_eq!(v5.last_too_large, None);
        // the same allocation after the same plan (a policy that proposed it again): the plan
        // did not shrink, so nothing says no plan can serve it; the policy is asked
        let same = Facts {
            plan: first.plan,
            last_too_large: v1.last_too_large,
            ..state(&held)
        };
        let v6 = vote(too_large(200, Some(40)), &same, halve);
        assert_eq!((v6.status, v6.stop), (OOM, None));
    }

    /// Every pair of statuses a rank can see: its own, and the worst of all ranks (never
    /// better than its own).
    #[test]
    fn the_action_for_every_agreement() {
        use Settled::*;
        let table = [
            (OK, OK, Commit),
            (OK, OOM, Retry),
            (OK, GIVE_UP, PeerFailed),
            (OK, FATAL, PeerFailed),
            (OOM, OOM, Retry),
            (OOM, GIVE_UP, GaveUp),
            (OOM, FATAL, PeerFailed),
            (GIVE_UP, GIVE_UP, GaveUp),
            (GIVE_UP, FATAL, PeerFailed),
            (FATAL, FATAL, Fatal),
        ];
        for (local, agreed, action) in table {
            assert_eq!(
                settle(local, agreed),
                action,
                "local {local}, agreed {agreed}"
            );
        }
    }
}
