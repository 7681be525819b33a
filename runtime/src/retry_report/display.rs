//! How a report reads: its headline and its lines.

use std::fmt;

use super::record::{RetryReport, StopReason};
use super::speed::SpeedDecision;

/// `a -> b -> c` in readable sizes.
pub(crate) fn held_path(held: &[u64]) -> String {
    held.iter()
        .map(|b| crate::ByteSize(*b).to_string())
        .collect::<Vec<_>>()
        .join(" -> ")
}

impl fmt::Display for StopReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StopReason::HeldGrew { held } => write!(
                f,
                "allocated grew {} between attempts: the step keeps memory across attempts (a \
                 leak), so a retry cannot help; drop everything an attempt allocates before it \
                 returns (tensors kept in a collection outside the closure, a graph held by a \
                 value that outlives it)",
                held_path(held)
            ),
            StopReason::TooLarge { request, plans } => write!(
                f,
                "{request} did not shrink when the plan did ({} -> {}): it does not depend on \
                 the batch, so no plan can serve it",
                plans.0, plans.1
            ),
            StopReason::RetryLimit { max } => write!(
                f,
                "the retry policy's limit of {max} {} in one step was reached (smaller plans \
                 were not tried; `max_retries` sets the limit)",
                if *max == 1 { "retry" } else { "retries" }
            ),
            StopReason::AttemptCap { max } => write!(
                f,
                "the engine's cap of {max} failed attempts in one step was reached (the policy \
                 was not asked again)"
            ),
            StopReason::RanksDisagreeOnRows { dropped } => write!(
                f,
                "a rank's plan drops {dropped} row(s) of its batch while a rank's policy keeps \
                 every row (a training step): no plan serves both, so every rank stops; give \
                 every rank a policy that keeps rows (`training_policy()`, `Accumulate`)"
            ),
            StopReason::PeerGaveUp => write!(
                f,
                "another rank gave up for lack of memory (no plan of its policy fit), so this \
                 step is an out-of-memory on every rank"
            ),
            StopReason::RanksAtDifferentSteps => write!(
                f,
                "the ranks met in one agreement from different steps (another call site, or \
                 train beside eval): every rank must run the same retried steps in the same \
                 order (the same program), so every rank stops"
            ),
        }
    }
}

impl RetryReport {
    /// The first line of the report: the site, and what happened to the step.
    pub(crate) fn headline(&self) -> Headline<'_> {
        Headline(self)
    }
}

/// [`RetryReport::headline`].
pub(crate) struct Headline<'a>(&'a RetryReport);

impl fmt::Display for Headline<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let r = self.0;
        let retries = r.retries();
        let plural = if retries == 1 { "y" } else { "ies" };
        write!(f, "{} ({:?}): ", r.site, r.mode)?;
        if r.gave_up() {
            return write!(
                f,
                "gave up (out of memory) after {} attempt{} ({retries} retr{plural}); last tried \
                 {} in {:.3?}",
                r.attempts.len(),
                if r.attempts.len() == 1 { "" } else { "s" },
                r.final_plan,
                r.elapsed
            );
        }
        if r.failure.is_some() {
            write!(
                f,
                "failed on attempt {} ({}) in {:.3?}, not retried",
                r.attempts.len() + 1,
                r.final_plan,
                r.elapsed
            )?;
            if let Some(n) = &r.nested_commit {
                write!(
                    f,
                    ": the step at {} committed during the attempt (a retry would apply its \
                     update again)",
                    n.site
                )?;
            }
            return Ok(());
        }
        write!(
            f,
            "{} after {retries} retr{plural} in {:.3?}",
            r.final_plan, r.elapsed
        )?;
        if let Some(c) = &r.commit_error {
            let what = if c.oom { "out of memory" } else { "an error" };
            write!(f, ", then its commit failed ({what}; not retried)")?;
        }
        Ok(())
    }
}

/// The first line of an error's text: what a report prints for each attempt, one line each
/// whatever `RUST_BACKTRACE` is (candle's `Error::bt()` appends a backtrace of about 35 lines
/// after the message; the full text stays in [`AttemptRecord::error`](crate::retry::advanced::AttemptRecord::error)).
pub(crate) fn message_line(text: &str) -> &str {
    text.lines().next().unwrap_or("")
}

impl fmt::Display for RetryReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.headline())?;
        if let Some(m) = self.seeded {
            write!(
                f,
                "\n  started from micro-batches of {m} rows (RetryEngine::start_from; nothing \
                 remembered for this step)"
            )?;
        }
        if let Some(g) = &self.regrow {
            let outcome = if g.succeeded {
                "it fit, remembered"
            } else {
                "out of memory, back to the plan that fit"
            };
            write!(
                f,
                "\n  regrow: tried {} after clean steps; {outcome}",
                g.tried
            )?;
        }
        for (i, a) in self.attempts.iter().enumerate() {
            write!(f, "\n  attempt {}: {} → {:?}", i + 1, a.plan, a.outcome)?;
            if let Some(e) = &a.error {
                write!(f, ": {}", message_line(e))?;
            }
            if let Some(r) = &a.too_large {
                write!(
                    f,
                    " [{r}: larger than the whole, so the same plan was not retried]"
                )?;
            }
        }
        if let Some(s) = &self.stopped {
            write!(f, "\n  stopped: {s}")?;
        }
        if self.may_leak() {
            write!(
                f,
                "\n  allocated grew {} between attempts: the step keeps memory across attempts \
                 (a leak?)",
                held_path(&self.held_bytes)
            )?;
        }
        if let Some(d) = &self.speed {
            write!(f, "\n  speed: {d}")?;
        }
        if let Some(p) = self.thrash_moved_to {
            if !matches!(self.speed, Some(SpeedDecision::Trying { .. })) {
                write!(
                    f,
                    "\n  allocator thrashing ({}): moved to {p} before a hard out-of-memory",
                    self.churn
                )?;
            }
        }
        if let Some(e) = &self.failure {
            write!(f, "\n  error: {}", message_line(e))?;
        }
        if let Some(m) = &self.memory_error {
            write!(f, "\n  plan file: {m}")?;
        }
        if let Some(c) = &self.commit_error {
            let what = if c.oom { "out of memory" } else { "error" };
            write!(f, "\n  commit failed ({what}, not retried): {}", c.error)?;
        }
        if let Some(h) = &self.hint {
            write!(f, "\n  hint: {h}")?;
        }
        if let Some(n) = &self.nested_commit {
            write!(f, "\n  nested step that committed: ")?;
            // indented one level more
            for (i, line) in n.to_string().lines().enumerate() {
                if i > 0 {
                    f.write_str("\n  ")?;
                }
                f.write_str(line)?;
            }
        }
        Ok(())
    }
}
