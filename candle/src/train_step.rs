//! One optimizer step over a batch, kept alive through out-of-memory.

use std::fmt;

use candle_core::Tensor;
use candle_nn::Optimizer;
use oomguard::retry::{
    BatchPlan, Chunk, KeepsRows, Pressure, RetryContext, RetryEngine, RetryError, RetryPolicy,
    RetryReport, StepMode, MAX_ATTEMPTS,
};
use oomguard::source::MemorySource;
use oomguard::IsOom;

use crate::accumulator::GradAccumulator;
use crate::params::Params;

/// What [`train_step`] did.
#[derive(Debug)]
pub struct TrainedStep {
    /// The batch's mean loss (weighted sum of the chunks' mean losses).
    pub loss: f64,
    /// Rows that contributed to the update: always the whole batch.
    pub rows: usize,
    /// How the step went: plans tried, retries, the plan that worked.
    pub report: RetryReport,
}

/// Why [`train_step`] failed. Nothing was updated, except after [`TrainStepError::Update`].
///
/// [`IsOom`]: an out-of-memory is [`TrainStepError::Retry`] with every plan the policy allows
/// failed ([`RetryError::GaveUp`]); a budget's one stays a budget's. An [`Update`](TrainStepError::Update)
/// is never an out-of-memory, whatever its error: the update may have been applied in part, so
/// an outer retry must not run the step again.
#[derive(Debug)]
pub enum TrainStepError {
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
    /// or OOM at the smallest plan the policy allows (the report is inside).
    Retry(RetryError<candle_core::Error>),
    /// The optimizer update failed. It is not retried (it runs once, after every micro-batch of
    /// one attempt succeeded, and may have updated some parameters already).
    Update {
        /// The optimizer's error.
        error: candle_core::Error,
        /// How the micro-batches went.
        report: Box<RetryReport>,
    },
}

impl fmt::Display for TrainStepError {
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
                 it was not retried, parameters may be partly updated: {error}",
                report.retries()
            ),
        }
    }
}

impl std::error::Error for TrainStepError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            TrainStepError::Retry(e) => Some(e),
            TrainStepError::Update { error, .. } => Some(error),
            _ => None,
        }
    }
}

impl IsOom for TrainStepError {
    fn is_oom(&self) -> bool {
        match self {
            TrainStepError::Retry(e) => e.is_oom(),
            // Never retryable: the update may have been applied in part.
            _ => false,
        }
    }
    fn is_budget_exceeded(&self) -> bool {
        match self {
            TrainStepError::Retry(RetryError::GaveUp { failures, .. }) => failures
                .iter()
                .rev()
                .find_map(|f| f.error.as_ref())
                .is_some_and(IsOom::is_budget_exceeded),
            _ => false,
        }
    }
}

/// The rows of `batch`'s tensors: all must have the same size of dimension 0.
fn batch_rows(batch: &[&Tensor]) -> Result<usize, TrainStepError> {
    let Some(first) = batch.first() else {
        return Err(TrainStepError::InvalidBatch(
            "no tensor given for the batch: pass the batch's tensors (e.g. `&[&x, &y]`), \
             whose dimension 0 is the row"
                .into(),
        ));
    };
    let rows_of = |t: &Tensor| t.dims().first().copied();
    let Some(rows) = rows_of(first) else {
        return Err(TrainStepError::InvalidBatch(
            "the batch's first tensor is a scalar: dimension 0 must be the row".into(),
        ));
    };
    for (i, t) in batch.iter().enumerate() {
        if rows_of(t) != Some(rows) {
            return Err(TrainStepError::InvalidBatch(format!(
                "the batch's tensors disagree on their rows (dimension 0): tensor 0 has shape \
                 {:?}, tensor {i} has shape {:?}",
                first.dims(),
                t.dims()
            )));
        }
    }
    Ok(rows)
}

/// The first plan with fewer rows than `batch` that `policy` proposes after repeated OOMs (or
/// budget overruns) starting from the whole batch, as the engine would follow it: policies
/// depend only on their context, so this finds a row-dropping policy before a real OOM does.
fn drops_rows(policy: &dyn RetryPolicy, batch: usize) -> Option<BatchPlan> {
    let whole = BatchPlan::whole(batch).ok()?;
    for pressure in [Pressure::Oom, Pressure::Budget] {
        let mut plan = whole;
        for attempt in 1..=MAX_ATTEMPTS {
            let ctx = RetryContext::new(plan, batch, attempt, pressure);
            let Some(next) = policy.next_plan(&ctx) else {
                break;
            };
            if next.batch() < batch {
                return Some(next);
            }
            if !next.fits_within(&plan) {
                break; // the engine would give up here too
            }
            plan = next;
        }
    }
    None
}

