//! oomguard for [tch](https://github.com/LaurentMazare/tch-rs) 0.24 (libtorch 2.11): libtorch's
//! out-of-memory as a typed, retryable error.
//!
//! libtorch throws `c10::OutOfMemoryError`; tch's C wrapper keeps only its text, so an `f_*`
//! method returns `TchError::Torch(String)` and a plain method panics. This crate recognises
//! libtorch's out-of-memory in both, by the exact shape of libtorch's message from its start
//! ([`oomguard::retry::libtorch_text_is_oom`]):
//!
//! - `TchError` implements [`oomguard::IsOom`] (oomguard's `tch` feature, which this crate turns
//!   on), so `#[oom_retry]` works on functions returning `Result<_, TchError>`;
//!   [`tch_error_is_oom`] is the same test as a function.
//! - [`Error`]: `TchError`, an out-of-memory panic, or an oomguard error; it implements
//!   [`oomguard::IsOom`] too (`?` converts `TchError` into it).
//! - [`catch_oom`]: runs a closure, turning a libtorch out-of-memory panic into an [`Error`]
//!   (other panics continue).
//! - [`train_step`]: one optimizer step over a batch (an `nn::VarStore` and its
//!   `nn::Optimizer`), retried on out-of-memory as exactly-weighted micro-batches (libtorch
//!   accumulates the gradients), the optimizer stepped once, after every micro-batch succeeded,
//!   on every row; a variable that requires a gradient and got none is named.
//! - [`find_max_batch`]: the largest batch a tch step runs with.
//!
//! **Testing your step on CPU.** A CPU device has no memory source: give the retry engine a
//! simulated card (`oomguard::Device::sim(..)`) and charge it in the loss closure for each
//! micro-batch's rows (`card.alloc::<u8>(chunk.len() * bytes_per_row)?`, an out-of-memory
//! [`Error::Oomguard`] when it does not fit): the engine then splits the batch exactly as on a
//! GPU ([`train_step`]'s example does that).
//!
//! Which versions, and why: [`compat`]. Building needs libtorch 2.11.0: `eval
//! "$(scripts/libtorch.sh)"` from the repository root installs it from PyPI and sets `LIBTORCH`
//! and `LD_LIBRARY_PATH`.
//!
//! ```
//! use oomguard::IsOom;
//! use tch::{Device, Kind, Tensor};
//!
//! // 4 PiB on the CPU: libtorch's allocator fails with ENOMEM, an out-of-memory.
//! let err = Tensor::f_empty([1i64 << 50], (Kind::Float, Device::Cpu)).unwrap_err();
//! assert!(oomguard_tch::tch_error_is_oom(&err));
//! assert!(oomguard_tch::Error::from(err).is_oom());
//! // The plain method panics with it; catch_oom turns the panic into the error.
//! let caught = oomguard_tch::catch_oom(|| {
//!     Ok::<_, oomguard_tch::Error>(Tensor::empty([1i64 << 50], (Kind::Float, Device::Cpu)))
//! });
//! assert!(caught.unwrap_err().is_oom());
//! ```

mod catch;
pub mod compat;
pub mod cuda_allocator;
mod device_stats;
mod error;
mod finder;
mod libtorch_cuda_source;
pub mod memory_history;
mod memory_summary;
mod shim;
mod train_step;

pub use catch::{catch_oom, panic_message_is_oom};
pub use device_stats::{DeviceStats, Stat, StatArray};
pub use error::{tch_error_is_oom, Error};
pub use finder::find_max_batch;
pub use libtorch_cuda_source::LibtorchCudaSource;
pub use memory_summary::format_memory_summary;
pub use train_step::{train_step, TrainStepError, TrainedStep};

pub use oomguard;
pub use tch;
