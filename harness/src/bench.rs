//! What a framework's example supplies to the phases: its memory source, fresh models with an
//! optimizer, seeded batches, a plain step and a guarded one, and its parameters to compare.

use std::fmt;
use std::sync::Arc;

use oomguard_runtime::retry::{
    find_max_batch, BatchPlan, FinderError, FinderOptions, FinderReport, RetryEngine, RetryReport,
};
use oomguard_runtime::train::TrainedStep;
use oomguard_runtime::{IsOom, MemorySource};

/// The optimizer of a fresh session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Optim {
    /// AdamW at `--lr`.
    AdamW,
    /// SGD at `--sgd-lr` (`equiv`).
    Sgd,
}

impl Optim {
    /// `adamw` or `sgd`, as the lines name it.
    pub fn name(self) -> &'static str {
        match self {
            Optim::AdamW => "adamw",
            Optim::Sgd => "sgd",
        }
    }
}

/// A framework's side of the phases. The guarded step is the framework crate's `train_step`,
/// the one generic step over its `TrainFramework`/`TrainUpdate`
/// (`oomguard_runtime::train::train_step`); the plain step is the framework's own loop with
/// nothing of oomguard in it, so that the phases can compare the two.
pub trait Bench {
    /// The framework's error (an out-of-memory is one a phase survives or counts).
    type Error: IsOom + fmt::Debug + fmt::Display;
    /// A model with its optimizer.
    type Session;
    /// A batch of rows on the device.
    type Batch;
    /// A copy of a session's parameters.
    type Params;

    /// Where the steps' memory comes from, as oomguard sees it.
    fn source(&self) -> &Arc<dyn MemorySource>;

    /// Tokens (or items) in a row, for `tokens_per_s`.
    fn row_len(&self) -> i64;

    /// A fresh model (the run's seeded initialisation: the same weights at every call) and
    /// `optim`.
    fn session(&self, optim: Optim) -> Result<Self::Session, Self::Error>;

    /// A seeded batch of `rows` rows; `salt` picks another batch.
    fn batch(&self, rows: i64, salt: u64) -> Result<Self::Batch, Self::Error>;

    /// One plain step (forward, backward, optimizer step), the device synchronised after it:
    /// the loss. A failed step leaves no gradient behind for the next.
    fn plain_step(&self, s: &mut Self::Session, b: &Self::Batch) -> Result<f64, Self::Error>;

    /// One step under oomguard (the framework's `train_step` with `engine`), the device
    /// synchronised after it. Every guarded step of a run goes through this one call site, as
    /// the engine remembers plans per call site.
    fn guarded_step(
        &self,
        engine: &RetryEngine,
        s: &mut Self::Session,
        b: &Self::Batch,
    ) -> Result<TrainedStep, String>;

    /// A copy of the session's parameters (in a fixed order).
    fn params(&self, s: &Self::Session) -> Result<Self::Params, String>;

    /// `‖a − b‖ / ‖a‖` over every parameter and the largest `|a − b|`; `Err` when the two are
    /// not the same parameters.
    fn compare(&self, a: &Self::Params, b: &Self::Params) -> Result<(f64, f64), String>;

    /// Parameter tensors (or elements) that hold a NaN or an infinity.
    fn non_finite_params(&self, s: &Self::Session) -> Result<i64, String>;

    /// The finder over `step` (the default: oomguard's `find_max_batch`; a framework that
    /// panics on out-of-memory wraps it with its catch).
    fn find_max_batch(
        &self,
        opts: FinderOptions,
        step: &mut dyn FnMut(usize) -> Result<f64, Self::Error>,
    ) -> Result<FinderReport, FinderError<Self::Error>> {
        find_max_batch(&**self.source(), opts, step)
    }
}

/// `2x40`: micro-batches × rows of each (the last may be smaller).
pub fn plan_str(p: &BatchPlan) -> String {
    format!("{}x{}", p.num_chunks(), p.micro_batch())
}

/// The attempts of a report, `plan:outcome` each, `-` when none failed.
pub fn attempts_str(r: &RetryReport) -> String {
    if r.attempts.is_empty() {
        return "-".into();
    }
    r.attempts
        .iter()
        .map(|a| format!("{}:{:?}", plan_str(&a.plan), a.outcome))
        .collect::<Vec<_>>()
        .join(",")
}
