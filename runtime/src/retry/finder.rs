//! A predictive batch-size finder: two small measured runs, a linear fit of peak memory, one jump
//! to the predicted maximum; a model-aimed, bisection-bounded search only if the prediction
//! fails. It runs the step for real: the model it measures is trained by it.
//!
//! Lightning doubles then bisects (13 step runs for GPT-2 small on an H100), Accelerate
//! multiplies by 0.9 from a guess (23 runs, 0.88 of the maximum), toma halves (5 runs, 0.58).
//! Memory of a training step is close to `fixed + per_row × rows`; measuring it at two sizes
//! predicts the largest batch that fits: at most 4 runs when memory is affine in the batch, more
//! when it is not (see [`find_max_batch`]).

use std::fmt;
use std::time::{Duration, Instant};

use super::classify::IsOom;
use crate::source::MemorySource;

/// Settings of [`find_max_batch`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FinderOptions {
    /// Rows of the first probe (at least 1).
    pub start: usize,
    /// The largest batch worth having (the search never goes above it).
    pub max: usize,
    /// Fraction of the memory left for the rows that is kept free as a safety margin on the
    /// jump (fragmentation, rounding), in `[0, 1)`.
    pub margin: f64,
    /// After a jump that ran with the peak the fit predicted, refit on the widest two points and
    /// try the refined prediction (one more run, with half the margin).
    pub refine: bool,
    /// Most trials in all (each runs the step [`FinderOptions::steps_per_trial`] times).
    pub max_trials: u32,
    /// Steps each trial runs back to back, without emptying the cache between them (at least
    /// 1; default 2): a batch counts as fitting only when every one of them ran. A loop of
    /// steps meets the memory the previous step left cached and fragmented, which a single step
    /// from an emptied cache does not (on the driver pool, single-step trials found batches
    /// that ran out of memory on the next step): with 2, the batch found is one that ran two
    /// consecutive steps on the source measured.
    pub steps_per_trial: u32,
    /// Consecutive steps the batch found must then run, without emptying the cache between
    /// them, before it is returned (default 32; 0: no verification). A source that fragments
    /// step after step fails here: on an H100, candle's GPT-2 loop on the driver's pool ran 20
    /// steps at the batch the search found (two steps per trial; 8 in a verification), then
    /// ran out of memory at every step (docs/GPU.md run 15c), so the default covers 32. The
    /// finder then steps down (by a fifth, then by halves, then bisecting between the largest
    /// batch verified and the smallest that failed, to within 5%) and returns the largest
    /// batch verified, in at most [`MAX_VERIFICATIONS`] verification runs. A loop that fails
    /// only after more steps than a verification ran is not caught.
    pub verify_steps: u32,
}

/// A verification whose held memory still rises runs up to this many times
/// [`FinderOptions::verify_steps`] steps (see [`find_max_batch`]).
pub const VERIFY_EXTENSION: u32 = 2;

/// Most verification runs (of [`FinderOptions::verify_steps`] steps each) after the search;
/// if none of them ran all its steps, [`find_max_batch`] fails with
/// [`FinderError::LoopFails`].
pub const MAX_VERIFICATIONS: usize = 12;

/// The defaults: `start` 1 row, `max` 2^20 rows, `margin` 0.03, `refine` on, `max_trials` 16,
/// `steps_per_trial` 2, `verify_steps` 32.
impl Default for FinderOptions {
    fn default() -> Self {
        Self {
            start: 1,
            max: 1 << 20,
            margin: 0.03,
            refine: true,
            max_trials: 16,
            steps_per_trial: 2,
            verify_steps: 32,
        }
    }
}

/// One trial: the step run [`FinderOptions::steps_per_trial`] times back to back at one size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Trial {
    /// Rows it ran with.
    pub rows: usize,
    /// Peak bytes allocated during the trial's steps above what was allocated before them;
    /// `None`: out of memory.
    pub peak_bytes: Option<u64>,
    /// Peak bytes the source held (used plus cached) during the steps, above what was in use
    /// before them (how much more than `peak_bytes` the source needed: fragmentation, rounding,
    /// and a cache kept from the trials before).
    pub reserved_peak_bytes: u64,
    /// Step runs the trial made (fewer than `steps_per_trial` when one ran out of memory; more
    /// in a verification extended while held memory was still rising).
    pub steps: u32,
    /// Verification runs: how much the most memory the source held rose over the second half
    /// of the steps (0: the loop had settled; the search's trials leave it 0).
    pub held_rise_bytes: u64,
    /// How long it took.
    pub elapsed: Duration,
}

/// `peak = fixed + per_row × rows`, fitted from two runs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinearFit {
    /// Bytes independent of the batch that the step allocates (gradients, workspace; not what
    /// was allocated before the search, such as the weights).
    pub fixed_bytes: f64,
    /// Bytes per row.
    pub per_row_bytes: f64,
}

impl LinearFit {
    /// The line through `(r1, p1)` and `(r2, p2)`; `None` when it does not grow with rows.
    pub fn through(r1: usize, p1: u64, r2: usize, p2: u64) -> Option<Self> {
        if r2 == r1 {
            return None;
        }
        let per_row = (p2 as f64 - p1 as f64) / (r2 as f64 - r1 as f64);
        (per_row > 0.0).then_some(Self {
            fixed_bytes: p1 as f64 - per_row * r1 as f64,
            per_row_bytes: per_row,
        })
    }
    /// Predicted peak for `rows`.
    pub fn peak(&self, rows: usize) -> f64 {
        self.fixed_bytes + self.per_row_bytes * rows as f64
    }
    /// The most rows whose predicted peak leaves `margin` of the room above the fixed part free
    /// under `budget` bytes.
    pub fn max_rows(&self, budget: u64, margin: f64) -> usize {
        let room = (budget as f64 - self.fixed_bytes).max(0.0) * (1.0 - margin);
        (room / self.per_row_bytes).floor().max(0.0) as usize
    }
}

/// The share of the micro-batch [`FinderReport::micro_batch_for`] computes for a batch larger
/// than the one found that a seeded step starts from: the layout of a larger batch's tensors
/// was never run by the finder's verification. Measured on an H100 (docs/GPU.md runs 45–51,
/// 2026-11-27), seeded at 4 × the batch found, 20 steps each:
/// - tch, an MLP under a 2 GiB budget on libtorch's caching allocator (19,953 rows found): with
///   room for the batch's tensors alone, 1 retry at a share of 1.0 and of 0.95, none at 0.9;
/// - candle, the same MLP on the driver's pool under a 2 GiB cap (3,814 rows found): with room
///   for the batch's tensors and one set of accumulated gradients, the share of 0.9 gave 5
///   micro-batches of 3,052 rows, which retried 2 times; plans of at most 2,900, 2,700, 2,500
///   and 2,200 rows retried none. 0.85 gives 6 micro-batches of 2,543.
pub const LARGER_BATCH_SHARE: f64 = 0.85;

