//! What a step returns: its value with the report ([`Retried`]), or why it did not complete
//! ([`RetryError`]).

use std::fmt;

use crate::retry::classify::IsOom;
use crate::retry::consensus::ConsensusError;
use crate::retry_report::{held_path, message_line, BatchPlan, RetryReport, StopReason};

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
///
/// # One shape for "gave up"
///
/// A step that ran out of memory at every plan its policy allowed ends with two things: the
/// last error of this rank and the report of every attempt. Whatever the type that carries
/// them, they are the same and read the same:
///
/// - [`RetryError::GaveUp`], here: the engine's form, for any error type (every failed
///   attempt, with a `None` error for an attempt where only another rank ran out of memory);
///   [`RetryError::last_error`] is its last error, [`RetryError::report`] its report.
/// - [`Error::RetriesExhausted`](crate::Error::RetriesExhausted), oomguard's own error:
///   [`RetryError::into_error`] turns a `GaveUp` of [`Error`](crate::Error) into exactly
///   `RetriesExhausted { error: last error, report }` (the report, whose last attempt's error
///   text is then the `error` itself). That is what `#[oom_retry]` returns; other error types
///   get the report where they can carry it ([`IsOom::with_retry_report`]).
/// - [`TrainStepError::Retry`](crate::train::TrainStepError::Retry) of the framework crates'
///   `train_step`s holds this `RetryError` unchanged.
///
/// All three classify alike ([`IsOom`]): an out-of-memory, whose request and memory in use
/// ([`IsOom::oom_request`], [`IsOom::oom_in_use`]) and budget (`is_budget_exceeded`) are the
/// last error's.
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
    /// Another rank failed (with a non-OOM error, or gave up); this rank stopped with it. An
    /// out-of-memory ([`IsOom`]) when the peer gave up for lack of memory
    /// ([`StopReason::PeerGaveUp`] in the report's `stopped`), as the peer's own
    /// [`RetryError::GaveUp`] is: every rank's caller sees the same kind of failure.
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

    /// The step's own error, as [`RetryError::into_error`] gives it back (before the report
    /// is attached): the error of a [`RetryError::Step`], or the last error of this rank of a
    /// step that [gave up](RetryError::GaveUp). `None` when this rank had no error of its own.
    pub fn last_error(&self) -> Option<&E> {
        match self {
            RetryError::Step { error, .. } => Some(error),
            RetryError::GaveUp { failures, .. } => {
                failures.iter().rev().find_map(|f| f.error.as_ref())
            }
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
                    None => {
                        write!(
                            f,
                            "out of memory at {} after {} attempts; the policy allows nothing \
                             smaller",
                            report.site,
                            failures.len()
                        )?;
                        // the smallest plan's request alone passed the whole: say what to raise
                        if let Some(a) = report.attempts.last() {
                            if let Some(r) = a.too_large {
                                let raise = if r.budget {
                                    "raise the budget"
                                } else {
                                    "it needs a larger device"
                                };
                                write!(f, ", and its last plan made {r}: {raise}")?;
                                if a.plan.micro_batch() > 1 {
                                    // a policy that stops before splitting (a same-plan retry
                                    // alone) never tried smaller micro-batches
                                    write!(
                                        f,
                                        ", or a policy that splits the batch into smaller \
                                         micro-batches (its plan had {} rows at once)",
                                        a.plan.micro_batch()
                                    )?;
                                }
                            }
                        }
                    }
                }
                if report.may_leak() {
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
                write!(
                    f,
                    "another rank failed during the step at {}; stopped with it",
                    report.site
                )?;
                match &report.stopped {
                    Some(why) => write!(f, ": {why}"),
                    None => Ok(()),
                }
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
            // a peer's out-of-memory give-up: every rank's caller sees an out-of-memory
            RetryError::PeerFailed { report } => report.stopped == Some(StopReason::PeerGaveUp),
            // after a nested commit: never retryable
            RetryError::Step { error, report } => report.nested_commit.is_none() && error.is_oom(),
            _ => false,
        }
    }
    /// A budget's out-of-memory when the last failure that has an error of this rank is one
    /// (a step that gave up), or the step's own error is one (and nothing committed inside it).
    fn is_budget_exceeded(&self) -> bool {
        self.retryable_error()
            .is_some_and(IsOom::is_budget_exceeded)
    }
    /// The last error's, as [`Error::RetriesExhausted`](crate::Error::RetriesExhausted) says.
    fn oom_request(&self) -> Option<crate::retry_report::OomRequest> {
        self.retryable_error().and_then(IsOom::oom_request)
    }
    /// The last error's, as [`Error::RetriesExhausted`](crate::Error::RetriesExhausted) says.
    fn oom_in_use(&self) -> Option<u64> {
        self.retryable_error().and_then(IsOom::oom_in_use)
    }
}

impl<E> RetryError<E> {
    /// The error whose figures the step's classification reports: the last error of a step
    /// that gave up, or the error of a step that failed with nothing committed inside it.
    fn retryable_error(&self) -> Option<&E> {
        match self {
            RetryError::Step { report, .. } if report.nested_commit.is_some() => None,
            _ => self.last_error(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::retry::RetryEngine;
    use crate::train::TrainStepError;
    use crate::{ByteSize, Device, Error};

    /// A step that asks for more than the whole card at every plan: it gives up.
    fn gave_up() -> RetryError<Error> {
        let dev = Device::sim(ByteSize::mib(64));
        RetryEngine::new()
            .run(&dev, 8, |_| dev.alloc::<u8>(128 << 20).map(drop), |()| ())
            .unwrap_err()
    }

    #[test]
    fn every_shape_of_gave_up_carries_the_same_error_and_report() {
        let e = gave_up();
        assert!(matches!(e, RetryError::GaveUp { .. }));
        let report = e.report().unwrap().clone();
        let last = e.last_error().unwrap().to_string();
        let request = e.oom_request();
        assert_eq!(request.map(|r| r.requested), Some(128 << 20));
        assert!(e.oom_in_use().is_some());

        // the framework crates' form holds it unchanged, and classifies alike
        let train = TrainStepError::Retry(gave_up());
        assert!(train.is_oom());
        assert_eq!(train.oom_request(), request);

        // oomguard's own error: exactly `RetriesExhausted { last error, report }`
        let Some(Error::RetriesExhausted { error, report: r }) = e.into_error() else {
            panic!("a step that gave up is `Error::RetriesExhausted`");
        };
        assert_eq!(error.to_string(), last);
        assert_eq!(r.attempts.len(), report.attempts.len());
        assert_eq!(r.final_plan, report.final_plan);
        assert_eq!(r.stopped, report.stopped);
        let converted = Error::RetriesExhausted { error, report: r };
        assert!(converted.is_oom());
        assert_eq!(IsOom::oom_request(&converted), request);
    }
}
