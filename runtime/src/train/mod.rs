//! The framework-free part of a training step that survives out-of-memory, shared by
//! oomguard-candle, oomguard-burn and oomguard-tch.
//!
//! Each framework crate's `train_step` reruns a batch as micro-batches after an out-of-memory
//! (the [`RetryEngine`](crate::retry::RetryEngine) drives the attempts), weights each chunk's
//! mean loss by its share of the batch, and steps the optimizer once, after every micro-batch
//! of one attempt succeeded. What does not touch a tensor is here, written once:
//!
//! - [`TrainedStep`]: what a step did (the batch's mean loss, its rows, the retry report);
//!   [`LossCurve`]: a loop's losses and retries, and the check that the loss fell;
//! - [`TrainStepError`]: why it failed, and which failures an outer retry may rerun
//!   ([`IsOom`](crate::retry::IsOom): an update error never);
//! - [`batch_rows`]: the batch's rows from its tensors' shapes (they must agree on dimension 0);
//! - [`LossSum`]: the weighted sum of the chunks' mean losses and the rows covered, checked to
//!   come from one batch; [`one_value`]: the check that a chunk's loss is one value;
//! - [`keep_rows`] (with [`KEEP_ROWS_HINT`]): the refusal rules (an engine whose policy would
//!   drop rows is refused before anything runs; the step always counts as training);
//! - [`missing_gradients`] / [`name_list`]: the text naming parameters that got no gradient;
//! - [`HeldBatch`]: the bytes per row a batch holds for the whole step, measured by the
//!   training finders, so that a seeded engine leaves room for a larger batch's tensors;
//! - [`TrainFramework`] / [`TrainUpdate`]: the contract a framework implements (its batch's
//!   rows, a chunk's loss, a weighted backward, taking the gradients, the optimizer's update,
//!   catching its out-of-memory panics), and over it the one skeleton: [`train_step`]
//!   ([`train_step_kept`]), [`attempt`] and [`find_max_batch_train`].

mod batch;
mod error;
mod framework;
mod gradients;
mod held_batch;
mod loss;
mod loss_curve;
mod refusal;
mod step;
#[cfg(test)]
mod step_tests;
mod trained;

pub use batch::{batch_rows, rows_match};
pub use error::TrainStepError;
pub use framework::{Gradients, SliceBatch, TrainFramework, TrainUpdate};
pub use gradients::{missing_gradients, name_list, NAMED};
pub use held_batch::HeldBatch;
pub use loss::{finite_loss, one_value, LossSum};
pub use loss_curve::{LossCurve, LossDidNotFall};
pub use refusal::{drops_rows, keep_rows, DropsRows, KEEP_ROWS_HINT};
pub use step::{attempt, find_max_batch_train, train_step, train_step_kept, StepFailure, Stepped};
pub use trained::TrainedStep;
