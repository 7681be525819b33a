//! A predictive batch-size finder: two small measured runs, a linear fit of peak memory, one jump
//! to the predicted maximum; bisection only if the prediction fails.
//!
//! Lightning doubles then bisects (13 step runs for GPT-2 small on an H100), Accelerate
//! multiplies by 0.9 from a guess (23 runs, 0.88 of the maximum), toma halves (5 runs, 0.58).
//! Memory of a training step is close to `fixed + per_row × rows`; measuring it at two sizes
//! predicts the largest batch that fits, so the search usually takes 3–4 runs.

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
    /// After a successful jump, refit on the widest two points and try the refined prediction
    /// (one more run, with half the margin).
    pub refine: bool,
    /// Most step runs in all.
    pub max_trials: u32,
}

impl Default for FinderOptions {
    fn default() -> Self {
        Self {
            start: 1,
            max: 1 << 20,
            margin: 0.03,
            refine: true,
            max_trials: 16,
        }
    }
}

/// One run of the step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Trial {
    /// Rows it ran with.
    pub rows: usize,
    /// Peak bytes allocated during the run above what was allocated before it; `None`: out of
    /// memory.
    pub peak_bytes: Option<u64>,
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

/// What [`find_max_batch`] found, and how.
#[derive(Clone, Debug, PartialEq)]
pub struct FinderReport {
    /// The largest batch that ran.
    pub max_batch: usize,
    /// Every run, in order.
    pub trials: Vec<Trial>,
    /// The fit used for the jump (the refined one if a refinement ran).
    pub fit: Option<LinearFit>,
    /// Bytes available to the step's peak (what the device could still give, cache emptied).
    pub budget_bytes: u64,
}

impl FinderReport {
    /// Number of step runs.
    pub fn runs(&self) -> usize {
        self.trials.len()
    }
}

