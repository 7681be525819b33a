//! [`FinderReport`]: what [`find_max_batch`](crate::retry::find_max_batch) found, and how.

use std::fmt;
use std::time::Duration;

use crate::retry_report::OomRequest;

use super::fit::LinearFit;

/// One trial: the step run [`FinderOptions::steps_per_trial`](crate::retry::FinderOptions::steps_per_trial) times back to back at one size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Trial {
    /// Rows it ran with.
    pub rows: usize,
    /// Peak bytes allocated during the trial's steps above what was allocated when the finder
    /// started (so memory an earlier trial left allocated counts in it); `None`: out of memory.
    pub peak_bytes: Option<u64>,
    /// Peak bytes the source held (used plus cached) during the steps, above what was in use
    /// when the finder started (how much more than `peak_bytes` the source needed: fragmentation, rounding,
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
    /// The request that ran out of memory and the most its device (or budget) could give, when
    /// the step's error tells them ([`IsOom::oom_request`](crate::retry::IsOom::oom_request));
    /// `None` when the trial ran, or the error does not say.
    pub oom_request: Option<OomRequest>,
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

/// What [`find_max_batch`](crate::retry::find_max_batch) found, and how.
#[derive(Clone, Debug, PartialEq)]
pub struct FinderReport {
    /// The batch found: [`FinderReport::verified_steps`] consecutive steps of it ran on this
    /// source (or, with verification off, [`FinderReport::steps_per_trial`]; see
    /// [`FinderReport::safe_for`]).
    pub max_batch: usize,
    /// Every trial of the search, in order.
    pub trials: Vec<Trial>,
    /// Steps each trial ran back to back ([`FinderOptions::steps_per_trial`](crate::retry::FinderOptions::steps_per_trial)).
    pub steps_per_trial: u32,
    /// The verification runs after the search, in order ([`FinderOptions::verify_steps`](crate::retry::FinderOptions::verify_steps)
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
    /// a row at its largest batch, on an H100), else the peak over its rows of the search's
    /// trial at `max_batch` (no verification, and no fit when the second probe failed).
    fn bytes_per_row(&self) -> Option<f64> {
        let per_row = |t: &Trial| Some(t.peak_bytes? as f64 / t.rows.max(1) as f64);
        self.verified()
            .and_then(per_row)
            .filter(|p| *p > 0.0)
            .or_else(|| self.fit.map(|f| f.per_row_bytes).filter(|p| *p > 0.0))
            .or_else(|| {
                self.trials
                    .iter()
                    .rev()
                    .filter(|t| t.rows == self.max_batch)
                    .find_map(per_row)
                    .filter(|p| *p > 0.0)
            })
    }

    /// The verification run that `max_batch` passed (`None`: verification was off).
    pub fn verified(&self) -> Option<&Trial> {
        self.verification
            .iter()
            .rev()
            .find(|t| t.rows == self.max_batch && t.peak_bytes.is_some())
    }

    /// Consecutive steps `max_batch` ran in its verification: at least
    /// [`FinderOptions::verify_steps`](crate::retry::FinderOptions::verify_steps), more when the verification was extended (0: not
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
        // A search trial's steps count only where a trial ran all of them at `max_batch`: a
        // batch the verification's step-down found ran only its verification.
        let searched = self
            .trials
            .iter()
            .any(|t| t.rows == self.max_batch && t.peak_bytes.is_some());
        let trial_steps = if searched { self.steps_per_trial } else { 0 };
        let steps = match (self.verified_steps(), trial_steps) {
            (v, _) if v > 1 => format!(
                "a loop of steps: {v} consecutive steps ran at it without emptying the cache \
                 between them (verification)"
            ),
            (_, n) if n > 1 => format!(
                "a loop of steps: {n} consecutive steps ran at it without emptying the cache \
                 between them"
            ),
            // (not "each from an emptied cache": a source whose free pages serve any request,
            // growable segments, keeps its cache between trials)
            _ if self.verification.is_empty() => "single steps (steps_per_trial 1, no \
                  verification: a loop of steps, which keeps what each step cached, may run out \
                  of memory)"
                .to_string(),
            _ => format!(
                "single steps: one step ran at it (a verification of 1 step{}: a loop of \
                 steps may run out of memory)",
                if searched {
                    ", steps_per_trial 1"
                } else {
                    "; no search trial ran at it"
                }
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

/// A held-memory rise over the second half of a verification above this (0.1% of the memory
/// available to the step) means the loop has not settled.
pub(super) fn rise_tolerance(budget: u64) -> u64 {
    budget / 1000
}
