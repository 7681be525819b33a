//! `find_max_batch` on a burn step: the runtime's finder, with each run under [`catch_oom`];
//! `find_max_batch_train`, the finder over [`train_step`](crate::train_step)'s own attempt.

use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;
use std::marker::PhantomData;

use oomguard::retry::{Chunk, FinderError, FinderOptions, FinderReport};
use oomguard::source::MemorySource;

use crate::compat;
use crate::framework::BurnStep;
use crate::{catch_oom, Error};

/// The largest batch for which `step(rows)` runs without out-of-memory on `source`
/// ([`oomguard::retry::find_max_batch`]: two measured runs, a linear fit of peak memory, a
/// jump; at most 4 runs when memory is affine in the batch). Each run is under
/// [`catch_oom`], so a cubecl out-of-memory panic is a failed run, not a crash. The step should
/// do what a training step does (forward, backward, optimizer), keep nothing between calls, and
/// read something it computed (e.g. the loss with `try_into_data`) so that its errors surface.
///
/// **It trains the model it measures**: every trial runs real steps, optimizer update included
/// (2 per trial, then 32 or more to verify the batch found; [`FinderReport::step_runs`] counts
/// them), so the model and the optimizer's state change. Measure on a clone of the model and
/// a fresh optimizer, or keep the records (`Module::into_record`, `Optimizer::to_record`) and
/// load them back after. Start `train_step` from the batch found with
/// [`RetryEngine::start_from_finder`](oomguard::retry::RetryEngine::start_from_finder).
///
/// **To seed [`train_step`](crate::train_step), prefer [`find_max_batch_train`]**: it measures
/// the attempt `train_step` runs (the batch held, each chunk's weighted loss backpropagated,
/// the gradients summed and held) rather than a step written by hand, which may need less
/// memory than that attempt: a loop seeded from it then retries.
pub fn find_max_batch<S, T>(
    source: &S,
    opts: FinderOptions,
    mut step: impl FnMut(usize) -> Result<T, Error>,
) -> Result<FinderReport, FinderError<Error>>
where
    S: MemorySource + ?Sized,
{
    oomguard::retry::find_max_batch(source, opts, |rows| catch_oom(|| step(rows)))
}