/// What [`find_max_batch`] found, and how.
#[derive(Clone, Debug, PartialEq)]
pub struct FinderReport {
    /// The batch found: [`FinderReport::verified_steps`] consecutive steps of it ran on this
    /// source (or, with verification off, [`FinderReport::steps_per_trial`]; see
    /// [`FinderReport::safe_for`]).
    pub max_batch: usize,
    /// Every trial of the search, in order.
    pub trials: Vec<Trial>,
    /// Steps each trial ran back to back ([`FinderOptions::steps_per_trial`]).
    pub steps_per_trial: u32,
    /// The verification runs after the search, in order ([`FinderOptions::verify_steps`]
    /// consecutive steps each, more when extended; empty when verification is off). One of
    /// them ran all its steps at `max_batch` ([`FinderReport::verified`]); the bisection may
    /// have tried larger sizes after it, which ran out of memory, so it need not be the last.
    pub verification: Vec<Trial>,
    /// The source measured.
    pub source: crate::source::SourceInfo,
    /// The fit used for the jump (the refined one if a refinement ran). Its `fixed_bytes` can
    /// be slightly negative (peaks that grow a little faster than the rows); the report's
    /// `Display` shows it as 0 and says so.
    pub fit: Option<LinearFit>,
    /// Bytes available to the step's peak (what the device could still give, cache emptied).
    pub budget_bytes: u64,
    /// The search ended because it used `max_trials` runs, not because it was within
    /// 0.95 of the limit: `max_batch` may be further from the maximum.
    pub stopped_by_max_trials: bool,
    /// Bytes per row that the batch itself holds for the whole step (its tensors), when the
    /// finder ran the training step's own attempt (the framework crates' `find_max_batch_train`
    /// set it); `None` otherwise. A step of a larger batch split into micro-batches holds the
    /// whole batch's tensors while each micro-batch runs:
    /// [`FinderReport::micro_batch_for`] leaves room for them.
    pub batch_bytes_per_row: Option<u64>,
    /// Bytes a step split into micro-batches holds beyond what the finder's one-chunk runs
    /// held: the gradients accumulated over the chunks before the last (and, where a framework
    /// sums a chunk's gradients into a new set, that set too), when the finder ran the training
    /// step's own attempt (the framework crates' `find_max_batch_train` set it from the trained
    /// parameters' bytes); `None` otherwise. [`FinderReport::micro_batch_for`] leaves room
    /// for them.
    pub accumulation_bytes: Option<u64>,
}

impl FinderReport {
    /// The micro-batch a training step of `batch` rows can run in: `max_batch` for a batch of
    /// at most that many rows (one chunk, as the finder ran it); for a larger one, fewer rows
    /// by the room that a split step needs beyond the finder's runs, over the bytes per row of
    /// the rest of the step (its peak's bytes per row less the batch's):
    /// [`FinderReport::batch_bytes_per_row`] × the extra rows (the whole batch's tensors stay
    /// held) plus [`FinderReport::accumulation_bytes`] (the accumulated gradients); then
    /// [`LARGER_BATCH_SHARE`] of that (the layout of a larger batch's tensors was not verified
    /// by the finder), at least 1. With neither figure, `max_batch`.
    pub fn micro_batch_for(&self, batch: usize) -> usize {
        let m = self.max_batch.max(1);
        if batch <= m || (self.batch_bytes_per_row.is_none() && self.accumulation_bytes.is_none()) {
            return m;
        }
        let Some(per_row) = self.bytes_per_row() else {
            return m;
        };
        let held = self.batch_bytes_per_row.unwrap_or(0);
        let rest = per_row - held as f64;
        if rest <= 0.0 {
            return 1;
        }
        let extra = held as f64 * (batch - m) as f64 + self.accumulation_bytes.unwrap_or(0) as f64;
        let fits = m.saturating_sub((extra / rest).ceil() as usize) as f64;
        ((fits * LARGER_BATCH_SHARE).floor() as usize).max(1)
    }

    /// Bytes per row of the step's peak: the verified run's peak over its rows, else the fit's
    /// (a fit through the first probes can be far off: 12 MB a row for a step that took 86 KB
    /// a row at its largest batch, on an H100).
    fn bytes_per_row(&self) -> Option<f64> {
        self.verified()
            .and_then(|t| Some(t.peak_bytes? as f64 / t.rows.max(1) as f64))
            .filter(|p| *p > 0.0)
            .or_else(|| self.fit.map(|f| f.per_row_bytes).filter(|p| *p > 0.0))
    }

    /// The verification run that `max_batch` passed (`None`: verification was off).
    pub fn verified(&self) -> Option<&Trial> {
        self.verification
            .iter()
            .rev()
            .find(|t| t.rows == self.max_batch && t.peak_bytes.is_some())
    }

    /// Consecutive steps `max_batch` ran in its verification: at least
    /// [`FinderOptions::verify_steps`], more when the verification was extended (0: not
    /// verified).
    pub fn verified_steps(&self) -> u32 {
        self.verified().map_or(0, |t| t.steps)
    }

    /// The most memory the source held was still rising at the end of `max_batch`'s
    /// verification, after its extension: it rose by more than 0.1% of
    /// [`FinderReport::budget_bytes`] over the second half of the steps. The loop had not
    /// settled, so a loop longer than [`FinderReport::verified_steps`] may run out of memory
    /// at `max_batch` (candle on the driver's pool on an H100 did: docs/GPU.md run 16).
    pub fn held_still_rising(&self) -> bool {
        self.verified()
            .is_some_and(|t| t.held_rise_bytes > rise_tolerance(self.budget_bytes))
    }

