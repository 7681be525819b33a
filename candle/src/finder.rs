//! `find_max_batch_train`: the runtime's finder over [`train_step`](crate::train_step)'s own
//! attempt.

use candle_core::Tensor;
use oomguard::retry::{Chunk, FinderError, FinderOptions, FinderReport};
use oomguard::source::MemorySource;

use oomguard::train::SliceBatch;

use crate::framework::CandleStep;
use crate::params::Params;

/// The largest batch for which [`train_step`](crate::train_step)'s own attempt fits on
/// `source`: [`oomguard::retry::find_max_batch`] where a run of `rows` rows is exactly the
/// attempt `train_step` runs on a batch of `rows` rows in one pass, with the same `params` and
/// `chunk_loss` a training loop gives `train_step`: `make_batch(rows)` makes the batch (its
/// tensors, dimension 0 the row, held for the whole run, as a loop holds its batch), then
/// `chunk_loss` gives the loss of the one chunk, which is backpropagated into a
/// [`GradAccumulator`](crate::GradAccumulator) (the same checks: one value, every trained
/// variable gets a gradient, no float variable of the graph left out), and the summed gradients
/// are held until the run ends, as `train_step` holds them for the optimizer. Seed the loop with
/// [`RetryEngine::start_from_finder`](oomguard::retry::RetryEngine::start_from_finder): its
/// steps of at most `max_batch` rows then run the attempt measured.
///
/// Use it rather than [`oomguard::retry::find_max_batch`] over a step written by hand to seed
/// `train_step`: such a step may need less memory than the attempt (it may not hold a batch,
/// or may drop its gradients sooner), and a loop seeded from it then retries.
///
/// **Nothing is trained**: no optimizer is given and none steps, so the variables are as they
/// were (no copy of the model is needed). So the optimizer's `step` is not measured: what it
/// allocates while it updates (candle-nn's `AdamW` makes new moment and parameter tensors
/// before it sets them) is not, and its state is measured only if it exists already (candle-nn's
/// `AdamW` makes its two moment buffers per variable when it is built: build it before the
/// finder runs). Leave that room with [`FinderOptions::margin`]. A loop whose batch is larger
/// than `max_batch` (split into micro-batches of that size) holds more rows of input than were
/// measured.
///
/// Errors are a run's, as in `train_step`'s attempt: a `candle_core::Error` that
/// [`IsOom`](oomguard::IsOom) classifies as out-of-memory is a failed run; any other ends the
/// search ([`FinderError::Step`]); `make_batch` giving a batch whose rows are not `rows` is one
/// too.
///
/// ```
/// use candle_core::{DType, Device, Tensor, Var};
/// use candle_nn::SGD;
/// use oomguard::retry::{Chunk, FinderOptions, RetryEngine};
/// use oomguard_candle::{charge, find_max_batch_train, train_step};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let dev = Device::Cpu;
/// let w = Var::zeros((4, 1), DType::F32, &dev)?;
/// let mut sgd = <SGD as candle_nn::Optimizer>::new(vec![w.clone()], 0.01)?;
/// let batch = |rows: usize| -> candle_core::Result<Vec<Tensor>> {
///     let x = Tensor::randn(0f32, 1., (rows, 4), &dev)?;
///     let y = Tensor::randn(0f32, 1., (rows, 1), &dev)?;
///     Ok(vec![x, y])
/// };
/// // A simulated 64 MiB card, charged 1 MiB of activations per row of a chunk.
/// let card = oomguard::Device::sim(oomguard::ByteSize::mib(64));
/// let loss = |chunk: &Chunk, rows: &[Tensor]| {
///     let _activations = charge(&card, chunk.len() << 20)?;
///     (rows[0].matmul(w.as_tensor())? - &rows[1])?.sqr()?.mean_all()
/// };
/// let found = find_max_batch_train(&card, FinderOptions::default(), &w, batch, loss)?;
/// assert!((56..=64).contains(&found.max_batch), "{found}");
/// let engine = RetryEngine::new().start_from_finder(&found);
/// let b = batch(found.max_batch)?;
/// let done = train_step(&engine, &card, &[&b[0], &b[1]], &w, &mut sgd, loss)?;
/// assert_eq!(done.report.retries(), 0);
/// # Ok(()) }
/// ```
pub fn find_max_batch_train<S, Bt>(
    source: &S,
    opts: FinderOptions,
    params: impl Into<Params>,
    mut make_batch: impl FnMut(usize) -> candle_core::Result<Bt>,
    chunk_loss: impl FnMut(&Chunk, &[Tensor]) -> candle_core::Result<Tensor>,
) -> Result<FinderReport, FinderError<candle_core::Error>>
where
    S: MemorySource + ?Sized,
    Bt: AsRef<[Tensor]>,
{
    let params = params.into();
    // A split step holds the gradients accumulated so far while each later chunk runs.
    let accumulation = Some(params.trained_bytes());
    let mut step = CandleStep {
        params,
        chunk_loss,
        optimizer: (),
    };
    let make = |rows| make_batch(rows).map(SliceBatch);
    oomguard::train::find_max_batch_train(source, opts, &mut step, make, accumulation)
}
