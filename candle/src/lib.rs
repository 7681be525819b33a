//! oomguard for [candle](https://github.com/huggingface/candle): keep a candle training loop
//! alive through CUDA out-of-memory.
//!
//! candle allocates every CUDA tensor from the CUDA driver's stream-ordered memory pool (through
//! cudarc's `CudaStream::alloc`), not from oomguard's allocator, and has no allocator hook. So
//! oomguard guards candle code through the pool: it reads the pool's counters, trims it, caps
//! it, and reruns a step that ran out of memory as exactly-weighted micro-batches.
//!
//! - [`memory_source`]: the [`MemorySource`] of a `candle_core::Device` (the device's driver
//!   pool, feature `cuda`), for the retry engine, `find_max_batch`, budgets, leak checks, peak
//!   scopes and `memory_summary` ([`oomguard::source`]).
//! - [`chunk_rows`] / [`split_rows`]: the rows of a [`Chunk`] of a [`BatchPlan`] (`narrow` on
//!   dimension 0).
//! - [`GradAccumulator`]: sums the gradients of the micro-batches of one attempt, each loss
//!   weighted by its share of the batch, keeping only the variables' gradients.
//! - [`train_step`]: one optimizer step over a batch, retried on OOM with a smaller
//!   micro-batch, the optimizer applied once, after every micro-batch succeeded.
//! - OOM classification: `candle_core::Error` implements [`oomguard::IsOom`] (typed: the
//!   driver's `CUDA_ERROR_OUT_OF_MEMORY` and cuBLAS's `CUBLAS_STATUS_ALLOC_FAILED` inside
//!   `Error::Cuda`, through `WithBacktrace`, `Context` and `WithPath`), so `#[oom_retry]` works
//!   on functions returning `candle_core::Result`.
//!
//! **Grad mode.** candle has no global grad mode: a graph is recorded whenever an input is a
//! `Var`, whatever oomguard's thread grad mode says. `#[no_grad]` therefore changes only what
//! oomguard decides (an OOM in no-grad mode may shrink the batch instead of accumulating); it
//! does not stop candle from keeping the activations of a forward pass alive. To evaluate
//! without a graph, run the forward on detached weights or call [`Tensor::detach`] on each
//! layer's output, and drop outputs as soon as they are used.
//!
//! ```
//! use candle_core::{DType, Device, Tensor, Var};
//! use candle_nn::{Optimizer, SGD};
//! use oomguard::RetryEngine;
//! use oomguard_candle::{chunk_rows, train_step};
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
//! let done = train_step(&engine, &source, 8, std::slice::from_ref(&w), &mut sgd, |chunk| {
//!     let pred = chunk_rows(&x, chunk)?.matmul(&w.as_tensor().unsqueeze(1)?)?.squeeze(1)?;
//!     (pred - chunk_rows(&y, chunk)?)?.sqr()?.mean_all() // the chunk's mean loss
//! })?;
//! assert!(done.loss > 0.0);
//! assert_eq!(done.report.final_plan.micro_batch(), 8);
//! # Ok(()) }
//! ```

use std::fmt;
use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use candle_nn::Optimizer;
use oomguard::retry::{BatchPlan, Chunk, RetryEngine, RetryError, RetryReport};
use oomguard::source::MemorySource;

pub use oomguard;

pub mod alloc_hook;

/// The [`MemorySource`] a candle device allocates from: for `Device::Cuda`, the driver's memory
/// pool of that device ([`oomguard::source::DriverPool`], registered so that the attribute
/// macros' retries empty it). A CPU or Metal device has none: an error says so.
pub fn memory_source(device: &candle_core::Device) -> oomguard::Result<Arc<dyn MemorySource>> {
    match device {
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(d) => {
            let ctx = d.cuda_stream().context().clone();
            let pool = oomguard::source::DriverPool::of_context(&ctx)?;
            Ok(Arc::new(pool))
        }
        other => Err(oomguard::Error::InvalidArgument(format!(
            "{other:?} has no device memory source oomguard can watch \
             (CUDA devices only, with the `cuda` feature of oomguard-candle)"
        ))),
    }
}

/// The rows of `chunk` in `t` (dimension 0): `t.narrow(0, chunk.start(), chunk.len())`. An
/// error, not a panic, when `t` has fewer rows than the chunk needs.
pub fn chunk_rows(t: &Tensor, chunk: &Chunk) -> candle_core::Result<Tensor> {
    let rows = t.dims().first().copied().unwrap_or(0);
    if chunk.rows().end > rows {
        candle_core::bail!(
            "chunk {:?} needs rows up to {}, but the tensor has {rows} (shape {:?})",
            chunk.rows(),
            chunk.rows().end,
            t.dims()
        );
    }
    t.narrow(0, chunk.start(), chunk.len())
}

/// Splits each tensor of a batch by `plan`: one `Vec` of tensors per chunk, in order. Every
/// tensor must have exactly `plan.batch()` rows.
pub fn split_rows(tensors: &[&Tensor], plan: &BatchPlan) -> candle_core::Result<Vec<Vec<Tensor>>> {
    for t in tensors {
        let rows = t.dims().first().copied().unwrap_or(0);
        if rows != plan.batch() {
            candle_core::bail!(
                "a tensor of shape {:?} has {rows} rows; the plan splits a batch of {}",
                t.dims(),
                plan.batch()
            );
        }
    }
    plan.chunks()
        .map(|c| tensors.iter().map(|t| chunk_rows(t, &c)).collect())
        .collect()
}

