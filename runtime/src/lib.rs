//! Runtime of oomguard: RAII device buffers over a caching allocator, on a simulated device or a
//! real GPU, with typed out-of-memory errors.
//!
//! Layers, each calling only the one below:
//! - [`backend`]: the primitive operations of a device ([`backend::Backend`]), implemented by the
//!   simulated device [`backend::sim::SimDevice`] and, with the `cuda` feature (on by default),
//!   by `backend::cuda::CudaBackend` (see `Device::cuda`);
//! - [`alloc`]: the caching allocator (pools, best fit, split/merge, growable segments, stats);
//! - [`Device`] and [`DeviceBuffer`]: what users hold;
//! - [`guard`]: scoped guards (grad mode, budgets, leak checks, peak scopes, empty-cache);
//! - [`retry`]: OOM retry (policies, the [`RetryEngine`], remembered plans, batch finder);
//! - [`train`]: the framework-free part of the framework crates' training steps (outcome,
//!   errors, row and loss checks, refusal rules).
//!
//! [`source`] sits with the guards, [`export`] with the device; [`LeakReport`] and the retry
//! report's data ([`retry::RetryReport`], [`BatchPlan`], [`source::Churn`], …: plain data, so
//! that [`Error`] can hold them) with the errors below the allocator. `tests/layers.rs` fails on
//! any `crate::` path that names a layer above the module's own, and `tests/cycles.rs` on any
//! circle between files (neither has an exception left).
//!
//! ```
//! use oomguard_runtime::{Device, ByteSize};
//! let dev = Device::sim(ByteSize::gib(1));
//! let err = dev.alloc::<u8>(2 << 30).unwrap_err();
//! assert!(err.is_oom());
//! println!("{err}");
//! ```
#![deny(unsafe_code)]

pub mod alloc;
pub mod backend;
mod buffer;
mod charge;
pub mod config;
#[cfg(feature = "cuda")]
pub mod cuda;
mod device;
mod error;
pub mod export;
#[doc(hidden)]
pub mod fuzzing;
pub mod guard;
mod leak_report;
#[doc(hidden)]
pub mod macro_support;
#[cfg(feature = "nccl")]
pub mod nccl;
mod panic_text;
pub mod retry;
mod retry_report;
mod size;
pub mod source;
pub mod train;

pub use alloc::{Allocation, CachingAllocator, MemoryStats};
pub use buffer::DeviceBuffer;
pub use charge::Charge;
pub use config::{AllocatorConfig, ConfigError};
pub use device::Device;
pub use error::{BudgetExceeded, Error, OomError, Result};
pub use guard::{
    enable_grad, inference_mode, is_grad_enabled, is_inference_mode, no_grad, set_grad_enabled,
    set_grad_mode_guard, with_grad_enabled, with_inference_mode, with_no_grad, EmptyCacheOnDrop,
    GradGuard, GradMode, LeakAction, LeakCheck, MemoryBudget, PeakScope,
};
pub use leak_report::{LeakReport, LeakedBuffer};
pub use retry::{find_max_batch, IsOom, RetryEngine, RetryError, RetryPolicy, Step};
pub use retry_report::{BatchPlan, Chunk};
pub use size::{ByteSize, ByteSizeError};
pub use source::{MemorySource, MemoryUsage};

/// cudarc, the CUDA bindings the CUDA backend is built on (the same version), to load kernels,
/// make streams and launch on [`DeviceBuffer`]s.
#[cfg(feature = "cuda")]
pub use cudarc;