    /// How often a loop at `max_batch` should empty the source's cache: every half of
    /// [`FinderReport::verified_steps`] steps when the held memory was still rising at the end of
    /// the verification ([`FinderReport::held_still_rising`]), `None` when it had settled or was
    /// not verified. Each verification starts from an emptied cache, so emptying it every `n`
    /// steps repeats stretches of the verified loop; half, not all, of the verified steps
    /// because such a source varies from one loop to the next: on an H100, candle's GPT-2 on
    /// the driver's pool ran 64 verified steps at 16 rows, and later loops at 16 from an
    /// emptied cache failed from step 47 and step 68 (docs/GPU.md run 16b).
    ///
    /// ```
    /// # extern crate oomguard_runtime as oomguard; // as the facade re-exports it
    /// use oomguard::retry::{find_max_batch, FinderOptions};
    /// use oomguard::source::MemorySource;
    /// use oomguard::{ByteSize, Device};
    /// let dev = Device::sim(ByteSize::mib(256));
    /// let step = |rows: usize| dev.alloc::<u8>(rows << 20).map(drop);
    /// let report = find_max_batch(&dev, FinderOptions::default(), step).unwrap();
    /// // oomguard's allocator settles (None); the driver's pool under candle did not.
    /// assert_eq!(report.empty_cache_every(), None);
    /// for k in 0..100usize {
    ///     if report.empty_cache_every().is_some_and(|n| k > 0 && k % n as usize == 0) {
    ///         MemorySource::empty_cache(&dev).unwrap();
    ///     }
    ///     step(report.max_batch).unwrap();
    /// }
    /// ```
    pub fn empty_cache_every(&self) -> Option<u32> {
        self.held_still_rising()
            .then(|| (self.verified_steps() / 2).max(1))
    }

    /// Number of trials of the search (each of up to [`FinderReport::steps_per_trial`] step
    /// runs; the verification runs are not counted here).
    pub fn runs(&self) -> usize {
        self.trials.len()
    }

    /// Number of times the step ran, the search's trials and the verification runs together.
    pub fn step_runs(&self) -> usize {
        self.trials
            .iter()
            .chain(&self.verification)
            .map(|t| t.steps as usize)
            .sum()
    }

    /// The smallest batch that ran out of memory in the search or its verification, if any:
    /// `max_batch` is below it. The search assumes that a step's memory grows with its batch,
    /// so once a size fails it looks only below it (a larger size it tried earlier failed
    /// too). Where memory does not grow monotonically, a larger batch above it may still run:
    /// burn 0.21 on an H100 ran 44 and 53–64 rows of GPT-2 small but not 47–50 (cubecl packs
    /// a step's tensors into pages of fixed sizes; docs/GPU.md run 19), and the finder
    /// returned 44, below 47.
    pub fn smallest_failed(&self) -> Option<usize> {
        self.trials
            .iter()
            .chain(&self.verification)
            .filter(|t| t.peak_bytes.is_none())
            .map(|t| t.rows)
            .min()
    }

    /// What `max_batch` is safe for, in words: consecutive steps on the measured source, with
    /// nothing else allocating more than when it was measured.
    pub fn safe_for(&self) -> String {
        let steps = match (self.verified_steps(), self.steps_per_trial) {
            (v, _) if v > 1 => format!(
                "a loop of steps: {v} consecutive steps ran at it without emptying the cache \
                 between them (verification)"
            ),
            (_, 1) => "single steps, each from an emptied cache (steps_per_trial 1, no \
                  verification: a loop of steps may run out of memory)"
                .to_string(),
            (_, n) => format!(
                "a loop of steps: {n} consecutive steps ran at it without emptying the cache \
                 between them"
            ),
        };
        let mut said = format!(
            "{steps}, on the {} as measured (with other memory use as it was during the search)",
            self.source
        );
        if let (Some(t), Some(n)) = (self.verified(), self.empty_cache_every()) {
            said.push_str(&format!(
                "; the memory it held was still rising at the end ({} B more over the second \
                 half of the steps): the loop had not settled, so a longer one may run out of \
                 memory; empty the cache at least every {n} steps (half the verified steps: \
                 such a loop varies from one run to the next)",
                t.held_rise_bytes
            ));
        }
        said
    }
}

impl fmt::Display for FinderReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "max batch {} after {} trials ({} step runs)",
            self.max_batch,
            self.trials.len(),
            self.step_runs()
        )?;
        if let Some(fit) = &self.fit {
            if fit.fixed_bytes < 0.0 {
                // A negative fixed part means nothing physical: the line through two peaks
                // that grow slightly faster than the rows (rounding to blocks) crosses below 0.
                write!(
                    f,
                    " (fit: 0 B + {:.0} B/row; the line through the measured peaks crosses 0 \
                     rows at {:.0} B, clamped to 0: memory grows a little faster than the rows)",
                    fit.per_row_bytes, fit.fixed_bytes
                )?;
            } else {
                write!(
                    f,
                    " (fit: {:.0} B + {:.0} B/row)",
                    fit.fixed_bytes, fit.per_row_bytes
                )?;
            }
        }
        write!(f, "\n  safe for {}", self.safe_for())?;
        if let Some(failed) = self.smallest_failed() {
            write!(
                f,
                "\n  the largest batch found below {failed} rows, the smallest that ran out of \
                 memory (the search assumes memory grows with the batch and does not look above \
                 a size that failed)"
            )?;
        }
        for t in &self.trials {
            match t.peak_bytes {
                Some(p) => write!(
                    f,
                    "\n  {} rows: peak {p} B ({} B held), {} steps",
                    t.rows, t.reserved_peak_bytes, t.steps
                )?,
                None => write!(f, "\n  {} rows: out of memory at step {}", t.rows, t.steps)?,
            }
        }
        for t in &self.verification {
            match t.peak_bytes {
                Some(p) => write!(
                    f,
                    "\n  verified {} rows: {} consecutive steps ran, peak {p} B ({} B held, {} B more in the second half)",
                    t.rows, t.steps, t.reserved_peak_bytes, t.held_rise_bytes
                )?,
                None => write!(
                    f,
                    "\n  verification of {} rows: out of memory at step {} ({} B held)",
                    t.rows, t.steps, t.reserved_peak_bytes
                )?,
            }
        }
        Ok(())
    }
}