impl fmt::Display for FinderReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "max batch {} after {} runs",
            self.max_batch,
            self.trials.len()
        )?;
        if let Some(fit) = &self.fit {
            write!(
                f,
                " (fit: {:.0} B + {:.0} B/row)",
                fit.fixed_bytes, fit.per_row_bytes
            )?;
        }
        for t in &self.trials {
            match t.peak_bytes {
                Some(p) => write!(f, "\n  {} rows: peak {p} B", t.rows)?,
                None => write!(f, "\n  {} rows: out of memory", t.rows)?,
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
}

/// Peak bytes allocated while `f` runs, above what was allocated when it started (what a
/// `PeakScope` around `f` reports: this is the one place to switch to it).
fn measure_peak<S: MemorySource + ?Sized, T>(
    device: &S,
    f: impl FnOnce() -> T,
) -> Result<(T, u64), crate::Error> {
    device.reset_peak()?;
    let before = device.usage()?.used;
    let out = f();
    let peak = device.usage()?.used_peak;
    Ok((out, peak.saturating_sub(before)))
}

/// Finds the largest batch for which `step(rows)` runs without out-of-memory on `device`.
///
/// Runs the step at `start` and `8 × start` rows while measuring peak memory, fits
/// `peak = fixed + per_row × rows`, jumps to the predicted maximum under the available memory
/// minus the margin, optionally refines once, and bisects only if the jump fails. The step
/// should do what a real step does (forward, backward, optimizer) and keep nothing between calls.
///
/// ```
/// use oomguard_runtime::retry::{find_max_batch, FinderOptions};
/// use oomguard_runtime::{ByteSize, Device};
/// let dev = Device::sim(ByteSize::mib(256));
/// // 16 MiB of fixed workspace plus 1 MiB of activations per row: about 240 rows fit.
/// let report = find_max_batch(&dev, FinderOptions::default(), |rows| {
///     let _ws = dev.alloc::<u8>(16 << 20)?;
///     let _acts = dev.alloc::<u8>(rows << 20)?;
///     Ok::<_, oomguard_runtime::Error>(())
/// }).unwrap();
/// assert!(report.max_batch >= 228 && report.max_batch <= 240, "{report}");
/// assert!(report.runs() <= 4);
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
    device.empty_cache()?;
    // Room for the step: what the device can still give (the cache is empty), capped by the
    // allocator's limit.
    let budget = device.available()?;

    let mut trials: Vec<Trial> = Vec::new();
    let mut run = |rows: usize, trials: &mut Vec<Trial>| -> Result<Option<u64>, FinderError<E>> {
        device.empty_cache()?;
        let t0 = Instant::now();
        let (res, peak) = measure_peak(device, || step(rows))?;
        let peak_bytes = match res {
            Ok(_) => Some(peak),
            Err(e) if e.is_oom() => None,
            Err(e) => return Err(FinderError::Step(e)),
        };
        trials.push(Trial {
            rows,
            peak_bytes,
            elapsed: t0.elapsed(),
        });
        tracing::debug!(target: "oomguard::retry", rows, ?peak_bytes, "batch finder trial");
        Ok(peak_bytes)
    };
    let budget_left = |trials: &Vec<Trial>| (trials.len() as u32) < opts.max_trials;

    // lo: largest size that ran (with its peak); hi: smallest size that failed.
    let mut lo: Option<(usize, u64)> = None;
    let mut hi: Option<usize> = None;
    let mut fit = None;

    let s1 = opts.start;
    match run(s1, &mut trials)? {
        Some(p) => lo = Some((s1, p)),
        None => hi = Some(s1),
    }
    if let Some((r1, p1)) = lo {
        let s2 = s1.saturating_mul(8).min(opts.max);
        if s2 > s1 {
            match run(s2, &mut trials)? {
                Some(p2) => {
                    lo = Some((s2, p2));
                    fit = LinearFit::through(r1, p1, s2, p2);
                }
                None => hi = Some(s2),
            }
        }
    }
    // Jump.
    if let (Some(f), None, Some((r_lo, _))) = (fit, hi, lo) {
        let jump = f.max_rows(budget, opts.margin).min(opts.max);
        if jump > r_lo && budget_left(&trials) {
            match run(jump, &mut trials)? {
                Some(p3) => {
                    lo = Some((jump, p3));
                    if opts.refine && budget_left(&trials) {
                        if let Some(f2) =
                            LinearFit::through(s1, trials[0].peak_bytes.unwrap_or(0), jump, p3)
                        {
                            fit = Some(f2);
                            let refined = f2.max_rows(budget, opts.margin / 2.0).min(opts.max);
                            if refined > jump {
                                match run(refined, &mut trials)? {
                                    Some(p4) => lo = Some((refined, p4)),
                                    None => hi = Some(refined),
                                }
                            }
                        }
                    }
                    if hi.is_none() {
                        // The prediction worked: done.
                        return Ok(FinderReport {
                            max_batch: lo.map_or(0, |l| l.0),
                            trials,
                            fit,
                            budget_bytes: budget,
                        });
                    }
                }
                None => hi = Some(jump),
            }
        }
    }
    // No usable fit (memory does not grow with rows): double until failure.
    if fit.is_none() && hi.is_none() {
        while let Some((r, _)) = lo {
            if r >= opts.max || !budget_left(&trials) {
                break;
            }
            let next = r.saturating_mul(2).min(opts.max);
            match run(next, &mut trials)? {
                Some(p) => lo = Some((next, p)),
                None => {
                    hi = Some(next);
                    break;
                }
            }
        }
    }
    // Bisect between the largest success and the smallest failure.
    if let Some(mut h) = hi {
        let mut l = lo.map_or(0, |x| x.0);
        while h - l > 1 && budget_left(&trials) {
            // stop once within 1% of the lower bound: further runs gain little
            if l > 0 && (h - l) * 100 <= l {
                break;
            }
            let mid = l + (h - l) / 2;
            match run(mid, &mut trials)? {
                Some(p) => {
                    l = mid;
                    lo = Some((mid, p));
                }
                None => h = mid,
            }
        }
        if l == 0 {
            return Err(FinderError::NothingFits(trials));
        }
    }
    Ok(FinderReport {
        max_batch: lo.map_or(0, |l| l.0),
        trials,
        fit,
        budget_bytes: budget,
    })
}
