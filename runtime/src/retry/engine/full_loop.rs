//! The loop of a step set up in full: what happens after each attempt.

use std::fmt;
use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use crate::retry::classify::IsOom;
use crate::retry::commit;
use crate::retry::consensus::ConsensusError;
use crate::retry::decision::{self, Facts, Outcome, Settled, Status, GIVE_UP};
use crate::retry::last_report;
use crate::retry::memory::{Limits, MemoryKey};
use crate::retry::result::{FailedAttempt, RetryError};
use crate::retry_report::{BatchPlan, OomRequest, RetryReport, StopReason};
use crate::Device;

use super::agree::{Agreed, FAILED_VOTE};
use super::config::RetryEngine;
use super::target::{ChurnMark, Target};
use super::thread_device::thread_device_key;

/// The state of a loop set up in full (every step but a first attempt that ran without one).
pub(super) struct FullLoop<E> {
    /// For a step that holds no device: the thread's device when its key was taken.
    pub(super) device_addr: usize,
    pub(super) engine: RetryEngine,
    pub(super) target: Target,
    pub(super) key: MemoryKey,
    pub(super) batch: usize,
    pub(super) good: BatchPlan,
    pub(super) plan: BatchPlan,
    pub(super) regrow: Option<Limits>,
    pub(super) regrow_plan: Option<BatchPlan>,
    pub(super) report: RetryReport,
    pub(super) failures: Vec<FailedAttempt<E>>,
    pub(super) oom_count: u32,
    /// The last failed attempt's request larger than the whole capacity, the bytes in use when
    /// it failed, and its plan.
    pub(super) last_too_large: Option<(OomRequest, Option<u64>, BatchPlan)>,
    pub(super) started: Instant,
    pub(super) attempt_started: Instant,
    /// The churn counters when the attempt started.
    pub(super) churn_before: ChurnMark,
    /// Commits on the thread when the attempt started: a commit during a failed attempt (of a
    /// step nested in it) makes the failure final ([`crate::retry::commit`]).
    pub(super) commits_before: u64,
    pub(super) done: bool,
}

/// A loop dropped before its step ended (a panic in the attempt, or a caller that stopped
/// driving it): the other ranks wait for this rank's next agreement, so it takes part as failed
/// and they stop with [`RetryError::PeerFailed`] instead of waiting forever.
impl<E> Drop for FullLoop<E> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        self.done = true;
        // A consensus that panics here (its transport broken by the panic that is unwinding)
        // must not escape a destructor: that would abort the process.
        let engine = &self.engine;
        let voted = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            if engine.inner.consensus.world_size() > 1 {
                let mut v = FAILED_VOTE;
                engine.agree(&mut v)
            } else {
                Ok(())
            }
        }));
        match voted {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::error!(target: "oomguard::retry", error = %e, "agreement failed while stopping");
            }
            Err(_) => {
                tracing::error!(target: "oomguard::retry", "the consensus panicked while this rank stopped");
            }
        }
    }
}

impl<E> fmt::Debug for FullLoop<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryLoop")
            .field("site", &self.key.site)
            .field("plan", &self.plan)
            .field("retries", &self.report.attempts.len())
            .finish_non_exhaustive()
    }
}

impl<E: IsOom + fmt::Display> FullLoop<E> {
    /// A policy's plan, if the engine may run it: the rows of the step at most, and no larger
    /// than the plan that failed (a policy that grows plans would never end). Anything else is
    /// logged and treated as giving up: the policy is not trusted to be right.
    fn checked(&self, next: BatchPlan, failed: BatchPlan) -> Option<BatchPlan> {
        let ok = next.batch() <= self.batch
            && next.batch() <= failed.batch()
            && next.micro_batch() <= failed.micro_batch();
        if !ok {
            tracing::error!(
                target: "oomguard::retry",
                site = %self.report.site,
                policy = ?self.engine.inner.policy,
                failed = %failed,
                proposed = %next,
                rows = self.batch,
                "the retry policy proposed a plan larger than the one that failed (or than the \
                 step's rows): giving up"
            );
            return None;
        }
        Some(next)
    }

