//! Runtime of oomguard: RAII device buffers over a caching allocator, on a simulated device or a
//! real GPU, with typed out-of-memory errors.
//!
//! Layers, each calling only the one below:
//! - [`backend`]: the primitive operations of a device ([`backend::Backend`]), implemented by the
//!   simulated device [`backend::sim::SimDevice`];
//! - [`alloc`]: the caching allocator (pools, best fit, split/merge, growable segments, stats);
//! - [`Device`] and [`DeviceBuffer`]: what users hold.
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
pub mod config;
mod device;
mod error;
pub mod export;
mod size;

pub use alloc::{Allocation, CachingAllocator, MemoryStats};
pub use buffer::DeviceBuffer;
pub use config::{AllocatorConfig, ConfigError};
pub use device::Device;
pub use error::{BudgetExceeded, Error, OomError, Result};
pub use size::{ByteSize, ByteSizeError};