/// [`find_max_batch`] failed.
#[derive(Debug, thiserror::Error)]
pub enum FinderError<E: fmt::Debug + fmt::Display> {
    /// The step failed with an error that is not out-of-memory.
    #[error("the step failed: {0}")]
    Step(E),
    /// Not even one row fits.
    #[error("out of memory even with 1 row (after {} runs)", .0.len())]
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
        report: Box<super::report::RetryReport>,
    },
    /// A retry engine inside the step ran the batch split into micro-batches (a plan remembered
    /// from earlier steps or a plan file, or a split start plan), so the trial measured one
    /// micro-batch's memory, not the rows asked for: its success says nothing about them.
    #[error("the step's retry engine ran {rows} rows split ({plan}{remembered}), so the trial measured a micro-batch, not {rows} rows; give find_max_batch the step without its OOM retry, or an engine with nothing remembered for it (a new RetryEngine, no plan file)", plan = .report.final_plan, remembered = if .report.from_memory { ", remembered from earlier steps" } else { "" })]
    SplitInside {
        /// The rows asked for.
        rows: usize,
        /// The inner step's report.
        report: Box<super::report::RetryReport>,
    },
    /// The search found a batch, but no batch down to the smallest verified ran
    /// [`FinderOptions::verify_steps`] consecutive steps (in [`MAX_VERIFICATIONS`] runs): the
    /// source fragments over a loop of steps more than the step-down reached.
    #[error("the search found {found} rows, but no batch down to {smallest} rows ran {steps} consecutive steps ({} verification runs): the memory source fragments over a loop of steps; empty the cache between steps, or use oomguard's allocator", .verification.len())]
    LoopFails {
        /// The batch the search found.
        found: usize,
        /// The smallest batch verified.
        smallest: usize,
        /// Steps each verification ran for.
        steps: u32,
        /// The verification runs.
        verification: Vec<Trial>,
    },
    /// Every trial that ran measured a peak of 0 bytes: the step's memory comes from
    /// somewhere this source does not see, and a search would return `max` untested.
    #[error("the step's memory is invisible to the {measured}: its peak was 0 bytes at every size tried ({rows:?} rows). The step allocates from another source (candle's CUDA tensors come from the driver pool: pass oomguard_candle's memory_source or a DriverPool, not a Device), or allocates nothing")]
    Unmeasured {
        /// The source measured.
        measured: crate::source::SourceInfo,
        /// The rows of the trials that ran.
        rows: Vec<usize>,
    },
}

/// Peak bytes allocated and held while `f` runs, above what was allocated and held when it
/// started (what a `PeakScope` around `f` reports: this is the one place to switch to it).
fn measure_peak<S: MemorySource + ?Sized, T>(
    device: &S,
    f: impl FnOnce() -> T,
) -> Result<(T, u64, u64), crate::Error> {
    device.reset_peak()?;
    let before = device.usage()?;
    let out = f();
    let after = device.usage()?;
    // (held: above what was in use before, so that memory a kept cache already held counts)
    Ok((
        out,
        after.used_peak.saturating_sub(before.used),
        after.reserved_peak.saturating_sub(before.used),
    ))
}

/// A held-memory rise over the second half of a verification above this (0.1% of the memory
/// available to the step) means the loop has not settled.
fn rise_tolerance(budget: u64) -> u64 {
    budget / 1000
}

/// How much the running held peak rose over the second half of the steps (`held[k]`: the most
/// the source held by the end of step `k + 1`).
fn held_rise(held: &[u64]) -> u64 {
    match held.len() {
        0 | 1 => 0,
        n => held[n - 1].saturating_sub(held[n / 2 - 1]),
    }
}

