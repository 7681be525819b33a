//! Why a training step failed, and which failures an outer retry may rerun.

use std::fmt;

use super::DropsRows;
use crate::retry::advanced::{OomRequest, UpdateApplied};
use crate::retry::{BatchPlan, IsOom, RetryError, RetryReport};

/// Why a `train_step` failed (oomguard-candle's, oomguard-burn's and oomguard-tch's, each an
/// alias with `E` the framework crate's error). Nothing was updated, except after
/// [`TrainStepError::Update`].
///
/// [`IsOom`]: an out-of-memory is [`TrainStepError::Retry`] with every plan the policy allows
/// failed ([`RetryError::GaveUp`]); a budget's one stays a budget's (the last failure's). An
/// [`Update`](TrainStepError::Update) is never an out-of-memory, whatever its error: the update
/// may have been applied in part, so an outer retry must not run the step again. Every route
/// agrees: its `source()` is the [`UpdateApplied`] mark (not the optimizer's error, which is in
/// the variant and the message), so [`chain_is_oom`](crate::retry::chain_is_oom), a boxed
/// `dyn Error` and an `anyhow::Error` say no too.
#[derive(Debug)]
pub enum TrainStepError<E> {
    /// The batch's tensors are not a batch: none given, a scalar, or different numbers of rows.
    InvalidBatch(String),
    /// The engine's retry policy runs fewer rows than the batch after an OOM (e.g.
    /// `inference_policy()`), so a step would train on part of the batch: refused before
    /// running anything. Use `training_policy()` or an `Accumulate` chain.
    PolicyDropsRows {
        /// The policy, as `Debug` prints it.
        policy: String,
        /// The plan it proposes after OOMs, with fewer rows than the batch.
        proposed: BatchPlan,
        /// The batch's rows.
        batch: usize,
    },
    /// The micro-batches failed: not an OOM (a shape error, a variable without gradient, ...),
    /// or OOM at the smallest plan the policy allows (the report is inside): a step that gave
    /// up is [`RetryError::GaveUp`] here as everywhere (see [`RetryError`]).
    Retry(RetryError<E>),
    /// The optimizer update failed. It is not retried (it runs once, after every micro-batch of
    /// one attempt succeeded, and may have updated some parameters already).
    Update {
        /// The optimizer's error.
        error: E,
        /// How the micro-batches went.
        report: Box<RetryReport>,
    },
    /// The model's parameters could not be made ready before the first attempt, so nothing ran
    /// (oomguard-burn: burn creates a parameter's tensor on its first use, and `train_step`
    /// creates them first, on a copy of the model that replaces it only on success). Not
    /// retried, and no route calls it an out-of-memory, whatever its error (its `source()` is
    /// none; the error is here and in the message): a smaller batch cannot make parameters
    /// smaller. oomguard-candle's and oomguard-tch's steps never return it (their parameters
    /// exist before the step).
    Parameters(E),
}

impl<E> From<DropsRows> for TrainStepError<E> {
    fn from(d: DropsRows) -> Self {
        TrainStepError::PolicyDropsRows {
            policy: d.policy,
            proposed: d.proposed,
            batch: d.batch,
        }
    }
}

impl<E: fmt::Display> fmt::Display for TrainStepError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TrainStepError::InvalidBatch(m) => write!(f, "train_step: {m}"),
            TrainStepError::PolicyDropsRows {
                policy,
                proposed,
                batch,
            } => write!(
                f,
                "train_step: the engine's retry policy {policy} proposes {proposed} after an \
                 out-of-memory, fewer rows than the batch of {batch}: a training step never \
                 drops rows (it would train on part of the batch). Use `training_policy()` \
                 (the default of `RetryEngine::new()`) or an `Accumulate` chain"
            ),
            TrainStepError::Retry(e) => write!(f, "{e}"),
            TrainStepError::Update { error, report } => write!(
                f,
                "the optimizer update failed after the micro-batches succeeded ({} retries); \
                 it was not retried. An optimizer that updates in place (candle, tch) may have \
                 updated part of the parameters; with burn's, which returns a new model, the \
                 model is unchanged, but the optimizer's state may be partly advanced or lost. \
                 To resume exactly, restore the parameters and the optimizer's state from a \
                 copy taken before the step: {error}",
                report.retries()
            ),
            TrainStepError::Parameters(e) => write!(
                f,
                "the model's parameters could not be initialised before the step (nothing ran, \
                 the model is unchanged): {e}"
            ),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for TrainStepError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            TrainStepError::Retry(e) => Some(e),
            // The optimizer's error may be an out-of-memory: a walk of the chain must stop at
            // the mark, not find it and call the step retryable.
            TrainStepError::Update { .. } => Some(&UpdateApplied),
            // As for an update: no walk of the chain may find the error's out-of-memory and
            // call the step retryable (the error is in the variant and the message).
            _ => None,
        }
    }
}

impl<E: IsOom> IsOom for TrainStepError<E> {
    fn is_oom(&self) -> bool {
        match self {
            TrainStepError::Retry(e) => e.is_oom(),
            // Never retryable: the update may have been applied in part.
            _ => false,
        }
    }
    fn is_budget_exceeded(&self) -> bool {
        match self {
            TrainStepError::Retry(e) => e.is_budget_exceeded(),
            _ => false,
        }
    }
    fn oom_request(&self) -> Option<OomRequest> {
        match self {
            TrainStepError::Retry(e) => e.oom_request(),
            _ => None,
        }
    }
    fn oom_in_use(&self) -> Option<u64> {
        match self {
            TrainStepError::Retry(e) => e.oom_in_use(),
            _ => None,
        }
    }
}
