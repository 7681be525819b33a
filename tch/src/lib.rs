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
//! - [`find_max_batch`]: the largest batch a tch step runs with; [`find_max_batch_train`]: the
//!   largest batch [`train_step`]'s own attempt runs with (nothing trained), to seed its loop.
//!
//! **Testing your step on CPU.** A CPU device has no memory source: give the retry engine a
//! simulated card (`oomguard::Device::sim(..)`) and charge it in the loss closure for each
//! micro-batch's rows ([`charge`]`(&card, chunk.len() * bytes_per_row)?`, an out-of-memory
//! [`Error::Oomguard`] when it does not fit): the engine then splits the batch exactly as on a
//! GPU ([`train_step`]'s example does that).
//!
//! ## libtorch's CUDA allocator as a memory source
//!
//! A small C++ shim (`shim/*.cpp`, compiled by the build script against the libtorch tch links)
//! reaches `c10::cuda::CUDACachingAllocator`, which serves every tch CUDA tensor:
//! - [`LibtorchCudaSource`]: one device's allocator as an [`oomguard::source::MemorySource`], so
//!   that budgets (libtorch's per-process memory fraction: a cap on what libtorch *reserves*,
//!   see its `budget`), `oomguard::source::guards` (leak checks, peak scopes),
//!   `memory_summary` (PyTorch's table), `oomguard::retry::find_max_batch` and the retry engine
//!   work over tch's memory;
//! - [`cuda_allocator`]: the allocator's calls one by one (statistics, `empty_cache`, the
//!   memory fraction, device count and memory), [`DeviceStats`] its figures;
//! - [`memory_history`]: the allocation history switch and the memory snapshot as PyTorch's
//!   pickle, which opens in `oomguard view` and in PyTorch's memory_viz.
//!
//! Without a CUDA device (no driver, none visible) every call returns an error and nothing
//! reaches CUDA. libtorch reads `PYTORCH_ALLOC_CONF` (or `PYTORCH_CUDA_ALLOC_CONF`) when CUDA
//! starts, and the source works under what it sets: with `expandable_segments:True`, reserved
//! memory is the pages mapped, `empty_cache` unmaps the free ones and the memory fraction caps
//! the pages mapped; `per_process_memory_fraction:F` is the fraction a budget replaces while it
//! lives and restores after; with `backend:cudaMallocAsync` libtorch's allocator is CUDA's pool
//! ([`cuda_allocator::AllocatorInfo::name`] says `"cudaMallocAsync"`), which records no history:
//! [`memory_history::record_history`] returns libtorch's error. Under a pluggable allocator
//! (oomguard's, after [`allocator::install`]) the statistics are that allocator's, or an error
//! where it has none.
//!
//! ```no_run
//! use oomguard::source::{guards::UsageLeakCheck, MemorySource};
//! use oomguard_tch::LibtorchCudaSource;
//!
//! let src = LibtorchCudaSource::new(0)?; // an error, not a panic, without a CUDA device
//! let _cap = src.budget(8 << 30)?; // libtorch reserves at most 8 GiB on device 0 meanwhile
//! let check = UsageLeakCheck::new(&src)?;
//! // ... a tch training step ...
//! println!("{}", check.finish()?);
//! println!("{}", src.memory_summary());
//! # Ok::<(), oomguard::Error>(())
//! ```
//!
//! Building needs CUDA's runtime headers of libtorch's CUDA version (c10's CUDA headers include
//! them): found beside a PyPI torch (`nvidia/cu13/include`, with `crt/`, which
//! `scripts/libtorch.sh` adds), in `CUDA_HOME` or `/usr/local/cuda`, or named by
//! `OOMGUARD_TCH_CUDA_INCLUDE` (`none` builds the shim without CUDA: every call then says so).
//! The binary then needs `libtorch_cuda.so`, `libc10_cuda.so`, `libtorch_cpu.so` and
//! `libc10.so` (torch/lib) on the loader's path, as tch does.
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

pub mod allocator;
mod catch;
mod charge;
pub mod compat;
pub mod cuda_allocator;
mod device_stats;
mod error;
mod finder;
mod framework;
mod libtorch_cuda_source;
pub mod memory_history;
mod memory_summary;
mod quiet_panics;
mod shim;
mod train_step;

pub use catch::{catch_oom, panic_message_is_oom};
pub use charge::{charge, Charge};
pub use device_stats::{DeviceStats, Stat, StatArray};
pub use error::{tch_error_is_oom, Error};
pub use finder::{find_max_batch, find_max_batch_train};
pub use libtorch_cuda_source::LibtorchCudaSource;
pub use memory_summary::format_memory_summary;
pub use train_step::{train_step, TrainStepError, TrainedStep};

pub use oomguard;
pub use tch;