/// Finds the largest batch for which `step(rows)` runs without out-of-memory on `device`.
///
/// Runs the step at `start` and `8 × start` rows while measuring peak memory, fits
/// `peak = fixed + per_row × rows`, jumps to the predicted maximum under the available memory
/// minus the margin, and, when the jump's peak is the predicted one, refines once: **at most 4
/// runs when peak memory is affine in the batch** (3 without `refine`). "Runs" below are
/// trials: each trial runs the step [`FinderOptions::steps_per_trial`] times back to back (2 by
/// default, so 4 trials are 8 step runs; [`FinderReport::step_runs`] counts them), and a size
/// fits only when all of them ran, so the batch found holds for consecutive steps on the
/// source measured, not only for one step from an emptied cache
/// ([`FinderReport::safe_for`] says so). The cache is emptied before the search and at the end,
/// and before each trial when the source asks for it after an out-of-memory
/// ([`MemorySource::retry_empties_cache`]: fixed segments, libtorch's and the driver's caches;
/// not oomguard's growable segments, whose free pages move to any request).
/// Then the batch found runs [`FinderOptions::verify_steps`] consecutive steps (32 by default;
/// one more run, not counted in [`FinderReport::runs`]), and goes on, up to
/// [`VERIFY_EXTENSION`] times as many, while the most memory the source held still rose over the
/// second half of the steps (by more than 0.1% of the memory available: the loop has not
/// settled). A source that fragments over a loop of steps makes it fail there (candle on the
/// driver's pool on an H100: 20 steps ran at the search's batch, then every step ran out of
/// memory, while the held peak of its first 8 steps was flat), and the finder steps down to the
/// largest batch that ran the whole loop ([`FinderReport::verification`];
/// [`FinderError::LoopFails`] if none did). Where the held peak was still rising at the end of
/// that batch's verification, the loop never settled and no length of verification makes an
/// endless loop safe: the report says so ([`FinderReport::held_still_rising`]) and how often to
/// empty the cache ([`FinderReport::empty_cache_every`]; a warning is logged too).
///
/// Otherwise the search goes on until the largest batch that ran is at least 0.95 of the
/// largest batch below the smallest one that did not (the 0.95 tolerance; the maximum lies between
/// them), so the result is always at least 0.95 of the true maximum (or `max`). It aims where a
/// model of the measured peaks meets the budget (a parabola through the three largest
/// successes, else the secant through two; a power law while memory grows more slowly than
/// the rows), follows a model whose last prediction came true, keeps every other probe where a
/// bisection of the bracket could still end the search in the runs left (8 in all, or the
/// fewest bisection needs), and bisects once a model aims at a size that already failed. Runs
/// measured on simulated steps (docs/BENCHMARKS.md): 5–8 on quadratic, bucketed and concave
/// steps and on memory jumps that the peaks point to; where memory jumps at a row that nothing
/// measured points to (the limit is the jump itself), no search can do better than bisecting
/// between `8 × start` and the failed jump, and this one takes at most that: 9–10 runs for a
/// prediction 100–500× the jump, 11 for 2,000×. If `max_trials` ends the search first,
/// [`FinderReport::stopped_by_max_trials`] says so (and a warning is logged).
///
/// **It trains the model it measures.** Every trial runs real steps (forward, backward and the
/// optimizer's update), so the model and the optimizer's state change with each of them (2 step
/// runs per trial, then 32 or more in the verification: [`FinderReport::step_runs`]). Measure on
/// a copy, or save the parameters and the optimizer's state before and restore them after
/// (or give the step a learning rate of 0 when the update's memory is what matters). To start
/// training from the batch found, seed the engine with
/// [`RetryEngine::start_from_finder`](super::RetryEngine::start_from_finder).
///
/// The step should do what a real step does (forward, backward, optimizer), keep nothing
/// between calls, and not retry out-of-memory itself. Refused with an error that says why:
/// a step that retried or shrank its batch ([`FinderError::RetriesInside`]); a step whose retry
/// engine ran a split plan, remembered or not, on this thread, nested steps included
/// ([`FinderError::SplitInside`]: the trial measured a micro-batch); a step whose memory the
/// source does not see, peak 0 bytes at two sizes ([`FinderError::Unmeasured`]). Defaults:
/// [`FinderOptions::default`].
///
/// ```
/// # extern crate oomguard_runtime as oomguard; // as the facade re-exports it
/// use oomguard::retry::{find_max_batch, FinderOptions};
/// use oomguard::{ByteSize, Device};
/// let dev = Device::sim(ByteSize::mib(256));
/// // 16 MiB of fixed workspace plus 1 MiB of activations per row: about 240 rows fit.
/// let report = find_max_batch(&dev, FinderOptions::default(), |rows| {
///     let _ws = dev.alloc::<u8>(16 << 20)?;
///     let _acts = dev.alloc::<u8>(rows << 20)?;
///     Ok::<_, oomguard::Error>(())
/// }).unwrap();
/// assert!(report.max_batch >= 228 && report.max_batch <= 240, "{report}");
/// assert!(report.runs() <= 4); // trials: 8 step runs, two consecutive steps per size
/// ```
pub fn find_max_batch<S: MemorySource + ?Sized, T, E>(
    device: &S,
    opts: FinderOptions,
    mut step: impl FnMut(usize) -> Result<T, E>,
) -> Result<FinderReport, FinderError<E>>
where
    E: IsOom + fmt::Debug + fmt::Display,
{
    if opts.start == 0 || opts.max < opts.start {
        return Err(FinderError::InvalidArgument(format!(
            "start {} and max {}: need 1 <= start <= max",
            opts.start, opts.max
        )));
    }
    if !(0.0..1.0).contains(&opts.margin) {
        return Err(FinderError::InvalidArgument(format!(
            "margin {}: must be in [0, 1)",
            opts.margin
        )));
    }
    if opts.max_trials < 2 {
        return Err(FinderError::InvalidArgument(format!(
            "max_trials {}: at least 2 runs are needed",
            opts.max_trials
        )));
    }
    if opts.steps_per_trial == 0 {
        return Err(FinderError::InvalidArgument(
            "steps_per_trial 0: each trial must run the step at least once".into(),
        ));
    }
    device.empty_cache()?;
    // Room for the step: what the device can still give (the cache is empty), capped by the
    // allocator's limit.
    let budget = device.available()?;

    let mut trials: Vec<Trial> = Vec::new();
    let steps_per_trial = opts.steps_per_trial;
    // A trial: `steps_per_trial` steps back to back; with `extend_to` above it (verification),
    // more while the source's held peak still rose over the second half of the steps so far.
    let mut run = |rows: usize,
                   steps_per_trial: u32,
                   extend_to: u32,
                   trials: &mut Vec<Trial>|
     -> Result<Option<u64>, FinderError<E>> {
        // A cache whose free memory serves any request (oomguard's growable segments move pages
        // to where a request needs them) is kept between trials: emptying it only unmapped
        // every page for the next trial to map again (2 MiB at a time: 63 s for 11 trials on an
        // H100 where libtorch's 20 MiB pages took 25.5 s for 10, docs/GPU.md run 55).
        if device.retry_empties_cache() {
            device.empty_cache()?;
        }
        let t0 = Instant::now();
        let mut steps = 0;
        let mut inner = None;
        let mut held: Vec<u64> = Vec::new();
        let mut rise = 0;
        let mut usage_error = None;
        // The trial's steps back to back, the cache kept between them, under one peak.
        let (res, peak, reserved_peak) = measure_peak(device, || {
            super::report::watch_steps(true);
            let mut res = Ok(());
            loop {
                if steps >= steps_per_trial {
                    rise = held_rise(&held);
                    if steps >= extend_to || rise <= rise_tolerance(budget) {
                        break;
                    }
                }
                steps += 1;
                if let Err(e) = step(rows) {
                    res = Err(e);
                    break;
                }
                if extend_to > steps_per_trial {
                    match device.usage() {
                        Ok(u) => held.push(u.reserved_peak),
                        Err(e) => {
                            usage_error = Some(e);
                            break;
                        }
                    }
                }
            }
            inner = super::report::watch_steps(false);
            usage_error.map_or(Ok(res), Err)
        })?;
        let res = res?;
        if let Some(r) = inner {
            let report = Box::new(r);
            return Err(
                if report.retries() == 0 && report.final_plan.batch() == report.requested_batch {
                    FinderError::SplitInside { rows, report }
                } else {
                    FinderError::RetriesInside { rows, report }
                },
            );
        }
        let peak_bytes = match res {
            Ok(()) => Some(peak),
            Err(e) if e.is_oom() => None,
            Err(e) => return Err(FinderError::Step(e)),
        };
        trials.push(Trial {
            rows,
            peak_bytes,
            reserved_peak_bytes: reserved_peak,
            steps,
            held_rise_bytes: rise,
            elapsed: t0.elapsed(),
        });
        tracing::debug!(target: "oomguard::retry", rows, ?peak_bytes, steps, "batch finder trial");
        // Nothing measured at two sizes (or at the only size there is): the search would
        // climb to `max` on nothing.
        let successes: Vec<&Trial> = trials.iter().filter(|t| t.peak_bytes.is_some()).collect();
        let all_zero = successes.iter().all(|t| t.peak_bytes == Some(0));
        if all_zero && (successes.len() >= 2 || (peak_bytes.is_some() && rows >= opts.max)) {
            return Err(FinderError::Unmeasured {
                measured: device.info(),
                rows: successes.iter().map(|t| t.rows).collect(),
            });
        }
        Ok(peak_bytes)
    };
    let budget_left = |trials: &Vec<Trial>| (trials.len() as u32) < opts.max_trials;

    let search = Search::new(budget, opts);
    let mut state = SearchState::default();
    let mut stopped_by_trials = false;
    while let Some(probe) = search.next_probe(&state, &trials) {
        if !budget_left(&trials) {
            stopped_by_trials = true;
            break;
        }
        let peak = run(probe.rows, steps_per_trial, steps_per_trial, &mut trials)?;
        state.observe(&search, probe, peak, &trials);
    }
    if state.l == 0 {
        device.empty_cache()?;
        return Err(FinderError::NothingFits(trials));
    }
    // Verification: the batch found must run a loop of steps, not only a trial's few.
    let mut verification = Vec::new();
    let mut max_batch = state.l;
    if opts.verify_steps > 0 {
        let (mut ok, mut failed): (Option<usize>, Option<usize>) = (None, None);
        let mut rows = state.l;
        while verification.len() < MAX_VERIFICATIONS {
            let mut v = Vec::new();
            let most = opts.verify_steps.saturating_mul(VERIFY_EXTENSION);
            let peak = run(rows, opts.verify_steps, most, &mut v)?;
            verification.extend(v);
            if peak.is_some() {
                ok = Some(rows);
            } else {
                failed = Some(rows);
            }
            rows = match (ok, failed) {
                (Some(_), None) => break,
                // a fifth down first (the search's batch is usually near), then by halves
                (None, Some(h)) if h > 1 && verification.len() == 1 => (h * 4 / 5).min(h - 1),
                (None, Some(h)) if h > 1 => h / 2,
                // not even 1 row ran the loop (or nothing ran, which cannot be)
                (None, _) => break,
                (Some(l), Some(h)) if settled(l, h) => break,
                (Some(l), Some(h)) => bisection_point(l, h),
            };
        }
        match ok {
            Some(l) => max_batch = l,
            None => {
                device.empty_cache()?;
                return Err(FinderError::LoopFails {
                    found: state.l,
                    smallest: verification.iter().map(|t| t.rows).min().unwrap_or(state.l),
                    steps: opts.verify_steps,
                    verification,
                });
            }
        }
        if max_batch < state.l {
            tracing::warn!(
                target: "oomguard::retry",
                found = state.l,
                verified = max_batch,
                steps = opts.verify_steps,
                "find_max_batch: the batch the search found ran out of memory within a loop of steps; returning the largest batch verified"
            );
        }
    }
    // Leave the source as found: what the last trials cached (the sizes that failed
    // included) would not serve the steps that follow.
    device.empty_cache()?;
    if stopped_by_trials {
        tracing::warn!(
            target: "oomguard::retry",
            runs = trials.len(),
            "find_max_batch: stopped by max_trials before the bracket was within 5%"
        );
    }
    let report = FinderReport {
        max_batch,
        trials,
        steps_per_trial: opts.steps_per_trial,
        verification,
        source: device.info(),
        fit: state.fit,
        budget_bytes: budget,
        stopped_by_max_trials: stopped_by_trials,
        batch_bytes_per_row: None,
        accumulation_bytes: None,
    };
    if let Some(every) = report.empty_cache_every() {
        tracing::warn!(
            target: "oomguard::retry",
            rows = max_batch,
            every,
            held_rise_bytes = report.verified().map_or(0, |t| t.held_rise_bytes),
            "find_max_batch: the memory the source held was still rising at the end of the verification; a longer loop may run out of memory: empty the cache at least every {every} steps"
        );
    }
    Ok(report)
}

