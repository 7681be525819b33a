//! A burn training step kept alive through out-of-memory: exact gradient accumulation over the
//! micro-batches of a [`BatchPlan`], one optimizer step after all of them succeeded.

use std::fmt;
use std::marker::PhantomData;

use burn::module::AutodiffModule;
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;
use oomguard::retry::{Chunk, RetryEngine};
use oomguard::source::MemorySource;
use oomguard::train::{keep_rows, one_value, LossSum, StepFailure, KEEP_ROWS_HINT};

use crate::compat;
use crate::framework::BurnStep;
use crate::{catch_oom, Error};

/// Sums the gradients of the micro-batches of one attempt (burn's `GradientsAccumulator`):
/// each chunk's mean loss is multiplied by the chunk's share of the batch (`len / batch`, in f32
/// or wider: a half-precision loss is cast to f32 first) before `backward`, so the sum is the
/// gradient of the batch's mean loss, equal to one full-batch backward up to floating-point
/// summation order.
///
/// [`GradAccumulator::backward`] reads the weighted loss and synchronises the device, so an
/// out-of-memory of that micro-batch's forward or backward surfaces there, inside the attempt.
pub struct GradAccumulator<B: AutodiffBackend, M> {
    sum: compat::Summed<M>,
    losses: LossSum,
    pub(crate) device: Option<B::Device>,
}

impl<B: AutodiffBackend, M: AutodiffModule<B>> Default for GradAccumulator<B, M> {
    fn default() -> Self {
        Self::new()
    }
}

impl<B: AutodiffBackend, M> fmt::Debug for GradAccumulator<B, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GradAccumulator")
            .field("loss", &self.losses.loss())
            .field("rows", &self.losses.rows())
            .finish_non_exhaustive()
    }
}

impl<B: AutodiffBackend, M: AutodiffModule<B>> GradAccumulator<B, M> {
    /// An empty accumulator.
    pub fn new() -> Self {
        Self {
            sum: compat::Summed::new(),
            losses: LossSum::new(),
            device: None,
        }
    }

    /// Backpropagates `chunk_loss` (the chunk's *mean* loss, one element) weighted by
    /// `chunk.weight()`, adds the parameters' gradients, then reads the weighted loss and
    /// synchronises the device (so that an error of this micro-batch is returned here). An
    /// error after the gradients were added (the read, the synchronisation, a NaN loss) leaves
    /// the accumulator refusing every later call: start a new one.
    pub fn backward(
        &mut self,
        model: &M,
        chunk_loss: Tensor<B, 1>,
        chunk: &Chunk,
    ) -> Result<(), Error> {
        self.losses.check_usable().map_err(Error::Loss)?;
        one_value(
            chunk_loss.shape().num_elements(),
            &chunk_loss.dims(),
            chunk.rows(),
            "`loss.mean()`",
        )
        .map_err(Error::Loss)?;
        self.losses.admit(chunk).map_err(Error::Rows)?;
        let device = chunk_loss.device();
        let weighted = compat::weighted_loss(chunk_loss, chunk.weight());
        let grads = compat::backward(&weighted, model);
        // A loss of another model (or of none) gives `model` no gradient at all: its chunk would
        // be dropped from the sum without a word (candle's accumulator, tied to its variables,
        // refuses such a loss).
        if grads.is_empty() && compat::trainable::<B, M>(model).trainable > 0 {
            return Err(Error::Loss(format!(
                "the loss of rows {:?} reached none of the model's trained parameters: it was \
                 computed from another model (or from none: a constant); each chunk's loss \
                 must come from the `model` given to `backward`",
                chunk.rows()
            )));
        }
        self.sum.add(model, grads);
        let read = (|| -> Result<f64, Error> {
            let value = compat::read_f64(weighted)?;
            compat::sync::<B>(&device)?;
            // (the weighted value is finite exactly when the chunk's mean loss is)
            oomguard::train::finite_loss(chunk, value).map_err(Error::Loss)?;
            Ok(value)
        })();
        let value = match read {
            Ok(value) => value,
            Err(e) => {
                self.losses.fail_after_gradients(&e);
                return Err(e);
            }
        };
        self.device = Some(device);
        self.losses.add_weighted(chunk, value);
        Ok(())
    }

    /// The batch's mean loss so far (the weighted sum of the chunks' mean losses, in f64).
    pub fn loss(&self) -> f64 {
        self.losses.loss()
    }

    /// Rows backpropagated so far.
    pub fn rows(&self) -> usize {
        self.losses.rows()
    }

    /// The summed gradients, for `Optimizer::step`. [`Error::Rows`]: the chunks backpropagated
    /// do not cover the batch, every row exactly once (a chunk twice, one left out).
    /// [`Error::NoGradient`] names every float parameter of `model` that requires a gradient
    /// and got none.
    pub fn into_grads(self, model: &M) -> Result<GradientsParams, Error> {
        self.losses.check_usable().map_err(Error::Loss)?;
        self.losses.covers_batch().map_err(Error::Rows)?;
        let grads = self.sum.take();
        let missing = compat::missing_gradients(model, &grads);
        if missing.is_empty() {
            Ok(grads)
        } else {
            Err(Error::NoGradient { params: missing })
        }
    }
}

pub use oomguard::train::TrainedStep;

