//! One optimizer step over a batch, kept alive through out-of-memory.

use candle_core::Tensor;
use candle_nn::Optimizer;
use oomguard::retry::{Chunk, RetryEngine};
use oomguard::source::MemorySource;

use crate::framework::CandleStep;
use crate::params::Params;

pub use oomguard::train::TrainedStep;

/// Why [`train_step`] failed (oomguard's shared step error over `candle_core::Error`). Nothing
/// was updated, except after
/// [`TrainStepError::Update`](oomguard::train::TrainStepError::Update).
///
/// [`IsOom`](oomguard::IsOom): an out-of-memory is
/// [`TrainStepError::Retry`](oomguard::train::TrainStepError::Retry) with every plan the policy
/// allows failed ([`RetryError::GaveUp`](oomguard::retry::RetryError::GaveUp)); a budget's one
/// stays a budget's. An update error is never an out-of-memory, whatever its error: the update
/// may have been applied in part, so an outer retry must not run the step again.
pub type TrainStepError = oomguard::train::TrainStepError<candle_core::Error>;

/// One training step over a batch, kept alive through out-of-memory.
///
/// - `batch`: the batch's tensors (inputs, targets, masks, ...), dimension 0 the row; they must
///   agree on their rows, which is the step's batch. Data that is not a tensor can be indexed
///   through one (`Tensor::arange(0u32, n, &dev)`).
/// - `params`: every variable the optimizer updates (a `&Var`, a slice of `Var`s, a `&VarMap`, or
///   [`Params`] with frozen ones). Each must receive a gradient, and every float variable the
///   loss depends on must be listed: see [`GradAccumulator`](crate::GradAccumulator). At least
///   one must be trained (none, or all frozen, is refused before the first chunk). They must be
///   the variables `optimizer` was built with: candle's `Optimizer` does not say which it
///   holds, so an optimizer over other variables is not detected (its step changes none of
///   `params`).
/// - `chunk_loss(chunk, rows)`: the loss of one micro-batch, given its rows of each of
///   `batch`'s tensors in order. **It must be the chunk's per-row mean loss** (a scalar: a sum
///   makes the update depend on the split), and must not use statistics of the whole batch
///   (BatchNorm, in-batch negatives), which no split computes exactly.
///
/// Each attempt runs `chunk_loss` for every chunk of the engine's plan (the first attempt: the
/// plan remembered for this call site and source, else the whole batch), backpropagating each
/// chunk's loss and weighting its gradients by its share of the batch ([`GradAccumulator`](crate::GradAccumulator)).
/// On OOM the attempt's tensors are dropped, the source's cache emptied, and the attempt reruns
/// with more, smaller micro-batches. The optimizer steps once, on the summed gradients, after
/// every chunk succeeded, and never reruns. Every row contributes to the update, whatever the
/// split: an engine whose policy would drop rows (`inference_policy()`) is refused
/// ([`TrainStepError::PolicyDropsRows`](oomguard::train::TrainStepError::PolicyDropsRows)), and any plan with fewer rows a policy still proposes
/// is refused when proposed (the step gives up). The step always counts as training for the
/// engine (candle has no grad mode): remembered batch caps never apply.
///
/// Later steps at this call site start from the plan that worked (remembered per call site and
/// memory source). After [`DEFAULT_REGROW_AFTER`](oomguard::retry::DEFAULT_REGROW_AFTER) (100)
/// clean steps in a row at a remembered plan, the engine tries one size up once, so step 101
/// may run out of memory on purpose: it then falls back to the remembered plan in the same call
/// (one more attempt; the report's `regrow` says `succeeded: false`), and the wait doubles after
/// each failed try. `RetryEngine::new().regrow_after(None)` turns this off.
///
/// To start from the largest batch that fits rather than fail down to it, seed the engine from
/// [`find_max_batch_train`](crate::find_max_batch_train), which measures this step's own
/// attempt: `RetryEngine::new().start_from_finder(&found)`.
#[track_caller]
pub fn train_step<S, O>(
    engine: &RetryEngine,
    source: &S,
    batch: &[&Tensor],
    params: impl Into<Params>,
    optimizer: &mut O,
    chunk_loss: impl FnMut(&Chunk, &[Tensor]) -> candle_core::Result<Tensor>,
) -> Result<TrainedStep, TrainStepError>
where
    S: MemorySource + Clone,
    O: Optimizer,
{
    let tensors: Vec<Tensor> = batch.iter().map(|t| (*t).clone()).collect();
    let mut step = CandleStep {
        params: params.into(),
        chunk_loss,
        optimizer,
    };
    oomguard::train::train_step(engine, source, &mut step, &tensors[..]).map(|done| done.step)
}