/// Step runs the search aims to stay within after the linear prediction failed: it follows its
/// models (parabola, secant) only as far as bisection could still settle the bracket in what
/// is left of these, and bisects once they are spent.
const TARGET_RUNS: usize = 8;

/// What a probe is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ProbeKind {
    /// The first run, at `start`.
    Start,
    /// The second, at `8 × start`: the other point of the linear fit.
    Second,
    /// The jump to the maximum the linear fit predicts.
    Jump,
    /// The refinement after a jump whose peak the fit predicted.
    Refine,
    /// Anything else (searching a bracket, or climbing without one).
    Search,
}

#[derive(Clone, Copy, Debug)]
struct Probe {
    rows: usize,
    kind: ProbeKind,
    /// The peak the model predicted for it.
    predicted: Option<f64>,
}

/// The fixed inputs of the search.
struct Search {
    budget: u64,
    opts: FinderOptions,
}

/// What the runs so far say.
#[derive(Debug, Default)]
struct SearchState {
    /// The largest batch that ran (0: none yet).
    l: usize,
    /// Its peak.
    l_peak: u64,
    /// The smallest batch that did not run.
    h: Option<usize>,
    /// The linear fit of the jump (refitted through the jump when it ran as predicted).
    fit: Option<LinearFit>,
    /// The jump ran and its peak is what the fit predicted: memory looks affine.
    affine: bool,
    /// The affine prediction was confirmed by a refinement (or needs none): done.
    trusted: bool,
    /// A jump or refine was tried.
    jumped: bool,
    /// The last run's peak was what the model predicted (within 2% of the budget).
    model_held: bool,
}

/// The bracket `(l, h)` (l ran, h did not) pins the maximum, which lies in `l..h`: `l` is at
/// least [`TOLERANCE`] of `h - 1`.
fn settled(l: usize, h: usize) -> bool {
    h <= l.saturating_add(1) || l as f64 >= TOLERANCE * (h - 1) as f64
}

/// The largest `h` for which `(l, h)` is settled: a failure there ends the search.
fn settle_above(l: usize) -> usize {
    let mut h = ((l as f64 / TOLERANCE).floor() as usize).saturating_add(1);
    while h > l.saturating_add(1) && !settled(l, h) {
        h -= 1;
    }
    while h < usize::MAX && settled(l, h + 1) {
        h += 1;
    }
    h.max(l.saturating_add(1))
}

/// The smallest `l` for which `(l, h)` is settled: a success there ends the search.
fn settle_below(h: usize) -> usize {
    let mut l = (TOLERANCE * h.saturating_sub(1) as f64).ceil() as usize;
    while l > 0 && settled(l - 1, h) {
        l -= 1;
    }
    while !settled(l, h) {
        l += 1;
    }
    l.min(h.saturating_sub(1))
}

/// `settle_above` applied `2^k` times from `l`, stopping at `stop`: with `k` runs, a bisection
/// settles any bracket `(l, h)` with `h` up to this.
fn reach_above(l: usize, k: u32, stop: usize) -> usize {
    let mut x = l;
    for _ in 0..(1u64 << k.min(20)) {
        if x >= stop {
            break;
        }
        x = settle_above(x);
    }
    x
}

/// `settle_below` applied `2^k` times from `h`, stopping at `stop`.
fn reach_below(h: usize, k: u32, stop: usize) -> usize {
    let mut x = h;
    for _ in 0..(1u64 << k.min(20)) {
        if x <= stop {
            break;
        }
        x = settle_below(x);
    }
    x
}

