//! After a successful attempt: what the engine learns and remembers (limits, regrow, thrash).

use std::time::{Duration, Instant};

use crate::retry::last_report;
use crate::retry::memory::{Entry, Limits, MemoryKey};
use crate::retry::policy::{Pressure, RetryContext};
use crate::retry::thrash::{self, Observed, SpeedAction, ThrashDetector};
use crate::retry_report::{BatchPlan, Regrow, RetryReport};
use crate::source::Churn;

use super::config::RetryEngine;
use super::full_loop::FullLoop;

impl<E> FullLoop<E> {
    /// Every rank's attempt succeeded: the step ends with `plan`, and what it taught is
    /// remembered.
    pub(super) fn committed(
        &mut self,
        plan: BatchPlan,
        churn: Churn,
        elapsed: Duration,
        now: Instant,
    ) {
        self.done = true;
        self.report.final_plan = plan;
        if let Some(tried) = self.regrow_plan {
            if self.report.regrow.is_none() {
                self.report.regrow = Some(Regrow {
                    tried,
                    succeeded: true,
                });
            }
        }
        self.engine.after_success(
            &self.key,
            self.batch,
            &plan,
            &mut self.report,
            churn,
            elapsed,
            self.regrow,
        );
        self.report.elapsed = now.saturating_duration_since(self.started);
        last_report::set_last_report(&self.report);
    }
}

/// A successful attempt, as the thrash detection reads it.
struct Succeeded<'a> {
    key: &'a MemoryKey,
    batch: usize,
    plan: &'a BatchPlan,
    /// The allocator's churn during the attempt.
    churn: Churn,
    /// The attempt's time.
    elapsed: Duration,
}

impl RetryEngine {
    /// Updates the remembered plan after a successful attempt: learned limits, regrow, thrash
    /// (`churn`: the allocator's during the attempt, `elapsed`: the attempt's time).
    #[allow(clippy::too_many_arguments)]
    fn after_success(
        &self,
        key: &MemoryKey,
        batch: usize,
        plan: &BatchPlan,
        report: &mut RetryReport,
        churn: Churn,
        elapsed: Duration,
        regrow: Option<Limits>,
    ) {
        report.churn = churn;
        let mut mem = self.memory();
        let e = mem.entry(key);
        let mut limits = e.limits;
        if let Some(up) = regrow {
            limits = up;
            e.failed_regrows = 0;
            e.seed_outgrown = true;
        }
        if !report.attempts.is_empty() {
            limits = limits.learned(plan, batch);
        }
        if report.attempts.is_empty() && regrow.is_none() {
            e.clean_steps = e.clean_steps.saturating_add(1);
        } else {
            e.clean_steps = 0;
        }
        if let Some(t) = self.inner.thrash {
            let step = Succeeded {
                key,
                batch,
                plan,
                churn,
                elapsed,
            };
            limits = self.after_churn(t, &step, e, report, limits);
            e.seed_outgrown |= report.speed.is_some();
        }
        if limits == e.limits {
            // nothing learned (the usual step): no second lookup, nothing to save
            return;
        }
        if let Err(err) = mem.set_limits(key, limits) {
            tracing::warn!(target: "oomguard::retry", error = %err, "could not save remembered plans");
            report.memory_error = Some(err.to_string());
        }
    }

    /// Thrash detection after a successful step `s`: with allocator retries in a tripped
    /// window, a move down at once; otherwise what the speed book says. Returns the limits to
    /// remember.
    fn after_churn(
        &self,
        t: ThrashDetector,
        s: &Succeeded<'_>,
        e: &mut Entry,
        report: &mut RetryReport,
        mut limits: Limits,
    ) -> Limits {
        let tripped = t.observe_churn(&mut e.thrash_streak, &s.churn);
        let smaller = || {
            let ctx = RetryContext::new(*s.plan, s.batch, 1, Pressure::Thrash);
            self.inner.policy.next_plan(&ctx)
        };
        if tripped && s.churn.alloc_retries > 0 {
            // One allocation away from a hard OOM: move down now, whatever the speed.
            if let Some(smaller) = smaller() {
                tracing::warn!(
                    target: "oomguard::retry",
                    site = %s.key.site,
                    old_plan = %s.plan,
                    new_plan = %smaller,
                    churn = %s.churn,
                    window = t.window(),
                    "allocator thrashing: moving to a smaller plan before a hard OOM"
                );
                limits = limits.learned(&smaller, s.batch);
                report.thrash_moved_to = Some(smaller);
                e.clean_steps = 0;
                self.inner.speed.forget(s.key);
            }
        } else if self.inner.speed.wants(&s.churn) {
            let action = self.inner.speed.observe(Observed {
                key: s.key,
                plan: *s.plan,
                per_row: thrash::per_row(s.elapsed, s.plan.batch()),
                churn: s.churn,
                tripped,
                limits,
                batch: s.batch,
                smaller: if tripped { smaller() } else { None },
                window: t.window(),
            });
            limits = act_on_speed(action, t.window(), s, e, report, limits);
        }
        limits
    }
}

/// Applies what the speed book decided about step `s` (window: the thrash window); returns
/// the limits to remember.
fn act_on_speed(
    action: SpeedAction,
    window: u32,
    s: &Succeeded<'_>,
    e: &mut Entry,
    report: &mut RetryReport,
    mut limits: Limits,
) -> Limits {
    match action {
        SpeedAction::None => {}
        SpeedAction::Try(smaller, decision) => {
            tracing::info!(
                target: "oomguard::retry",
                site = %s.key.site,
                old_plan = %s.plan,
                new_plan = %smaller,
                churn = %s.churn,
                window,
                "allocator churn in every step of the window: trying a smaller plan \
                 ({decision})"
            );
            limits = limits.learned(&smaller, s.batch);
            report.thrash_moved_to = Some(smaller);
            report.speed = Some(decision);
            e.clean_steps = 0;
        }
        SpeedAction::Chose(decision, restore) => {
            tracing::info!(
                target: "oomguard::retry",
                site = %s.key.site,
                "plan chosen by time per row: {decision}"
            );
            if let Some(back) = restore {
                limits = back;
            }
            report.speed = Some(decision);
            e.clean_steps = 0;
            e.thrash_streak = 0;
        }
        SpeedAction::Stayed(decision) => {
            tracing::debug!(
                target: "oomguard::retry",
                site = %s.key.site,
                "allocator churn, plan kept: {decision}"
            );
            report.speed = Some(decision);
        }
    }
    limits
}
