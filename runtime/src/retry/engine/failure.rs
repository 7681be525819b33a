//! After an attempt that does not count on any rank: the attempt recorded, then the step stops
//! (an error that is not retried, no plan left, another rank failed) or runs again.

use std::fmt;
use std::ops::ControlFlow;
use std::time::Instant;

use crate::retry::classify::IsOom;
use crate::retry::commit;
use crate::retry::decision::Settled;
use crate::retry::last_report;
use crate::retry::result::{FailedAttempt, RetryError};
use crate::retry_report::{AttemptOutcome, AttemptRecord, BatchPlan, Regrow};

use super::full_loop::{Attempted, FullLoop};

impl<E: IsOom + fmt::Display> FullLoop<E> {
    /// The attempt does not count on any rank (`settled` is not a commit): it is recorded, and
    /// the step stops or goes on with `next`.
    pub(super) fn not_counted<G>(
        &mut self,
        result: Result<G, E>,
        settled: Settled,
        next: BatchPlan,
        a: Attempted,
    ) -> ControlFlow<Result<G, RetryError<E>>> {
        let plan = a.plan;
        let (allocated_bytes, reserved_bytes) = a.at_failure.unwrap_or_else(|| self.target.bytes());
        let (outcome, error_text, error) = match result {
            Ok(v) => {
                drop(v);
                (AttemptOutcome::PeerOom, None, None)
            }
            Err(e) => {
                let text = e.to_string();
                if settled == Settled::Fatal {
                    return ControlFlow::Break(Err(self.fatal(e, text, &a)));
                }
                (AttemptOutcome::Oom, Some(text), Some(e))
            }
        };
        let continuing = settled == Settled::Retry;
        self.report.attempts.push(AttemptRecord {
            plan,
            outcome,
            error: error_text.clone(),
            next: continuing.then_some(next),
            allocated_bytes,
            reserved_bytes,
            elapsed: a.elapsed,
            too_large: a.too_large,
        });
        self.failures.push(FailedAttempt { plan, error });
        if a.at_failure.is_none() {
            // another rank's out-of-memory: empty this rank's cache too
            self.target.empty_cache();
        }
        if !continuing {
            return ControlFlow::Break(Err(self.give_up(plan, settled, a.now)));
        }
        tracing::warn!(
            target: "oomguard::retry",
            site = %self.report.site,
            attempt = self.report.attempts.len(),
            error = error_text.as_deref().unwrap_or("another rank ran out of memory"),
            old_plan = %plan,
            new_plan = %next,
            allocated_bytes,
            reserved_bytes,
            "out of memory: retrying with a smaller plan"
        );
        self.retry_with(next, a.now);
        ControlFlow::Continue(())
    }

    /// An error that is not retried (not an out-of-memory, or any error after a nested step
    /// committed): the step ends with it, marked when a commit ran inside the attempt.
    fn fatal(&mut self, e: E, text: String, a: &Attempted) -> RetryError<E> {
        self.done = true;
        self.report.final_plan = a.plan;
        self.report.elapsed = a.now.saturating_duration_since(self.started);
        let error = if a.nested_commit {
            tracing::error!(
                target: "oomguard::retry",
                site = %self.report.site,
                error = %e,
                "the attempt failed after a nested step committed: not retried \
                 (a retry would apply its update again)"
            );
            let (seq, inner) = last_report::committed_since(self.commits_before)
                .map_or((commit::commits(), None), |(s, r)| (s, Some(r)));
            self.report.failure = Some(match &inner {
                Some(_) => text,
                // a commit noted by hand, without a report of its step
                None => format!(
                    "a commit ran on this thread during the attempt, so it is not \
                     retried: {text}"
                ),
            });
            self.report.nested_commit = inner.map(Box::new);
            last_report::set_last_report(&self.report);
            // enclosing steps find this report, which holds the nested one
            last_report::mark_last_committed(seq);
            e.after_commit(&self.report)
        } else {
            self.report.failure = Some(text);
            last_report::set_last_report(&self.report);
            e
        };
        RetryError::Step {
            error,
            report: Box::new(self.report.clone()),
        }
    }

    /// No plan is left (or another rank failed): the step ends with every attempt's error.
    fn give_up(&mut self, plan: BatchPlan, settled: Settled, now: Instant) -> RetryError<E> {
        self.done = true;
        self.report.final_plan = plan;
        self.report.elapsed = now.saturating_duration_since(self.started);
        last_report::set_last_report(&self.report);
        tracing::error!(
            target: "oomguard::retry",
            site = %self.report.site,
            attempts = self.failures.len(),
            plan = %plan,
            "out of memory: giving up"
        );
        let report = Box::new(self.report.clone());
        if settled == Settled::PeerFailed {
            RetryError::PeerFailed { report }
        } else {
            RetryError::GaveUp {
                failures: std::mem::take(&mut self.failures),
                report,
            }
        }
    }

    /// Sets the loop up for the next attempt, with `next`; a regrow that failed is recorded
    /// (and counted, so that the next one waits longer).
    fn retry_with(&mut self, next: BatchPlan, now: Instant) {
        if let Some(tried) = self.regrow_plan {
            if self.report.regrow.is_none() {
                self.report.regrow = Some(Regrow {
                    tried,
                    succeeded: false,
                });
                self.regrow = None;
                self.engine.memory().entry(&self.key).failed_regrows += 1;
            }
        }
        self.plan = next;
        self.churn_before = self.target.churn();
        self.commits_before = commit::commits();
        self.attempt_started = now;
    }
}
