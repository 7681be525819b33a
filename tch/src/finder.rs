//! `find_max_batch` on a tch step: the runtime's finder, with each run under [`catch_oom`];
//! `find_max_batch_train`, the finder over [`train_step`](crate::train_step)'s own attempt.

use oomguard::retry::{Chunk, FinderError, FinderOptions, FinderReport};
use oomguard::source::MemorySource;
use oomguard::train::SliceBatch;
use tch::{nn, Tensor};

use crate::framework::TchStep;
use crate::quiet_panics::QuietOomPanics;
use crate::{catch_oom, Error};

/// The largest batch for which `step(rows)` runs without out-of-memory on `source`
/// ([`oomguard::retry::find_max_batch`]: two measured runs, a linear fit of peak memory, a
/// jump; at most 4 runs when memory is affine in the batch). Each run is under [`catch_oom`], so
/// a libtorch out-of-memory raised as the panic of a plain tch method is a failed run, not a
/// crash; an `f_*` method's is returned through `?`. The panic hook stays quiet for those
/// out-of-memory panics (on this thread, during this call): a search that fails a dozen runs
/// prints nothing for them; the report's runs say which failed. Every other panic prints. The step should do what a training step
/// does (forward, backward, optimizer), keep nothing between calls, and read something it
/// computed (e.g. the loss with `f_double_value`) so that its errors surface.
///
/// **It trains the model it measures**: every trial runs real steps, optimizer update included
/// (2 per trial, then 32 or more to verify the batch found; [`FinderReport::step_runs`] counts
/// them), so the variables and the optimizer's state change. Measure on a copy
/// (`VarStore::copy` into a second store with its own optimizer), or save the store
/// (`VarStore::save`) and load it back after. Start [`train_step`](crate::train_step) from the
/// batch found with
/// [`RetryEngine::start_from_finder`](oomguard::retry::RetryEngine::start_from_finder).
///
/// **To seed [`train_step`](crate::train_step), prefer [`find_max_batch_train`]**: it measures
/// the attempt `train_step` runs (the batch held, gradients reset, `loss × weight`
/// backpropagated) rather than a step written by hand, which may need less memory than that
/// attempt: a loop seeded from it then retries.
///
/// ```
/// use oomguard::retry::FinderOptions;
/// use oomguard_tch::find_max_batch;
/// use tch::{Device, Kind, Tensor};
///
/// // A simulated 64 MiB card, 1 MiB of activations per row: about 64 rows fit.
/// let card = oomguard::Device::sim(oomguard::ByteSize::mib(64));
/// let found = find_max_batch(&card, FinderOptions::default(), |rows| {
///     let _activations = card.alloc::<u8>(rows << 20)?;
///     let x = Tensor::f_ones([rows as i64, 4], (Kind::Float, Device::Cpu))?;
///     Ok(x.f_sum(Kind::Float)?.f_double_value(&[])?)
/// })
/// .unwrap();
/// assert!((56..=64).contains(&found.max_batch), "{found}");
/// ```
pub fn find_max_batch<S, T>(
    source: &S,
    opts: FinderOptions,
    mut step: impl FnMut(usize) -> Result<T, Error>,
) -> Result<FinderReport, FinderError<Error>>
where
    S: MemorySource + ?Sized,
{
    let _quiet = QuietOomPanics::enter();
    oomguard::retry::find_max_batch(source, opts, |rows| catch_oom(|| step(rows)))
}

