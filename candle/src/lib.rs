//! oomguard for [candle](https://github.com/huggingface/candle): keep a candle training loop
//! alive through CUDA out-of-memory.
//!
//! candle allocates every CUDA tensor from the CUDA driver's stream-ordered memory pool (through
//! cudarc's `CudaStream::alloc`). candle itself has no allocator API; this crate offers two
//! ways in:
//!
//! - **oomguard's allocator under candle's tensors** (feature `allocator-hook`):
//!   [`alloc_hook::install`] makes candle's CUDA tensors blocks of oomguard's caching allocator,
//!   with no change to candle (see [`alloc_hook`] and the README's section "oomguard's allocator
//!   under candle's tensors (feature `allocator-hook`)").
//! - **Through the driver's pool** (feature `cuda`, no hook): oomguard reads the pool's
//!   counters, trims it and caps it.
//!
//! Either way, a step that runs out of memory is rerun as exactly-weighted micro-batches.
//!
//! - [`memory_source`]: the [`MemorySource`](oomguard::MemorySource) of a `candle_core::Device`
//!   (the installed oomguard device after [`alloc_hook::install`], otherwise the device's
//!   driver pool, feature `cuda`), for the retry engine, `find_max_batch`, budgets, leak
//!   checks, peak scopes and `memory_summary` ([`oomguard::source`]).
//! - [`train_step`]: one optimizer step over a batch, retried on OOM with a smaller
//!   micro-batch, the optimizer applied once, after every micro-batch succeeded, on every row.
//! - [`find_max_batch_train`]: the largest batch [`train_step`]'s own attempt fits (the batch
//!   held, each chunk's loss backpropagated, the gradients held), trained on nothing; its report
//!   seeds the loop's engine
//!   ([`RetryEngine::start_from_finder`](oomguard::retry::RetryEngine::start_from_finder)).
//! - [`GradAccumulator`]: sums the gradients of the micro-batches of one attempt, each
//!   weighted by its share of the batch, keeping only the variables' gradients; [`Params`]:
//!   the variables it trains and those frozen on purpose.
//! - [`chunk_rows`] / [`split_rows`]: the rows of a [`Chunk`](oomguard::retry::Chunk) of a
//!   [`BatchPlan`](oomguard::retry::BatchPlan) (`narrow` on dimension 0).
//! - [`charge`] / [`into_candle_error`]: out-of-memory in candle code on CPU, for tests.
//! - OOM classification: `candle_core::Error` implements [`oomguard::IsOom`] (typed: the
//!   driver's `CUDA_ERROR_OUT_OF_MEMORY` and cuBLAS's `CUBLAS_STATUS_ALLOC_FAILED` inside
//!   `Error::Cuda`, through `WithBacktrace`, `Context` and `WithPath`), so `#[oom_retry]` works
//!   on functions returning `candle_core::Result`.
//!
//! **Each chunk's loss must be its per-row mean.** [`train_step`] and [`GradAccumulator`]
//! weight each micro-batch's gradients by `len / batch` (in `f64`/`f32`, whatever the loss's
//! dtype), which turns per-chunk means into the batch's mean. A loss *summed* over rows gives
//! an update that depends on how an OOM split the batch; a loss with more than one element is
//! refused. Statistics over the whole batch (BatchNorm in training mode, in-batch negatives,
//! centring by the batch mean) cannot be split exactly by any accumulation: each chunk sees
//! only its rows.
//!
//! **Every parameter must get a gradient.** A trained variable that receives no gradient in a
//! step is an error naming it; freeze it on purpose with [`Params::freeze`]. A float variable
//! the loss depends on that is not among the parameters is an error too (the optimizer would
//! never update it). The usual cause of a missing gradient: candle-nn 0.11.1 has forward-only
//! ops, built with `apply_op*_no_bwd`, whose output carries no backward op and cuts the graph
//! below it:
//!
//! | forward-only (no gradient flows through) | differentiable replacement |
//! |---|---|
//! | `candle_nn::LayerNorm::forward` on a contiguous input with a bias (calls `ops::layer_norm`) | `ops::layer_norm_slow(x, ln.weight(), ln.bias().unwrap(), eps)` |
//! | `ops::layer_norm` | `ops::layer_norm_slow` |
//! | `ops::softmax_last_dim` | `ops::softmax(x, D::Minus1)` |
//! | `candle_nn::RmsNorm::forward` on a contiguous input, `ops::rms_norm` | `ops::rms_norm_slow` |
//!
//! (checked on CPU by this crate's `forward_only_ops` test). With them, only the parameters
//! above the last such op train; many `candle-transformers` models use them.
//!
//! **Out-of-memory on CPU, for tests.** A CPU device has no memory source and never runs out
//! of memory. Give the step a simulated card ([`oomguard::Device::sim`]) as its source, and
//! [`charge`] it in the loss closure for the memory the chunk's tensors would take on a GPU
//! (e.g. bytes per row × `chunk.len()`): the card's OOM comes back as a `candle_core::Error`
//! that stays classified (and a budget's as a budget's), so the engine splits the batch as it
//! would on a GPU. The README's section "Testing a candle step's out-of-memory on CPU" has
//! the recipe.
//!
//! **Grad mode.** candle has no global grad mode: a graph is recorded whenever an input is a
//! `Var`, whatever oomguard's thread grad mode says. `#[no_grad]` therefore changes only what
//! oomguard decides (an OOM in no-grad mode may shrink the batch instead of accumulating); it
//! does not stop candle from keeping the activations of a forward pass alive. To evaluate
//! without a graph, run the forward on detached weights or call [`Tensor::detach`](candle_core::Tensor::detach) on each
//! layer's output, and drop outputs as soon as they are used. [`train_step`] always counts as
//! training.
//!
//! ```
//! use candle_core::{DType, Device, Tensor, Var};
//! use candle_nn::{Optimizer, SGD};
//! use oomguard::RetryEngine;
//! use oomguard_candle::train_step;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dev = Device::Cpu;
//! let w = Var::zeros(4, DType::F32, &dev)?;
//! let x = Tensor::arange(0f32, 32., &dev)?.reshape((8, 4))?;
//! let y = Tensor::ones(8, DType::F32, &dev)?;
//! let mut sgd = SGD::new(vec![w.clone()], 0.01)?;
//! // A CPU device has no memory source: give the engine any source (here a simulated device).
//! let source = oomguard::Device::sim(oomguard::ByteSize::gib(1));
//! let engine = RetryEngine::new();
//! let done = train_step(&engine, &source, &[&x, &y], &w, &mut sgd, |_chunk, rows| {
//!     let pred = rows[0].matmul(&w.as_tensor().unsqueeze(1)?)?.squeeze(1)?;
//!     (pred - &rows[1])?.sqr()?.mean_all() // the chunk's per-row mean loss
//! })?;
//! assert!(done.loss > 0.0);
//! assert_eq!(done.rows, 8);
//! assert_eq!(done.report.final_plan.micro_batch(), 8);
//! # Ok(()) }
//! ```

mod accumulator;
mod finder;
mod framework;
mod oom;
mod params;
mod rows;
mod source;
mod train_step;

pub use accumulator::GradAccumulator;
pub use finder::find_max_batch_train;
pub use oom::{charge, into_candle_error, Charge};
pub use params::Params;
pub use rows::{chunk_rows, split_rows};
pub use source::memory_source;
pub use train_step::{train_step, TrainStepError, TrainedStep};

pub use oomguard;

pub mod alloc_hook;
