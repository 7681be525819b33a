//! [`FinderError`]: why [`find_max_batch`](crate::retry::find_max_batch) found nothing.

use std::fmt;

use crate::retry_report::RetryReport;

use super::report::Trial;

/// [`find_max_batch`](crate::retry::find_max_batch) failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FinderError<E: fmt::Debug + fmt::Display> {
    /// The step failed with an error that is not out-of-memory.
    #[error("the step failed: {0}")]
    Step(E),
    /// Not even one row fits: every size tried ran out of memory, 1 row included; or, when
    /// [`FinderOptions::max_trials`](crate::retry::FinderOptions::max_trials) ended the search
    /// before 1 row was tried, every size tried (the text says so). The trials, the smallest
    /// one's [`Trial::oom_request`] (the request that failed with the fewest rows, when the
    /// error tells it) in the text with what to change.
    #[error("{}", nothing_fits(.0))]
    NothingFits(Vec<Trial>),
    /// The options were wrong.
    #[error("invalid finder options: {0}")]
    InvalidArgument(String),
    /// The device could not be queried.
    #[error("device error: {0}")]
    Device(#[from] crate::Error),
    /// The step retried out-of-memory itself (it runs an OOM retry engine or `#[oom_retry]`
    /// that shrank or split its batch): its success says nothing about the rows asked for, so
    /// the search would overestimate the maximum. Give the finder the step without its retry.
    #[error("the step retried internally at {rows} rows (it ran {report}); find_max_batch needs the step without its OOM retry")]
    RetriesInside {
        /// The rows asked for.
        rows: usize,
        /// The inner retry's report.
        report: Box<RetryReport>,
    },
    /// A retry engine inside the step ran the batch split into micro-batches (a plan remembered
    /// from earlier steps or a plan file, or a split start plan), so the trial measured one
    /// micro-batch's memory, not the rows asked for: its success says nothing about them.
    #[error("the step's retry engine ran {rows} rows split ({plan}{remembered}), so the trial measured a micro-batch, not {rows} rows; give find_max_batch the step without its OOM retry, or an engine with nothing remembered for it (a new RetryEngine, no plan file)", plan = .report.final_plan, remembered = if .report.from_memory { ", remembered from earlier steps" } else { "" })]
    SplitInside {
        /// The rows asked for.
        rows: usize,
        /// The inner step's report.
        report: Box<RetryReport>,
    },
    /// The step keeps memory between calls: in a verification loop, the bytes in use after
    /// each step kept rising over the second half of the steps (by more than 0.1% of the
    /// budget), so a loop of steps runs out of memory at any batch, sooner or later. A batch
    /// found would hold only until then: none is reported.
    #[error("the step keeps memory between calls: {} more in use after {steps} steps at {rows} rows than halfway through (it rose step after step), so a loop of steps runs out of memory at any batch; free what the step keeps between calls (tensors pushed into a Vec, a cache that grows), then measure again", crate::ByteSize(*.kept_bytes))]
    StepKeepsMemory {
        /// The rows of the verification loop.
        rows: usize,
        /// Steps it ran.
        steps: u32,
        /// How much the bytes in use after a step rose over the second half of the steps.
        kept_bytes: u64,
    },
    /// The search found a batch, but no batch down to the smallest verified ran
    /// [`FinderOptions::verify_steps`](crate::retry::FinderOptions::verify_steps) consecutive steps (in [`MAX_VERIFICATIONS`](crate::retry::MAX_VERIFICATIONS) runs): the
    /// source fragments over a loop of steps more than the step-down reached.
    #[error("the search found {found} rows, but no batch down to {smallest} rows ran {steps} consecutive steps ({} verification runs): the memory source fragments over a loop of steps; empty the cache between steps, or use oomguard's allocator", .verification.len())]
    LoopFails {
        /// The batch the search found.
        found: usize,
        /// The smallest batch the verification tried (its loop failed too).
        smallest: usize,
        /// Steps each verification ran for.
        steps: u32,
        /// The verification runs.
        verification: Vec<Trial>,
    },
    /// Every trial that ran measured a peak of 0 bytes: the step's memory comes from
    /// somewhere this source does not see, and a search would return `max` untested.
    #[error("the step's memory is invisible to the {measured}: its peak was 0 bytes at every size tried ({rows:?} rows). The step allocates from another source, or nothing this source counts. Measure the source its tensors come from: on CUDA, oomguard_candle::memory_source (candle), oomguard_tch::LibtorchCudaSource or the allocator oomguard_tch::allocator::install puts under libtorch (tch), oomguard_burn::memory_source (burn); on a simulated card, charge it what a chunk would hold on a GPU (Device::charge, oomguard_candle::charge, oomguard_tch::charge)")]
    Unmeasured {
        /// The source measured.
        measured: crate::source::SourceInfo,
        /// The rows of the trials that ran.
        rows: Vec<usize>,
    },
}

/// [`FinderError::NothingFits`]'s text.
fn nothing_fits(trials: &[Trial]) -> String {
    let runs = match trials.len() {
        1 => "1 trial".to_string(),
        n => format!("{n} trials"),
    };
    // The search ends at 1 row unless `max_trials` ended it first: then the smallest size
    // tried is more, and fewer rows may fit.
    let smallest = trials.iter().min_by_key(|t| t.rows);
    let rows = smallest.map_or(1, |t| t.rows);
    let mut text = if rows <= 1 {
        format!("out of memory even with 1 row (after {runs})")
    } else {
        format!(
            "out of memory at every size tried, down to {rows} rows (after {runs}): max_trials \
             ended the search before 1 row was tried; raise max_trials or lower start"
        )
    };
    if let Some(r) = smallest.and_then(|t| t.oom_request) {
        let whole = if r.budget { "budget" } else { "device" };
        let advice = if r.exceeds_capacity() {
            if rows <= 1 {
                format!("a larger {whole} is needed")
            } else {
                format!("fewer rows, or a larger {whole}")
            }
        } else {
            format!(
                "it fits the {whole}'s capacity but not what was free: free memory the program \
                 holds outside the step, or use a larger {whole}"
            )
        };
        text.push_str(&format!("; the {rows}-row run made {r}: {advice}"));
    }
    text
}