    /// [`RetryLoop::next_value`](crate::retry::advanced::RetryLoop::next_value) of a loop set up in full.
    pub(super) fn next<G>(
        &mut self,
        result: Result<G, E>,
    ) -> ControlFlow<Result<G, RetryError<E>>> {
        if self.done {
            return ControlFlow::Break(Err(RetryError::InvalidArgument(
                "RetryLoop::next called after the step finished".into(),
            )));
        }
        // One clock read per attempt: its time and the step's.
        let now = self.engine.inner.clock.now();
        let elapsed = now.saturating_duration_since(self.attempt_started);
        let churn = self.target.churn().since(&self.churn_before);
        let plan = self.plan;
        // A step nested in the attempt committed: rerunning the attempt would commit it again.
        let nested_commit = result.is_err() && commit::commits() != self.commits_before;
        let seen = self.take_outcome(&result, nested_commit);
        let (status, proposal) = self.vote(seen.outcome, plan);
        let (agreed_status, next) = match self
            .engine
            .agree_on(status, proposal, self.batch, &self.key)
        {
            Ok(Agreed {
                conflict: Some(why),
                plan,
                ..
            }) => {
                // no plan serves both a rank that keeps every row and one that drops some
                tracing::error!(target: "oomguard::retry", site = %self.key.site, "{why}");
                self.report.stopped = Some(why);
                (GIVE_UP, plan)
            }
            Ok(a) => (a.status, a.plan),
            Err(e) => return ControlFlow::Break(Err(self.consensus_failed(e, now))),
        };
        if matches!(self.target, Target::All) && Device::thread_device_addr() != self.device_addr {
            // What the attempt learned belongs to the device it allocated on.
            self.key.device = thread_device_key();
            self.device_addr = Device::thread_device_addr();
        }

        let settled = decision::settle(status, agreed_status);
        if settled == Settled::Commit {
            let Ok(value) = result else {
                // (a true maximum never agrees OK over this rank's failure: `agree_on` checks)
                let e = ConsensusError(
                    "the ranks agreed that every attempt succeeded, but this rank's failed: the \
                     consensus does not take the maximum over the ranks"
                        .into(),
                );
                return ControlFlow::Break(Err(self.consensus_failed(e, now)));
            };
            self.committed(plan, churn, elapsed, now);
            return ControlFlow::Break(Ok(value));
        }
        if settled == Settled::PeerFailed
            && agreed_status == GIVE_UP
            && self.report.stopped.is_none()
        {
            // a peer's policy ran out of plans: this rank's step failed for lack of memory too
            self.report.stopped = Some(StopReason::PeerGaveUp);
        }
        let attempt = Attempted {
            plan,
            elapsed,
            now,
            nested_commit,
            at_failure: seen.at_failure,
            too_large: seen.too_large,
        };
        self.not_counted(result, settled, next, attempt)
    }

    /// What this rank's attempt did. On its out-of-memory: the bytes right after the failure,
    /// then the cache emptied (unless a budget's) and what the next attempt starts with.
    fn take_outcome<G>(&mut self, result: &Result<G, E>, nested_commit: bool) -> Seen {
        let mut seen = Seen {
            outcome: Outcome::Failed,
            at_failure: None,
            too_large: None,
        };
        seen.outcome = match result {
            Ok(_) => Outcome::Ok,
            Err(_) if nested_commit => Outcome::FailedAfterCommit,
            Err(e) if e.is_oom() => {
                self.oom_count += 1;
                let budget = e.is_budget_exceeded();
                seen.at_failure = Some(self.target.bytes());
                if !budget {
                    self.target.empty_cache();
                }
                // what the next attempt starts with, its frees run
                self.report.held_bytes.push(self.target.held());
                seen.too_large = e.oom_request().filter(OomRequest::exceeds_capacity);
                Outcome::Oom {
                    budget,
                    too_large: seen.too_large,
                    in_use: e.oom_in_use(),
                }
            }
            Err(_) => Outcome::Failed,
        };
        seen
    }

    /// This rank's status after the attempt and the plan it proposes to the other ranks
    /// ([`decision::vote`]); why it stopped goes in the report, running out of attempts in the
    /// log.
    fn vote(&mut self, outcome: Outcome, plan: BatchPlan) -> (Status, BatchPlan) {
        let state = Facts {
            plan,
            batch: self.batch,
            good: self.good,
            regrowing: self.regrow.is_some(),
            oom_count: self.oom_count,
            held: &self.report.held_bytes,
            stop_on_growth: self.engine.inner.stop_on_growth,
            last_too_large: self.last_too_large,
            retry_limit: self.engine.inner.policy.retry_limit(),
        };
        let policy = &self.engine.inner.policy;
        let vote = decision::vote(outcome, &state, |ctx| {
            policy.next_plan(ctx).and_then(|p| self.checked(p, plan))
        });
        self.last_too_large = vote.last_too_large;
        if let Some(why) = &vote.stop {
            tracing::error!(
                target: "oomguard::retry",
                site = %self.report.site,
                "out of memory: {why}"
            );
            self.report.stopped = Some(why.clone());
        }
        (vote.status, vote.proposal)
    }

    /// The ranks could not agree: the step ends with the consensus error.
    fn consensus_failed(&mut self, e: ConsensusError, now: Instant) -> RetryError<E> {
        self.done = true;
        self.report.failure = Some(e.to_string());
        self.report.elapsed = now.saturating_duration_since(self.started);
        last_report::set_last_report(&self.report);
        RetryError::Consensus(e)
    }
}

/// What [`FullLoop::take_outcome`] found about this rank's attempt.
struct Seen {
    outcome: Outcome,
    /// Bytes allocated and reserved right after this rank's out-of-memory.
    at_failure: Option<(u64, u64)>,
    /// The failed request, when it is larger than the whole capacity.
    too_large: Option<OomRequest>,
}

/// An attempt that ended, as the failure path records it.
pub(super) struct Attempted {
    /// The plan it ran.
    pub(super) plan: BatchPlan,
    /// How long it took.
    pub(super) elapsed: Duration,
    /// When it ended (the clock read once per attempt).
    pub(super) now: Instant,
    /// A step nested in it committed.
    pub(super) nested_commit: bool,
    /// Bytes allocated and reserved right after this rank's out-of-memory.
    pub(super) at_failure: Option<(u64, u64)>,
    /// The failed request, when it is larger than the whole capacity.
    pub(super) too_large: Option<OomRequest>,
}
