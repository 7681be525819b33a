//! oomguard keeps GPU training code alive through CUDA out-of-memory.
//!
//! This facade re-exports the runtime ([`oomguard_runtime`]) and the attribute macros
//! ([`oomguard_macros`]).
//!
//! ```
//! use oomguard::{Device, ByteSize};
//! let dev = Device::sim(ByteSize::gib(1));
//! let buf = dev.zeros::<f32>(1024).unwrap();
//! assert_eq!(buf.len(), 1024);
//! ```

#[allow(unused_imports)] // the macros crate is empty until the macros land
pub use oomguard_macros::*;
pub use oomguard_runtime::*;

/// Items the attribute macros' generated code calls. Not public API: it may change in any
/// release.
#[doc(hidden)]
#[path = "private.rs"]
pub mod __private;
