//! oomguard for [tch](https://github.com/LaurentMazare/tch-rs) 0.24 (libtorch 2.11): libtorch's
//! out-of-memory as a typed, retryable error.
//!
//! libtorch throws `c10::OutOfMemoryError`; tch's C wrapper keeps only its text, so an `f_*`
//! method returns `TchError::Torch(String)` and a plain method panics. This crate recognises
//! libtorch's out-of-memory in both, by the exact shape of libtorch's message from its start
//! ([`oomguard::retry::libtorch_text_is_oom`]):
//!
//! - [`Error`]: `TchError`, an out-of-memory panic, or an oomguard error; it implements
//!   [`oomguard::IsOom`], so `#[oom_retry]` works on functions returning
//!   `Result<_, oomguard_tch::Error>` (`?` converts `TchError`). [`tch_error_is_oom`] classifies
//!   a bare `TchError`.
//! - [`catch_oom`]: runs a closure, turning a libtorch out-of-memory panic into an [`Error`]
//!   (other panics continue).
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
mod libtorch_cuda_source;
pub mod memory_history;
mod memory_summary;
mod shim;

pub use catch::{catch_oom, panic_message_is_oom};
pub use device_stats::{DeviceStats, Stat, StatArray};
pub use error::{tch_error_is_oom, Error};
pub use libtorch_cuda_source::LibtorchCudaSource;
pub use memory_summary::format_memory_summary;

pub use oomguard;
pub use tch;
