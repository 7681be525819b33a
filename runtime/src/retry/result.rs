//! What a step returns: its value with the report ([`Retried`]), or why it did not complete
//! ([`RetryError`]).

use std::fmt;

use crate::retry::classify::IsOom;
use crate::retry::consensus::ConsensusError;
use crate::retry_report::{held_path, message_line, BatchPlan, RetryReport};

/// A step's value with the report of how it was obtained.
#[derive(Clone, Debug)]
pub struct Retried<T> {
    /// What the commit returned.
    pub value: T,
    /// How the step went.
    pub report: RetryReport,
}

/// One failed attempt of a step that gave up.
#[derive(Debug)]
pub struct FailedAttempt<E> {
    /// The plan it ran.
    pub plan: BatchPlan,
    /// This rank's error (`None`: this rank succeeded and another rank hit OOM).
    pub error: Option<E>,
}

/// The step did not complete. Nothing was committed.
#[derive(Debug)]
#[non_exhaustive]
pub enum RetryError<E> {
    /// The step failed with an error that is not out-of-memory; it was not retried.
    Step {
        /// The step's error.
        error: E,
        /// How the step went until then.
        report: Box<RetryReport>,
    },
    /// Out of memory at every plan the policy allowed.
    GaveUp {
        /// Every attempt, with its error.
        failures: Vec<FailedAttempt<E>>,
        /// How the step went.
        report: Box<RetryReport>,
    },
    /// Another rank failed (with a non-OOM error, or gave up); this rank stopped with it.
    PeerFailed {
        /// How the step went.
        report: Box<RetryReport>,
    },
    /// The arguments were wrong (a batch of 0 rows).
    InvalidArgument(String),
    /// The ranks could not agree.
    Consensus(ConsensusError),
}

impl<E> RetryError<E> {
    /// The step's own error, for callers that must return `E`: the non-OOM error, or the last
    /// out-of-memory error of a step that gave up, with the report attached where `E` can carry
    /// it ([`IsOom::with_retry_report`]). `None` when this rank had no error of its own (another
    /// rank failed, consensus failed, invalid argument).
    pub fn into_error(self) -> Option<E>
    where
        E: IsOom,
    {
        match self {
            RetryError::Step { error, .. } => Some(error),
            RetryError::GaveUp { failures, report } => failures
                .into_iter()
                .rev()
                .find_map(|f| f.error)
                .map(|e| e.with_retry_report(&report.attached())),
            _ => None,
        }
    }

    /// The report, when the step ran at all.
    pub fn report(&self) -> Option<&RetryReport> {
        match self {
            RetryError::Step { report, .. }
            | RetryError::GaveUp { report, .. }
            | RetryError::PeerFailed { report } => Some(report),
            _ => None,
        }
    }
}

impl<E: fmt::Display> fmt::Display for RetryError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RetryError::Step { error, report } => match &report.nested_commit {
                Some(n) => write!(
                    f,
                    "step failed, not retried (the step at {} committed during the attempt): \
                     {error}",
                    n.site
                ),
                None => write!(f, "step failed: {error}"),
            },
            RetryError::GaveUp { failures, report } => {
                match &report.stopped {
                    Some(why) => write!(
                        f,
                        "out of memory at {} after {} attempts; stopped: {why}",
                        report.site,
                        failures.len()
                    )?,
                    None => write!(
                        f,
                        "out of memory at {} after {} attempts; the policy allows nothing smaller",
                        report.site,
                        failures.len()
                    )?,
                }
                if report.stopped.is_none() && report.held_grew() {
                    write!(
                        f,
                        "\n  allocated grew {} between attempts: the step keeps memory across \
                         attempts (a leak?)",
                        held_path(&report.held_bytes)
                    )?;
                }
                for (i, a) in failures.iter().enumerate() {
                    write!(f, "\n  attempt {} ({}): ", i + 1, a.plan)?;
                    match &a.error {
                        Some(e) => write!(f, "{}", message_line(&e.to_string()))?,
                        None => write!(f, "another rank ran out of memory")?,
                    }
                }
                Ok(())
            }
            RetryError::PeerFailed { report } => {
                write!(f, "another rank failed at {}; stopped with it", report.site)
            }
            RetryError::InvalidArgument(m) => write!(f, "invalid argument: {m}"),
            RetryError::Consensus(e) => write!(f, "{e}"),
        }
    }
}

impl<E: fmt::Display + fmt::Debug> std::error::Error for RetryError<E> {}

impl<E: IsOom> IsOom for RetryError<E> {
    fn is_oom(&self) -> bool {
        match self {
            RetryError::GaveUp { .. } => true,
            // after a nested commit: never retryable
            RetryError::Step { error, report } => report.nested_commit.is_none() && error.is_oom(),
            _ => false,
        }
    }
    /// A budget's out-of-memory when the last failure that has an error of this rank is one
    /// (a step that gave up), or the step's own error is one (and nothing committed inside it).
    fn is_budget_exceeded(&self) -> bool {
        match self {
            RetryError::GaveUp { failures, .. } => failures
                .iter()
                .rev()
                .find_map(|f| f.error.as_ref())
                .is_some_and(IsOom::is_budget_exceeded),
            RetryError::Step { error, report } => {
                report.nested_commit.is_none() && error.is_budget_exceeded()
            }
            _ => false,
        }
    }
}