/// One training step over a batch, kept alive through out-of-memory.
///
/// - `batch`: the batch's tensors (inputs, targets, masks, ...), dimension 0 the row; they must
///   agree on their rows, which is the step's batch. Data that is not a tensor can be indexed
///   through one (`Tensor::arange(0u32, n, &dev)`).
/// - `params`: every variable the optimizer updates (a `&Var`, a slice of `Var`s, a `&VarMap`, or
///   [`Params`] with frozen ones). Each must receive a gradient, and every float variable the
///   loss depends on must be listed: see [`GradAccumulator`].
/// - `chunk_loss(chunk, rows)`: the loss of one micro-batch, given its rows of each of
///   `batch`'s tensors in order. **It must be the chunk's per-row mean loss** (a scalar: a sum
///   makes the update depend on the split), and must not use statistics of the whole batch
///   (BatchNorm, in-batch negatives), which no split computes exactly.
///
/// Each attempt runs `chunk_loss` for every chunk of the engine's plan (the first attempt: the
/// plan remembered for this call site and source, else the whole batch), backpropagating each
/// chunk's loss and weighting its gradients by its share of the batch ([`GradAccumulator`]).
/// On OOM the attempt's tensors are dropped, the source's cache emptied, and the attempt reruns
/// with more, smaller micro-batches. The optimizer steps once, on the summed gradients, after
/// every chunk succeeded, and never reruns. Every row contributes to the update, whatever the
/// split: an engine whose policy would drop rows (`inference_policy()`) is refused
/// ([`TrainStepError::PolicyDropsRows`]), and any plan with fewer rows a policy still proposes
/// is refused when proposed (the step gives up). The step always counts as training for the
/// engine (candle has no grad mode): remembered batch caps never apply.
///
/// Later steps at this call site start from the plan that worked (remembered per call site and
/// memory source). After [`DEFAULT_REGROW_AFTER`](oomguard::retry::DEFAULT_REGROW_AFTER) (100)
/// clean steps in a row at a remembered plan, the engine tries one size up once, so step 101
/// may run out of memory on purpose: it then falls back to the remembered plan in the same call
/// (one more attempt; the report's `regrow` says `succeeded: false`), and the wait doubles after
/// each failed try. `RetryEngine::new().regrow_after(None)` turns this off.
#[track_caller]
pub fn train_step<S, O>(
    engine: &RetryEngine,
    source: &S,
    batch: &[&Tensor],
    params: impl Into<Params>,
    optimizer: &mut O,
    mut chunk_loss: impl FnMut(&Chunk, &[Tensor]) -> candle_core::Result<Tensor>,
) -> Result<TrainedStep, TrainStepError>
where
    S: MemorySource + Clone,
    O: Optimizer,
{
    let rows = batch_rows(batch)?;
    let policy = engine.policy();
    if let Some(proposed) = drops_rows(&*policy, rows) {
        return Err(TrainStepError::PolicyDropsRows {
            policy: format!("{policy:?}"),
            proposed,
            batch: rows,
        });
    }
    // The same engine (remembered plans, consensus, regrow), its policy unable to drop rows.
    let engine = engine
        .clone()
        .with_policy(KeepsRows::new(policy).hint(
            "train_step needs a policy that keeps every row: `training_policy()` or an \
             `Accumulate` chain",
        ))
        .with_mode_hook(|| StepMode::Train);
    let params = params.into();
    let retried = engine
        .run(
            source,
            rows,
            |plan: &BatchPlan| -> candle_core::Result<_> {
                let mut acc = GradAccumulator::new(&params);
                for c in plan.chunks() {
                    let chunk_rows = batch
                        .iter()
                        .map(|t| crate::rows::chunk_rows(t, &c))
                        .collect::<candle_core::Result<Vec<_>>>()?;
                    let loss = chunk_loss(&c, &chunk_rows)?;
                    acc.backward(&loss, &c)?;
                }
                let (loss, rows) = (acc.loss(), acc.rows());
                Ok((acc.into_grads()?, loss, rows))
            },
            |(grads, loss, rows)| optimizer.step(&grads).map(|()| (loss, rows)),
        )
        .map_err(TrainStepError::Retry)?;
    match retried.value {
        Ok((loss, rows)) => Ok(TrainedStep {
            loss,
            rows,
            report: retried.report,
        }),
        Err(error) => Err(TrainStepError::Update {
            error,
            report: Box::new(retried.report),
        }),
    }
}