/// The runs a bisection needs, whatever the memory does, to settle `(l, h)`: the fewest `k`
/// with `reach_above(l, k) >= h`.
fn bisection_runs(l: usize, h: usize) -> u32 {
    let mut steps = 0u64;
    let mut x = l;
    while x < h && steps < 1 << 20 {
        x = settle_above(x);
        steps += 1;
    }
    // ceil(log2(steps))
    if steps <= 1 {
        0
    } else {
        64 - (steps - 1).leading_zeros()
    }
}

/// The probe that halves what bisection has left to do in `(l, h)`: as many settling steps
/// ([`settle_above`]) below it as above it.
fn bisection_point(l: usize, h: usize) -> usize {
    let mut steps = 0u64;
    let mut x = l;
    while x < h && steps < 1 << 20 {
        x = settle_above(x);
        steps += 1;
    }
    reach_steps(l, steps / 2, h).clamp(l.saturating_add(1), h.saturating_sub(1).max(l + 1))
}

/// `settle_above` applied `n` times from `l`, stopping at `stop`.
fn reach_steps(l: usize, n: u64, stop: usize) -> usize {
    let mut x = l;
    for _ in 0..n {
        if x >= stop {
            break;
        }
        x = settle_above(x);
    }
    x
}

impl Search {
    fn new(budget: u64, opts: FinderOptions) -> Self {
        Self { budget, opts }
    }

    /// The most rows a model of the successes allows under `target` peak bytes: the parabola
    /// through the three largest (memory growing faster than the rows), else the secant through
    /// the two largest.
    fn model(&self, successes: &[(usize, u64)], target: f64) -> Option<usize> {
        if let [.., a, b, c] = successes {
            if let Some(g) = quadratic_rows(*a, *b, *c, target) {
                return Some(g);
            }
        }
        if let [.., (r1, p1), (r2, p2)] = successes {
            let f = LinearFit::through(*r1, *p1, *r2, *p2)?;
            let rows = (target - f.fixed_bytes) / f.per_row_bytes;
            return Some(if rows >= usize::MAX as f64 {
                usize::MAX
            } else {
                rows.floor().max(0.0) as usize
            });
        }
        None
    }

    /// The peak the model of [`Search::model`] predicts at `rows`.
    fn model_peak(&self, successes: &[(usize, u64)], rows: usize) -> Option<f64> {
        if let [.., a, b, c] = successes {
            if let Some(y) = quadratic_peak(*a, *b, *c, rows) {
                return Some(y);
            }
        }
        if let [.., (r1, p1), (r2, p2)] = successes {
            return LinearFit::through(*r1, *p1, *r2, *p2).map(|f| f.peak(rows));
        }
        None
    }

    /// The next run, or `None` when the search is over.
    fn next_probe(&self, s: &SearchState, trials: &[Trial]) -> Option<Probe> {
        let opts = &self.opts;
        if trials.is_empty() {
            return Some(Probe {
                rows: opts.start,
                kind: ProbeKind::Start,
                predicted: None,
            });
        }
        if s.trusted || s.l >= opts.max || s.h.is_some_and(|h| settled(s.l, h)) {
            return None;
        }
        let mut successes: Vec<(usize, u64)> = trials
            .iter()
            .filter_map(|t| t.peak_bytes.map(|p| (t.rows, p)))
            .collect();
        successes.sort_unstable();
        successes.dedup_by_key(|x| x.0);
        // Probes 1 and 2: the two points of the linear fit.
        if trials.len() == 1 && s.l == opts.start {
            return Some(Probe {
                rows: opts.start.saturating_mul(8).min(opts.max),
                kind: ProbeKind::Second,
                predicted: None,
            });
        }
        let budget = self.budget as f64;
        // The jump, then the refinement: the linear fit's predictions.
        if s.h.is_none() && !s.jumped {
            if let Some(f) = s.fit {
                let jump = f.max_rows(self.budget, opts.margin).min(opts.max);
                if jump > s.l {
                    return Some(Probe {
                        rows: jump,
                        kind: ProbeKind::Jump,
                        predicted: Some(f.peak(jump)),
                    });
                }
            }
        }
        if s.affine && s.h.is_none() {
            if let Some(f) = s.fit {
                let refined = f.max_rows(self.budget, opts.margin / 2.0).min(opts.max);
                if refined > s.l {
                    return Some(Probe {
                        rows: refined,
                        kind: ProbeKind::Refine,
                        predicted: Some(f.peak(refined)),
                    });
                }
            }
        }
        // Search: where the model of the successes meets the budget, kept where bisection can
        // still settle the bracket in what is left of `TARGET_RUNS` (or, past that, in the
        // fewest runs bisection needs).
        let l = s.l;
        let above = settle_above(l);
        // Memory that did not grow faster than the rows so far: at worst proportional,
        // `peak / rows` a row, which never overshoots an affine step with a nonnegative fixed
        // part (nor one that grows more slowly).
        let proportional = {
            let p = s.l_peak.max(1) as f64;
            let prop = (l.max(1) as f64 * budget * (1.0 - opts.margin) / p).floor();
            if prop >= usize::MAX as f64 {
                usize::MAX
            } else {
                prop as usize
            }
        };
        let aim = match self.model(&successes, budget) {
            // The model puts the maximum within the tolerance of `l`: a failure just above
            // ends the search.
            Some(m) if m < above => above,
            Some(m) => {
                let aimed = self
                    .model(&successes, budget * (1.0 - opts.margin / 2.0))
                    .unwrap_or(m)
                    .max(above);
                // Nothing failed yet: no lower than proportional, nor, once the linear jump
                // ran with less memory than predicted (memory growing more slowly than the
                // rows: the secant undershoots and would creep up), than the power law through
                // the two largest successes.
                if s.h.is_none() {
                    let power = s
                        .jumped
                        .then(|| power_law_rows(&successes, budget * (1.0 - opts.margin / 2.0)))
                        .flatten();
                    aimed.max(proportional).max(power.unwrap_or(0))
                } else {
                    aimed
                }
            }
            // Memory did not grow between the probes (rows padded to buckets, a fixed
            // workspace).
            None => proportional.max(above),
        };
        let rows = match s.h {
            None => aim.clamp(l.saturating_add(1), opts.max),
            // The model is refuted (it aims at or above a size that failed: memory jumped), or
            // there is none: bisect.
            Some(h) if aim >= h => bisection_point(l, h),
            // The model predicted the last run's peak: follow it when a failure there ends
            // the search (it puts the maximum within the tolerance of `l`), or when, if it is
            // right, the search still ends within `TARGET_RUNS` (this run, then one just above).
            Some(h) if s.model_held && (aim <= above || trials.len() + 2 <= TARGET_RUNS) => {
                aim.clamp(l + 1, h - 1)
            }
            Some(h) => {
                let left = TARGET_RUNS.saturating_sub(trials.len()) as u32;
                let k = left.max(bisection_runs(l, h)).max(1) - 1;
                let lo = reach_below(h, k, l).max(l + 1);
                let hi = reach_above(l, k, h).min(h - 1);
                if lo <= hi {
                    aim.clamp(lo, hi)
                } else {
                    bisection_point(l, h)
                }
            }
        };
        Some(Probe {
            rows,
            kind: ProbeKind::Search,
            predicted: self.model_peak(&successes, rows),
        })
    }
}

