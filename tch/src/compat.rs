//! Everything that depends on the tch / libtorch version: tch 0.24.0 over libtorch 2.11.0.
//!
//! tch 0.24.0 is the release made for libtorch 2.11.0 (torch-sys 0.24.0's `TORCH_VERSION`); the
//! H100 machine runs PyTorch 2.11 (CUDA 13.0). A move to another tch changes this file and the
//! texts of libtorch's out-of-memory in the runtime (`retry/classify_tch.rs`), and nothing else:
//! - how a `TchError` reaches a panic message: tch's plain methods (`Tensor::matmul`,
//!   `Tensor::backward`, ...) call their `f_*` twin and `unwrap()` it (`unsafe_torch!` in
//!   tch/src/wrappers/utils.rs), so the message is [`UNWRAP`] followed by the error's derived
//!   `Debug`, `Torch("...")` with the text escaped ([`TORCH_DEBUG`]);
//! - `TchError::Torch`'s display ([`TORCH_DISPLAY`]).

pub use oomguard::retry::advanced::UNWRAP;

/// The derived `Debug` of `TchError::Torch(text)` starts with this, then `text`'s `Debug`
/// escapes without its opening quote, then `")`.
pub const TORCH_DEBUG: &str = "Torch(\"";

/// `TchError::Torch(text)`'s display: this, then `text`.
pub const TORCH_DISPLAY: &str = "Internal torch error: ";
