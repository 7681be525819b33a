//! One optimizer step of a tch model over a batch, kept alive through out-of-memory: the batch
//! rerun as micro-batches, libtorch accumulating the weighted gradients, one optimizer step.

use oomguard::retry::{Chunk, RetryEngine};
use oomguard::source::MemorySource;
use tch::{nn, Tensor};

use crate::framework::TchStep;
use crate::quiet_panics::QuietOomPanics;
use crate::Error;

pub use oomguard::train::TrainedStep;

/// Why [`train_step`] failed. Nothing was updated, except after
/// [`TrainStepError::Update`](oomguard::train::TrainStepError::Update) (the optimizer's `step`
/// failed, perhaps after updating some variables). The gradients (`.grad`) of the `VarStore`'s
/// variables (and of the batch's tensors that require one) are reset after any failure, a
/// panic included, so no partial sum is left for a later `optimizer.step()` to apply.
///
/// In-attempt refusals are [`Error`]s inside
/// [`TrainStepError::Retry`](oomguard::train::TrainStepError::Retry): [`Error::Loss`],
/// [`Error::NoGradient`], [`Error::NothingToTrain`], [`Error::NotOptimized`].
pub type TrainStepError = oomguard::train::TrainStepError<Error>;

/// One training step over a batch of tch tensors, kept alive through out-of-memory.
///
/// - `batch`: the batch's tensors (inputs, targets, masks, ...), dimension 0 the row; they must
///   agree on their rows, which is the step's batch. A tensor with autograd history (it
///   requires a gradient and was computed from others, e.g. the model's embedding applied
///   outside `chunk_loss`) is refused ([`TrainStepError::InvalidBatch`](oomguard::train::TrainStepError::InvalidBatch)):
///   a split step backpropagates through it once per chunk, which libtorch refuses. A leaf
///   that requires a gradient (an input gradient) gets the step's, reset with the variables'.
/// - `vs`: the `VarStore` of the model; `optimizer` must be built from it
///   (`nn::Sgd::default().build(&vs, lr)`), else [`Error::NotOptimized`].
/// - `chunk_loss(chunk, rows)`: the loss of one micro-batch, given its rows of each of `batch`'s
///   tensors in order (`narrow` on dimension 0). **It must be the chunk's per-row mean loss**
///   (one value: a sum makes the update depend on the split, and more than one value is
///   [`Error::Loss`]), and must not use statistics of the whole batch (BatchNorm in training
///   mode, in-batch negatives), which no split computes exactly. Its error type is this crate's
///   [`Error`], so that `?` takes both tch's `TchError` and oomguard's errors (a simulated
///   card's out-of-memory in a CPU test, a budget's) and each stays classified.
///
/// Each attempt resets the gradients of the optimizer's variables (libtorch's `zero_grad`)
/// and of the batch's tensors that require one, then for every chunk of the engine's plan (the first attempt:
/// the plan remembered for this call site and source, else the whole batch) runs `chunk_loss`,
/// backpropagates `loss × chunk.weight()` (the chunk's share of the batch; a half-precision loss
/// is cast to `Float` first, so the weight is not rounded to 8 or 11 bits), and reads the loss.
/// libtorch adds each chunk's gradients into `.grad`, so the sum is the gradient of the batch's
/// mean loss, equal to one full-batch backward up to floating-point summation order. Then every
/// variable of `vs` that requires a gradient must have one, else [`Error::NoGradient`] names
/// them.
///
/// **Frozen variables.** A variable needs no gradient when it does not require one: created
/// with `trainable = false` (`zeros_no_train`, `ones_no_train`, BatchNorm's running
/// statistics), or frozen on purpose with `set_requires_grad(false)` (one variable) or
/// `VarStore::freeze` (all). Every other variable of the store must get a gradient, and at
/// least one must require one ([`Error::NothingToTrain`] before the first chunk: a step that
/// trains nothing); a loss that requires no gradient (detached) is [`Error::NoGradient`]
/// naming every trained variable.
///
/// The attempt runs under [`catch_oom`](crate::catch_oom) (and a libtorch error unwrapped by a
/// plain tch method is that error): an out-of-memory returned by an `f_*` method or raised as
/// the panic of a plain one counts. On out-of-memory the attempt's gradients are reset and its
/// tensors dropped, the source's cache emptied, and the attempt reruns with more, smaller
/// micro-batches. The optimizer steps once, after every chunk of one attempt succeeded, and
/// never reruns: its failure is [`TrainStepError::Update`](oomguard::train::TrainStepError::Update),
/// never an out-of-memory for an outer retry. The panic hook stays quiet for the out-of-memory
/// panics caught here (on this thread, during this call; the report lists each attempt's
/// error), so a retried step does not print libtorch's C++ frames for each; every other panic
/// prints as before. Every row contributes to the update, whatever the
/// split: an engine whose policy would drop rows (`inference_policy()`) is refused before
/// anything runs
/// ([`TrainStepError::PolicyDropsRows`](oomguard::train::TrainStepError::PolicyDropsRows)).
/// The step always counts as training for the engine.
///
/// After a successful step the gradients stay in `.grad` (as after a plain
/// `backward`; the next step resets them); after a failed one (an error, or a panic that is not
/// an out-of-memory) they are reset.
///
/// **Only `vs`'s variables and the batch's tensors are reset.** A tensor outside both that the
/// loss depends on and that requires a gradient (a second `VarStore`'s variables, trained by
/// another optimizer) keeps what a failed attempt's chunks added to its `.grad`: its gradient is
/// then not the batch's. Give `train_step` one `VarStore` holding every variable the loss
/// trains.
///
/// Later steps at this call site start from the plan that worked (remembered per call site and
/// memory source). After [`DEFAULT_REGROW_AFTER`](oomguard::retry::DEFAULT_REGROW_AFTER) (100)
/// clean steps in a row at a remembered plan, the engine tries one size up once, so step 101
/// may run out of memory on purpose: it then falls back to the remembered plan in the same call
/// (one more attempt; the report's `regrow` says `succeeded: false`).
/// `RetryEngine::new().regrow_after(None)` turns this off.
///
/// ```
/// use oomguard::RetryEngine;
/// use oomguard_tch::train_step;
/// use tch::nn::{self, Module, OptimizerConfig};
/// use tch::{Device, Kind, Tensor};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let vs = nn::VarStore::new(Device::Cpu);
/// let model = nn::linear(vs.root() / "fc", 4, 1, Default::default());
/// let mut sgd = nn::Sgd::default().build(&vs, 0.01)?;
/// let x = Tensor::randn([8, 4], (Kind::Float, Device::Cpu));
/// let y = Tensor::randn([8, 1], (Kind::Float, Device::Cpu));
/// // A CPU device has no memory source: a simulated 6 MiB card, charged 1 MiB per row.
/// let card = oomguard::Device::sim(oomguard::ByteSize::mib(6));
/// let engine = RetryEngine::new();
/// let done = train_step(&engine, &card, &[&x, &y], &vs, &mut sgd, |chunk, rows| {
///     let _activations = card.alloc::<u8>(chunk.len() << 20)?;
///     Ok(model.forward(&rows[0]).f_mse_loss(&rows[1], tch::Reduction::Mean)?)
/// })?;
/// assert_eq!(done.rows, 8); // every row, though 8 MiB did not fit
/// assert!(done.report.retries() >= 1);
/// # Ok(()) }
/// ```
#[track_caller]
pub fn train_step<S>(
    engine: &RetryEngine,
    source: &S,
    batch: &[&Tensor],
    vs: &nn::VarStore,
    optimizer: &mut nn::Optimizer,
    chunk_loss: impl FnMut(&Chunk, &[Tensor]) -> Result<Tensor, Error>,
) -> Result<TrainedStep, TrainStepError>
where
    S: MemorySource + Clone,
{
    let tensors: Vec<Tensor> = batch.iter().map(|t| t.shallow_clone()).collect();
    let mut step = TchStep::new(vs, optimizer, chunk_loss);
    // The out-of-memory panics caught in the step are the report's attempts: not printed as well.
    let _quiet = QuietOomPanics::enter();
    oomguard::train::train_step(engine, source, &mut step, &tensors[..]).map(|done| done.step)
}
