//! oomguard for [burn](https://burn.dev) 0.21: keep a burn training loop alive through device
//! out-of-memory.
//!
//! burn's CUDA backend allocates through cubecl's pools, not oomguard's allocator, and reports
//! an out-of-memory late and as text (`ExecutionError`) or as a panic (`Tensor::into_data`, a
//! reservation failing on cubecl's device thread). This crate recognises those, reruns a step
//! that ran out of memory as exactly-weighted micro-batches, and watches the device's memory:
//!
//! - [`catch_oom`]: runs a closure, turning a cubecl out-of-memory panic into an [`Error`]
//!   (other panics continue); [`Error`] implements [`oomguard::IsOom`], and so does burn's
//!   `ExecutionError` (feature `burn` of oomguard, on here), so `#[oom_retry]` works on
//!   functions returning `Result<_, ExecutionError>` or `Result<_, oomguard_burn::Error>`.
//! - [`memory_source`]: the [`MemorySource`](oomguard::MemorySource) of a burn device (CUDA,
//!   feature `cuda`: `CubeCudaSource`), for the retry engine, [`find_max_batch`], leak checks
//!   and peak scopes ([`oomguard::source::guards`]).
//! - [`chunk_rows`] / [`split_rows`]: the rows of a [`Chunk`](oomguard::retry::Chunk) of a
//!   [`BatchPlan`](oomguard::BatchPlan) (`narrow` on dimension 0), checked against the batch.
//! - [`GradAccumulator`] and [`train_step`]: one optimizer step over a batch, retried on
//!   out-of-memory with smaller micro-batches, gradients summed with burn's
//!   `GradientsAccumulator`, the optimizer applied once, after every micro-batch succeeded.
//! - [`find_max_batch_train`]: the largest batch [`train_step`]'s own attempt fits (the batch
//!   held, each chunk's loss backpropagated, the gradients held), trained on nothing; its report
//!   seeds the loop's engine
//!   ([`RetryEngine::start_from_finder`](oomguard::retry::RetryEngine::start_from_finder)).
//!   [`find_max_batch`]: the largest batch a burn step of your own runs with.
//!
//! **Testing your step on CPU.** Run it on burn's ndarray backend under `Autodiff` and give the
//! retry engine a simulated device as the source (`oomguard::Device::sim(..)`); to exercise
//! the out-of-memory path, let the loss closure charge the simulated device for each
//! micro-batch's rows (`sim.alloc::<u8>(chunk.len() * bytes_per_row)?`: its error converts into an
//! out-of-memory [`Error::Oomguard`]): the engine then splits the batch exactly as on a GPU. The example
//! below does that.
//!
//! Which version, and why: [`compat`] (everything that depends on it is there).
//!
//! ```
//! use burn::backend::{Autodiff, NdArray};
//! use burn::nn::{Linear, LinearConfig};
//! use burn::optim::SgdConfig;
//! use burn::tensor::{Distribution, Tensor};
//! use oomguard::RetryEngine;
//! use oomguard_burn::{chunk_rows, train_step};
//!
//! type B = Autodiff<NdArray>;
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dev = Default::default();
//! let mut model: Linear<B> = LinearConfig::new(4, 1).init(&dev);
//! let mut sgd = SgdConfig::new().init();
//! let x = Tensor::<B, 2>::random([8, 4], Distribution::Default, &dev);
//! let y = Tensor::<B, 2>::random([8, 1], Distribution::Default, &dev);
//! // A simulated 6 MiB card; each row of a micro-batch costs 1 MiB of "activations".
//! let sim = oomguard::Device::sim(oomguard::ByteSize::mib(6));
//! let engine = RetryEngine::new();
//! let done = train_step(&engine, &sim, 8, &mut model, &mut sgd, 0.05, |m, chunk| {
//!     let _acts = sim.alloc::<u8>(chunk.len() << 20)?;
//!     let pred = m.forward(chunk_rows(&x, chunk)?);
//!     Ok((pred - chunk_rows(&y, chunk)?).powi_scalar(2).mean()) // the chunk's mean loss
//! })?;
//! assert_eq!(done.rows, 8); // every row, though 8 MiB did not fit
//! assert!(done.report.retries() >= 1);
//! # Ok(()) }
//! ```

mod catch;
pub mod compat;
#[cfg(feature = "cuda")]
mod cuda_source;
mod error;
mod finder;
mod framework;
mod source;
mod split;
mod train;

pub use catch::{catch_oom, oom_panics, panic_message_is_oom};
#[cfg(feature = "cuda")]
pub use cuda_source::CubeCudaSource;
pub use error::Error;
pub use finder::{find_max_batch, find_max_batch_train};
pub use source::memory_source;
pub use split::{chunk_rows, split_rows};
pub use train::{train_step, GradAccumulator, TrainStepError, TrainedStep};

pub use burn;
pub use oomguard;
