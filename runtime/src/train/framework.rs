//! The contract a framework crate implements so that the one generic [`train_step`] and
//! [`find_max_batch_train`] can run its step.
//!
//! [`train_step`]: super::train_step
//! [`find_max_batch_train`]: super::find_max_batch_train

use std::fmt;

use crate::retry::{Chunk, IsOom};

/// What one attempt of a step leaves for the optimizer: the summed gradients, the batch's mean
/// loss (the weighted sum of the chunks' mean losses) and the rows backpropagated.
#[derive(Debug)]
pub struct Gradients<G> {
    /// The framework's summed gradients (with whatever the update needs besides them).
    pub grads: G,
    /// The batch's mean loss.
    pub loss: f64,
    /// Rows backpropagated: the whole batch.
    pub rows: usize,
}

/// The parts of a training step a framework supplies: the rows of its batch, the loss of a
/// chunk of those rows, a backward weighted by the chunk's share of the batch into an
/// accumulator, taking the summed gradients out of it, and catching the framework's own
/// out-of-memory panics. The skeleton that calls them in order, the refusal rules and the
/// error mapping are written once, in [`train_step`](super::train_step) and
/// [`find_max_batch_train`](super::find_max_batch_train).
///
/// One attempt over a plan is: [`accumulator`](TrainFramework::accumulator), then for each
/// chunk [`chunk_loss`](TrainFramework::chunk_loss) and
/// [`backward`](TrainFramework::backward), then [`gradients`](TrainFramework::gradients), all
/// inside [`catch`](TrainFramework::catch). An error of any of them ends the attempt: the
/// engine reruns it with a smaller plan when the error [`IsOom`], and fails the step otherwise.
pub trait TrainFramework {
    /// The framework's error (classified by [`IsOom`]).
    type Error: IsOom + fmt::Display;
    /// The batch the step runs on, as the framework holds it.
    type Batch: ?Sized;
    /// The loss of one chunk (one value: the chunk's per-row mean).
    type Loss;
    /// Sums the weighted gradients of one attempt's chunks.
    type Accumulator;
    /// What [`gradients`](TrainFramework::gradients) hands the optimizer.
    type Grads;

    /// The rows of `batch` (dimension 0 of its tensors); `Ok(None)` when the batch does not
    /// say (the framework's chunk slicing checks the rows instead). `Err` names why the
    /// tensors are not a batch.
    fn batch_rows(&self, batch: &Self::Batch) -> Result<Option<usize>, String>;

    /// The loss of `chunk`'s rows of `batch` (the user's closure on them).
    fn chunk_loss(&mut self, batch: &Self::Batch, chunk: &Chunk)
        -> Result<Self::Loss, Self::Error>;

    /// Begins an attempt: an empty accumulator, after the framework's checks of its
    /// parameters (an error ends the attempt).
    fn accumulator(&mut self) -> Result<Self::Accumulator, Self::Error>;

    /// Backpropagates `loss` weighted by `chunk.weight()` and adds the gradients into `acc`;
    /// refuses a loss that is not one value, and a chunk whose rows were added already.
    fn backward(
        &self,
        acc: &mut Self::Accumulator,
        loss: Self::Loss,
        chunk: &Chunk,
    ) -> Result<(), Self::Error>;

    /// The summed gradients of `acc`, checked: the chunks covered the batch, every row once,
    /// and every trained parameter got a gradient.
    fn gradients(&self, acc: Self::Accumulator) -> Result<Gradients<Self::Grads>, Self::Error>;

    /// The framework's error for a batch that is not the one the step needs (`message` says
    /// why), e.g. a finder's `make_batch(rows)` that gave another number of rows.
    fn batch_error(message: String) -> Self::Error;

    /// Runs `f`, turning the framework's out-of-memory panics into its error (other panics
    /// continue). The default runs `f` as it is, for a framework that never panics on
    /// out-of-memory.
    fn catch<T>(f: impl FnOnce() -> Result<T, Self::Error>) -> Result<T, Self::Error> {
        f()
    }

    /// Drops the gradients an attempt left in the framework's own tensors (a framework that
    /// accumulates into its parameters, as libtorch's `.grad()`): called after a failed
    /// attempt (before the engine empties the cache), after a step that failed, and after each
    /// run of the finder, so that no gradient is left for a later update. The default does
    /// nothing: a framework whose gradients live in the accumulator drops them with it.
    fn discard_gradients(&mut self) {}
}

/// A [`TrainFramework`] that also owns the optimizer: its update, run once per step on the
/// summed gradients of the attempt that succeeded (inside [`TrainFramework::catch`]).
pub trait TrainUpdate: TrainFramework {
    /// What the update gives back (e.g. the updated model, for a framework whose optimizer
    /// returns a new one).
    type Updated;

    /// The optimizer's step on `grads`. It is never retried: it may have updated some
    /// parameters before it failed.
    fn update(&mut self, grads: Self::Grads) -> Result<Self::Updated, Self::Error>;
}

/// A finder's batch of any type that gives its items as a slice (`AsRef<[T]>`, e.g. a `Vec` or
/// an array of tensors), borrowed as the slice a [`TrainFramework::Batch`] of `[T]` is.
#[derive(Debug)]
pub struct SliceBatch<Bt>(pub Bt);

impl<T, Bt: AsRef<[T]>> std::borrow::Borrow<[T]> for SliceBatch<Bt> {
    fn borrow(&self) -> &[T] {
        self.0.as_ref()
    }
}