/// Sums the gradients of the micro-batches of one attempt: each chunk's mean loss is scaled by
/// the chunk's share of the batch (`len / batch`) before `backward`, so the sum is the gradient
/// of the batch's mean loss, equal to one full-batch backward up to floating-point summation
/// order. Only the variables' gradients are kept (a backward pass also returns the gradients of
/// every intermediate tensor, which are dropped at once).
#[derive(Debug)]
pub struct GradAccumulator {
    vars: Vec<Var>,
    grads: GradStore,
    loss: f64,
    rows: usize,
}

impl GradAccumulator {
    /// An empty accumulator for `vars`.
    pub fn new(vars: &[Var]) -> Self {
        Self {
            vars: vars.to_vec(),
            grads: GradStore::default(),
            loss: 0.0,
            rows: 0,
        }
    }

    /// Backpropagates `chunk_loss` (the chunk's *mean* loss, a scalar) weighted by
    /// `chunk.weight()` and adds the variables' gradients.
    pub fn backward(&mut self, chunk_loss: &Tensor, chunk: &Chunk) -> candle_core::Result<()> {
        let weighted = (chunk_loss * chunk.weight())?;
        let mut g = weighted.backward()?;
        for v in &self.vars {
            let Some(new) = g.remove(v.as_tensor()) else {
                continue;
            };
            let sum = match self.grads.remove(v.as_tensor()) {
                Some(old) => (old + new)?.detach(),
                None => new.detach(),
            };
            self.grads.insert(v.as_tensor(), sum);
        }
        drop(g);
        self.loss += weighted
            .to_dtype(candle_core::DType::F64)?
            .to_scalar::<f64>()?;
        self.rows += chunk.len();
        Ok(())
    }

    /// The batch's mean loss so far (the weighted sum of the chunks' mean losses).
    pub fn loss(&self) -> f64 {
        self.loss
    }

    /// Rows backpropagated so far.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The summed gradients, for `Optimizer::step`.
    pub fn into_grads(self) -> GradStore {
        self.grads
    }
}

/// What [`train_step`] did.
#[derive(Debug)]
pub struct TrainedStep {
    /// The batch's mean loss (weighted sum of the chunks' mean losses).
    pub loss: f64,
    /// Rows that contributed to the update: always the whole batch.
    pub rows: usize,
    /// How the step went: plans tried, retries, the plan that worked.
    pub report: RetryReport,
}

/// Why [`train_step`] failed.
#[derive(Debug)]
pub enum TrainStepError {
    /// The micro-batches failed: not an OOM, or OOM at the smallest plan (the report is inside).
    Retry(RetryError<candle_core::Error>),
    /// The optimizer update failed. It is not retried (it runs once, after every micro-batch of
    /// one attempt succeeded, and may have updated some parameters already).
    Update {
        /// The optimizer's error.
        error: candle_core::Error,
        /// How the micro-batches went.
        report: Box<RetryReport>,
    },
}

impl fmt::Display for TrainStepError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TrainStepError::Retry(e) => write!(f, "{e}"),
            TrainStepError::Update { error, report } => write!(
                f,
                "the optimizer update failed after the micro-batches succeeded ({} retries); \
                 it was not retried, parameters may be partly updated: {error}",
                report.retries()
            ),
        }
    }
}

impl std::error::Error for TrainStepError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            TrainStepError::Retry(e) => Some(e),
            TrainStepError::Update { error, .. } => Some(error),
        }
    }
}

/// One training step over `batch` rows, kept alive through out-of-memory.
///
/// Each attempt runs `chunk_loss` for every chunk of the engine's plan (the first attempt: the
/// plan remembered for this call site and source, else the whole batch), backpropagating each
/// chunk's mean loss weighted by its share of the batch ([`GradAccumulator`]). On OOM the
/// attempt's tensors are dropped, the source's cache emptied, and the attempt reruns with more,
/// smaller micro-batches. The optimizer steps once, on the summed gradients, after every chunk
/// succeeded, and never reruns. Every row contributes to the update, whatever the split.
#[track_caller]
pub fn train_step<S, O>(
    engine: &RetryEngine,
    source: &S,
    batch: usize,
    vars: &[Var],
    optimizer: &mut O,
    mut chunk_loss: impl FnMut(&Chunk) -> candle_core::Result<Tensor>,
) -> Result<TrainedStep, TrainStepError>
where
    S: MemorySource + Clone,
    O: Optimizer,
{
    let retried = engine
        .run(
            source,
            batch,
            |plan: &BatchPlan| -> candle_core::Result<GradAccumulator> {
                let mut acc = GradAccumulator::new(vars);
                for c in plan.chunks() {
                    let loss = chunk_loss(&c)?;
                    acc.backward(&loss, &c)?;
                }
                Ok(acc)
            },
            |acc: GradAccumulator| {
                let (loss, rows) = (acc.loss(), acc.rows());
                optimizer.step(&acc.into_grads()).map(|()| (loss, rows))
            },
        )
        .map_err(TrainStepError::Retry)?;
    match retried.value {
        Ok((loss, rows)) => Ok(TrainedStep {
            loss,
            rows,
            report: retried.report,
        }),
        Err(error) => Err(TrainStepError::Update {
            error,
            report: Box::new(retried.report),
        }),
    }
}