/// The largest batch for which [`train_step`](crate::train_step)'s own attempt fits on
/// `source`: [`oomguard::retry::find_max_batch`] where a run of `rows` rows is exactly the
/// attempt `train_step` runs on a batch of `rows` rows in one pass, with the same `vs`,
/// `optimizer` and `chunk_loss` a training loop gives `train_step`:
/// `make_batch(rows)` makes the batch (its tensors, dimension 0 the row, held for the whole
/// run, as a loop holds its batch), then the optimizer's gradients are reset (set to
/// undefined), `chunk_loss` gives the loss of the one chunk, `loss × weight` is backpropagated
/// (a half-precision loss cast to `Float`), the loss is read, and every variable that requires
/// a gradient must have one ([`Error::NoGradient`]). Seed the loop with
/// [`RetryEngine::start_from_finder`](oomguard::retry::RetryEngine::start_from_finder): its
/// steps of at most `max_batch` rows then run the attempt measured.
///
/// **Nothing is trained**: the optimizer never steps, so the variables and the optimizer's
/// state are as they were (no copy of the model is needed); the gradients are reset (undefined)
/// after each run. So the memory of the optimizer's `step` is not measured: what the step holds
/// from then on (Adam's two moment buffers per variable, made by its first step) is measured
/// only if it exists already: run the finder after the loop's first `train_step` when the
/// optimizer keeps state. A loop whose batch is larger than `max_batch` (split into
/// micro-batches of that size) holds more rows of input than were measured.
///
/// Each run is under the same guard as `train_step`'s attempt: a libtorch out-of-memory (an
/// `f_*` method's, or a plain method's panic, printed by no panic hook) is a failed run; a
/// plain method's other libtorch error is the run's error ([`Error::Torch`]); `make_batch`
/// giving a batch whose rows are not `rows` is [`Error::Batch`].
///
/// ```
/// use oomguard::retry::{FinderOptions, RetryEngine};
/// use oomguard_tch::{find_max_batch_train, train_step};
/// use tch::nn::{self, Module, OptimizerConfig};
/// use tch::{Device, Kind, Tensor};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let vs = nn::VarStore::new(Device::Cpu);
/// let model = nn::linear(vs.root() / "fc", 4, 1, Default::default());
/// let mut sgd = nn::Sgd::default().build(&vs, 0.01)?;
/// let batch = |rows: usize| -> Result<Vec<Tensor>, oomguard_tch::Error> {
///     let x = Tensor::f_randn([rows as i64, 4], (Kind::Float, Device::Cpu))?;
///     let y = Tensor::f_randn([rows as i64, 1], (Kind::Float, Device::Cpu))?;
///     Ok(vec![x, y])
/// };
/// // A simulated 64 MiB card, charged 1 MiB of activations per row of a chunk.
/// let card = oomguard::Device::sim(oomguard::ByteSize::mib(64));
/// let loss = |chunk: &oomguard::retry::Chunk, rows: &[Tensor]| {
///     let _activations = oomguard_tch::charge(&card, chunk.len() << 20)?;
///     Ok(model.forward(&rows[0]).f_mse_loss(&rows[1], tch::Reduction::Mean)?)
/// };
/// let found =
///     find_max_batch_train(&card, FinderOptions::default(), &vs, &mut sgd, batch, loss)?;
/// assert!((56..=64).contains(&found.max_batch), "{found}");
/// let engine = RetryEngine::new().start_from_finder(&found);
/// let b = batch(found.max_batch)?;
/// let done = train_step(&engine, &card, &[&b[0], &b[1]], &vs, &mut sgd, loss)?;
/// assert_eq!(done.report.retries(), 0);
/// # Ok(()) }
/// ```
pub fn find_max_batch_train<S, B>(
    source: &S,
    opts: FinderOptions,
    vs: &nn::VarStore,
    optimizer: &mut nn::Optimizer,
    mut make_batch: impl FnMut(usize) -> Result<B, Error>,
    chunk_loss: impl FnMut(&Chunk, &[Tensor]) -> Result<Tensor, Error>,
) -> Result<FinderReport, FinderError<Error>>
where
    S: MemorySource + ?Sized,
    B: AsRef<[Tensor]>,
{
    let _quiet = QuietOomPanics::enter();
    let mut step = TchStep::new(vs, optimizer, chunk_loss);
    // A split step holds the gradients accumulated so far (`.grad()`) while each later chunk
    // runs.
    let accumulation = Some(step.trained_bytes());
    let make = |rows| make_batch(rows).map(SliceBatch);
    oomguard::train::find_max_batch_train(source, opts, &mut step, make, accumulation)
}