/// Why [`train_step`] failed: oomguard's one training-step error, with burn's [`Error`]. The
/// model is unchanged in every case:
/// - [`Retry`](oomguard::train::TrainStepError::Retry): the micro-batches failed, not with an
///   out-of-memory (a refusal of [`Error`] included), or with one at the smallest plan (the
///   report is inside);
/// - [`PolicyDropsRows`](oomguard::train::TrainStepError::PolicyDropsRows): the engine's policy
///   would train on part of the batch after an out-of-memory (`Shrink`); refused before anything
///   ran;
/// - [`Update`](oomguard::train::TrainStepError::Update): the optimizer update failed (an
///   out-of-memory included), not retried. The model keeps its parameters, but the optimizer's
///   state may be partly advanced or partly lost: burn 0.21's optimizer adaptor takes a
///   parameter's state (e.g. AdamW's moments) out of its map while it updates that parameter, so
///   a failure drops the states it had taken (on an H100 a failed step left 0.3–0.5 GiB less
///   optimizer state; docs/GPU.md run 19). To resume exactly, keep `Optimizer::to_record()` from
///   before the step (it holds the previous state's tensors alive, so it costs that much memory)
///   and `load_record` it after this error;
/// - [`Parameters`](oomguard::train::TrainStepError::Parameters): the model's lazy parameters
///   could not be initialised before the first attempt (burn creates a parameter's tensor on its
///   first use; `train_step` does that first, as splitting the batch cannot make parameters
///   smaller). Nothing ran and `*model` is unchanged: its lazy parameters are still lazy (they
///   are initialised on a clone that replaces the model only on success), so after an
///   out-of-memory a later call, with memory freed, initialises them.
///   [`Error::BrokenParameters`]: an initialisation that ran out of memory *outside*
///   `train_step` (a forward in `find_max_batch` or your own code) left parameters burn cannot
///   initialise any more; build the model again (or load a record into a new one).
///
/// An outer retry may rerun only a `Retry` that ran out of memory at every plan
/// ([`IsOom`](oomguard::IsOom), the rule every framework shares); the source of an `Update` is the
/// [`UpdateApplied`](oomguard::retry::UpdateApplied) mark, so a boxed `dyn Error` (or
/// `chain_is_oom`) says no too.
pub type TrainStepError = oomguard::train::TrainStepError<Error>;

/// One training step over `batch` rows, kept alive through out-of-memory.
///
/// Each attempt runs `chunk_loss(model, chunk)` for every chunk of the engine's plan (the
/// first attempt: the plan remembered for this call site and source, else the whole batch) and
/// backpropagates each chunk's mean loss weighted by its share of the batch
/// ([`GradAccumulator`]); the attempt runs under [`catch_oom`], so cubecl's out-of-memory
/// panics count as out-of-memory. On out-of-memory the attempt's tensors are dropped, the
/// source's cache emptied, and the attempt reruns with more, smaller micro-batches. Then, once,
/// the optimizer steps on the summed gradients (`lr`), and `*model` becomes the updated model.
///
/// Refused (not retried, no update): a tensor sliced with [`chunk_rows`](crate::chunk_rows)
/// whose rows are not `batch` ([`Error::Rows`]), an engine whose policy would drop rows after an
/// out-of-memory
/// ([`TrainStepError::PolicyDropsRows`](oomguard::train::TrainStepError::PolicyDropsRows),
/// before anything runs; a policy that proposes such a plan only later makes the step give up
/// instead), a model none of whose float parameters requires a gradient
/// ([`Error::NothingToTrain`], before the first chunk), a loss that is not one finite value
/// ([`Error::Loss`]), and float parameters that require a gradient and got none
/// ([`Error::NoGradient`]).
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
#[allow(clippy::too_many_arguments)]
pub fn train_step<B, M, O, S>(
    engine: &RetryEngine,
    source: &S,
    batch: usize,
    model: &mut M,
    optimizer: &mut O,
    lr: f64,
    mut chunk_loss: impl FnMut(&M, &Chunk) -> Result<Tensor<B, 1>, Error>,
) -> Result<TrainedStep, TrainStepError>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    O: Optimizer<M, B>,
    S: MemorySource + Clone,
{
    // Lazy parameters are created before any attempt (an out-of-memory there would leave them
    // unallocated for good, whatever the retries), on a clone: see compat::materialize.
    if let Err(error) = catch_oom(|| compat::materialize::<B, M>(&mut *model)) {
        return Err(TrainStepError::Parameters(error));
    }
    // A policy that would drop rows is refused before anything runs (oomguard's shared rule);
    // the engine's policy is wrapped so that a later change of mind is refused too.
    let engine = keep_rows(engine, batch, KEEP_ROWS_HINT)?;
    let mut step = BurnStep {
        model: &*model,
        chunk_loss: |m: &M, c: &Chunk, _: &()| chunk_loss(m, c),
        optimizer,
        lr,
        batch: PhantomData,
    };
    let done =
        oomguard::train::train_step_kept(&engine, source, &mut step, &(), batch).map_err(|e| {
            match e {
                StepFailure::Retry(e) => TrainStepError::Retry(e),
                StepFailure::Update { error, report } => TrainStepError::Update { error, report },
            }
        })?;
    *model = done.updated;
    Ok(done.step)
}