impl SearchState {
    /// Takes the outcome of `probe` (`peak`: `None` when it ran out of memory).
    fn observe(&mut self, search: &Search, probe: Probe, peak: Option<u64>, trials: &[Trial]) {
        let budget = search.budget as f64;
        self.model_held = match (peak, probe.predicted) {
            (Some(p), Some(y)) => (p as f64 - y).abs() <= 0.02 * budget,
            // it predicted a failure
            (None, Some(y)) => y > budget,
            _ => false,
        };
        let Some(p) = peak else {
            self.h = Some(self.h.map_or(probe.rows, |h| h.min(probe.rows)));
            if matches!(probe.kind, ProbeKind::Jump | ProbeKind::Refine) {
                self.jumped = true;
                self.affine = false;
            }
            return;
        };
        if probe.rows > self.l {
            self.l = probe.rows;
            self.l_peak = p;
        }
        match probe.kind {
            ProbeKind::Start | ProbeKind::Search => {}
            ProbeKind::Second => {
                let first = trials
                    .first()
                    .and_then(|t| t.peak_bytes.map(|p1| (t.rows, p1)));
                if let Some((r1, p1)) = first {
                    self.fit = LinearFit::through(r1, p1, probe.rows, p);
                }
            }
            ProbeKind::Jump => {
                self.jumped = true;
                // The fit predicted this peak (within 3%, or 1% of the budget): memory looks
                // affine, and a refit through the widest points refines the jump.
                let predicted = self.fit.map_or(f64::NAN, |f| f.peak(probe.rows));
                let tol = (0.03 * predicted).max(0.01 * search.budget as f64);
                self.affine = (p as f64 - predicted).abs() <= tol;
                let first = trials
                    .first()
                    .and_then(|t| t.peak_bytes.map(|p1| (t.rows, p1)));
                if self.affine {
                    if let Some((r1, p1)) = first {
                        if let Some(f2) = LinearFit::through(r1, p1, probe.rows, p) {
                            self.fit = Some(f2);
                        }
                    }
                    let wants_refine = search.opts.refine
                        && self.fit.is_some_and(|f| {
                            f.max_rows(search.budget, search.opts.margin / 2.0)
                                .min(search.opts.max)
                                > probe.rows
                        });
                    self.trusted = !wants_refine;
                }
            }
            ProbeKind::Refine => {
                self.trusted = true;
            }
        }
    }
}

/// The largest rows at which the parabola through three `(rows, peak)` points stays under
/// `target`, when it is increasing and convex there.
fn quadratic_rows(a: (usize, u64), b: (usize, u64), c: (usize, u64), target: f64) -> Option<usize> {
    let (x1, y1, x2, y2, x3, y3) = (
        a.0 as f64, a.1 as f64, b.0 as f64, b.1 as f64, c.0 as f64, c.1 as f64,
    );
    let d1 = (y2 - y1) / (x2 - x1);
    let d2 = (y3 - y2) / (x3 - x2);
    let k = (d2 - d1) / (x3 - x1); // the r² coefficient
                                   // Not convex, or so little that the points are a line (rounding): the secant then.
    if k.is_nan() || !k.is_finite() || k * (x3 - x1) * (x3 - x1) <= 1e-3 * (y3 - y1).abs() {
        return None;
    }
    // y = y3 + m (x - x3) + k (x - x3)(x - x2)  →  k x² + (m - k (x2 + x3)) x + ... = target
    let m = d2;
    let qa = k;
    let qb = m - k * (x2 + x3);
    let qc = y3 - m * x3 + k * x2 * x3 - target;
    let disc = qb * qb - 4.0 * qa * qc;
    if disc < 0.0 {
        return None;
    }
    let root = (-qb + disc.sqrt()) / (2.0 * qa);
    (root.is_finite() && root >= 1.0).then(|| root.floor() as usize)
}

/// The rows at which `peak = c × rows^α` through the two largest successes reaches `target`.
fn power_law_rows(successes: &[(usize, u64)], target: f64) -> Option<usize> {
    let [.., (r1, p1), (r2, p2)] = successes else {
        return None;
    };
    let (x1, y1, x2, y2) = (*r1 as f64, *p1 as f64, *r2 as f64, *p2 as f64);
    if y1 <= 0.0 || y2 <= y1 || x2 <= x1 {
        return None;
    }
    let alpha = (y2 / y1).ln() / (x2 / x1).ln();
    let rows = x2 * (target / y2).powf(1.0 / alpha);
    (rows.is_finite() && rows >= 1.0).then(|| {
        if rows >= usize::MAX as f64 {
            usize::MAX
        } else {
            rows.floor() as usize
        }
    })
}

/// The parabola through three `(rows, peak)` points at `rows`, when it is convex (as
/// [`quadratic_rows`] uses it).
fn quadratic_peak(a: (usize, u64), b: (usize, u64), c: (usize, u64), rows: usize) -> Option<f64> {
    let (x1, y1, x2, y2, x3, y3) = (
        a.0 as f64, a.1 as f64, b.0 as f64, b.1 as f64, c.0 as f64, c.1 as f64,
    );
    let d1 = (y2 - y1) / (x2 - x1);
    let d2 = (y3 - y2) / (x3 - x2);
    let k = (d2 - d1) / (x3 - x1);
    if k.is_nan() || !k.is_finite() || k * (x3 - x1) * (x3 - x1) <= 1e-3 * (y3 - y1).abs() {
        return None;
    }
    let x = rows as f64;
    Some(y3 + d2 * (x - x3) + k * (x - x3) * (x - x2))
}

/// The search stops once the largest batch that ran is at least this fraction of the largest
/// batch below the smallest one that did not (the maximum lies between the two).
pub const TOLERANCE: f64 = 0.95;