/// The largest batch for which [`train_step`](crate::train_step)'s own attempt fits on
/// `source`: [`oomguard::retry::find_max_batch`] where a run of `rows` rows is exactly the
/// attempt `train_step` runs on a batch of `rows` rows in one pass, with the same `model` and
/// loss a training loop gives `train_step`: `make_batch(rows)` makes the batch (whatever the
/// loss closure reads: its tensors, dimension 0 the row, held for the whole run, as a loop
/// holds its batch), then `chunk_loss(model, chunk, &batch)` gives the loss of the one chunk,
/// which is weighted and backpropagated into a [`GradAccumulator`](crate::GradAccumulator)
/// (the same checks: one value, every parameter that requires a gradient gets one), the loss
/// read and the device synchronised, and the summed gradients are held until the run ends, as
/// `train_step` holds them for the optimizer. The loop passes the same closure to `train_step`
/// with its batch: `|m, chunk| loss(m, chunk, &batch)`. Seed the loop with
/// [`RetryEngine::start_from_finder`](oomguard::retry::RetryEngine::start_from_finder): its
/// steps of at most `max_batch` rows then run the attempt measured.
///
/// **Nothing is trained**: no optimizer is given and none steps, so `model` is as it was (no
/// copy is needed). Parameters that are still lazy (burn creates a parameter on its first use)
/// are initialised first, as `train_step` does, on a copy of the model that the search uses, so
/// the memory they take is there during every run; `model`'s own stay lazy. The optimizer's
/// `step` is not measured: what it allocates while it updates is not, and neither is its
/// state, which burn's optimizers make on their first step (AdamW's two moment tensors per
/// parameter) and is measured only if it exists already: run the finder after the loop's first
/// `train_step` when the optimizer keeps state, or leave room with [`FinderOptions::margin`].
/// A loop whose batch is larger than `max_batch` (split into micro-batches of that size) holds
/// more rows of input than were measured.
///
/// Each run is under [`catch_oom`], as `train_step`'s attempt is: a cubecl out-of-memory
/// (returned, or a panic) is a failed run; any other error ends the search
/// ([`FinderError::Step`]), such as a tensor sliced with [`chunk_rows`](crate::chunk_rows)
/// whose rows are not `rows` (`make_batch` gave the wrong batch: [`Error::Rows`]), or a
/// parameter that got no gradient ([`Error::NoGradient`]). Lazy parameters that cannot be
/// initialised (out-of-memory included) are [`FinderError::Step`] before any run.
///
/// ```
/// use burn::backend::{Autodiff, NdArray};
/// use burn::nn::{Linear, LinearConfig};
/// use burn::optim::SgdConfig;
/// use burn::tensor::{Distribution, Tensor};
/// use oomguard::retry::{Chunk, FinderOptions, RetryEngine};
/// use oomguard_burn::{chunk_rows, find_max_batch_train, train_step, Error};
///
/// type B = Autodiff<NdArray>;
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let dev = Default::default();
/// let mut model: Linear<B> = LinearConfig::new(4, 1).init(&dev);
/// let mut sgd = SgdConfig::new().init();
/// let batch = |rows: usize| -> Result<[Tensor<B, 2>; 2], Error> {
///     let x = Tensor::<B, 2>::random([rows, 4], Distribution::Default, &dev);
///     let y = Tensor::<B, 2>::random([rows, 1], Distribution::Default, &dev);
///     Ok([x, y])
/// };
/// // A simulated 64 MiB card, charged 1 MiB of activations per row of a chunk.
/// let card = oomguard::Device::sim(oomguard::ByteSize::mib(64));
/// let loss = |m: &Linear<B>, chunk: &Chunk, b: &[Tensor<B, 2>; 2]| {
///     let _activations = card.alloc::<u8>(chunk.len() << 20)?;
///     let pred = m.forward(chunk_rows(&b[0], chunk)?);
///     Ok((pred - chunk_rows(&b[1], chunk)?).powi_scalar(2).mean())
/// };
/// let found = find_max_batch_train(&card, FinderOptions::default(), &model, batch, loss)?;
/// assert!((56..=64).contains(&found.max_batch), "{found}");
/// let engine = RetryEngine::new().start_from_finder(&found);
/// let b = batch(found.max_batch)?;
/// let done = train_step(&engine, &card, found.max_batch, &mut model, &mut sgd, 0.05, |m, c| {
///     loss(m, c, &b)
/// })?;
/// assert_eq!(done.report.retries(), 0);
/// # Ok(()) }
/// ```
pub fn find_max_batch_train<S, B, M, Bt>(
    source: &S,
    opts: FinderOptions,
    model: &M,
    make_batch: impl FnMut(usize) -> Result<Bt, Error>,
    chunk_loss: impl FnMut(&M, &Chunk, &Bt) -> Result<Tensor<B, 1>, Error>,
) -> Result<FinderReport, FinderError<Error>>
where
    S: MemorySource + ?Sized,
    B: AutodiffBackend,
    M: AutodiffModule<B>,
{
    // As train_step does before its first attempt: a lazy parameter created inside a run that
    // runs out of memory would stay unallocated for good.
    let mut model = model.clone();
    catch_oom(|| compat::materialize::<B, M>(&mut model)).map_err(FinderError::Step)?;
    // A split step holds the gradients accumulated so far while each later chunk runs: those of
    // the float parameters that are trained (a frozen embedding of 64 MiB made the seeded
    // micro-batches 1 row where they could be 52).
    let elements = compat::trainable::<B, M>(&model).elements;
    let accumulation = Some((elements * std::mem::size_of::<B::FloatElem>()) as u64);
    let mut step = BurnStep {
        model: &model,
        chunk_loss,
        optimizer: (),
        lr: 0.0,
        batch: PhantomData,
    };
    oomguard::train::find_max_batch_train(source, opts, &mut step, make_batch, accumulation)
}
