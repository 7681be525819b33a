//! A predictive batch-size finder: two small measured runs, a linear fit of peak memory, one jump
//! to the predicted maximum; bisection only if the prediction fails.
//!
//! Lightning doubles then bisects (13 step runs for GPT-2 small on an H100), Accelerate
//! multiplies by 0.9 from a guess (23 runs, 0.88 of the maximum), toma halves (5 runs, 0.58).
//! Memory of a training step is close to `fixed + per_row × rows`; measuring it at two sizes
//! predicts the largest batch that fits: 4 runs when memory is affine in the batch, more when it
//! is not (see [`find_max_batch`]).

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

/// The defaults: `start` 1 row, `max` 2^20 rows, `margin` 0.03, `refine` on, `max_trials` 16.
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
    /// The search ended because it used `max_trials` runs, not because it was within
    /// 0.95 of the limit: `max_batch` may be further from the maximum.
    pub stopped_by_max_trials: bool,
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
/// minus the margin, and optionally refines once: **4 runs when peak memory is affine in the
/// batch**. When the jump fails (memory quadratic in the rows, a jump, rows padded to buckets)
/// it searches between the largest batch that ran and the smallest that did not, probing where
/// a parabola (or secant) through the measured peaks meets the budget, until the first is
/// within 0.95 of the second; measured: 6–8 runs on quadratic and bucketed
/// steps, 7 to 11 on steps whose memory jumps (docs/BENCHMARKS.md). If `max_trials` ends the
/// search first, [`FinderReport::stopped_by_max_trials`] says so. The step should do what a
/// real step does (forward, backward, optimizer), keep nothing between calls, and not retry
/// out-of-memory itself (a step that did is refused: [`FinderError::RetriesInside`]).
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
        super::report::clear_last_report();
        let (res, peak) = measure_peak(device, || step(rows))?;
        if let Some(r) = super::report::last_report() {
            if r.retries() > 0 || r.final_plan.batch() != r.requested_batch {
                return Err(FinderError::RetriesInside {
                    rows,
                    report: Box::new(r),
                });
            }
        }
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
    let mut stopped_by_trials = false;

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
                            stopped_by_max_trials: false,
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
            // Memory did not grow from the last probes (rows padded to buckets, a fixed
            // workspace): assume at worst proportional memory, `peak / rows` a row, which never
            // overshoots an affine step with a nonnegative fixed part.
            let p = lo.map_or(0, |x| x.1).max(1);
            let proportional =
                (r as f64 * budget as f64 * (1.0 - opts.margin) / p as f64).floor() as usize;
            // at least past the tolerance, so that a failure there ends the search
            let just_above = ((r as f64) / TOLERANCE).floor() as usize + 1;
            let next = proportional.max(just_above).min(opts.max);
            match run(next, &mut trials)? {
                Some(p) => lo = Some((next, p)),
                None => {
                    hi = Some(next);
                    break;
                }
            }
        }
    }
    // The prediction failed: memory is not affine in the rows (quadratic, a jump, buckets).
    // Search the bracket [largest success, smallest failure) until the success is within
    // `TOLERANCE` of the failure (the maximum lies between them), probing where the secant
    // through the two largest successes meets the budget when that is inside the bracket, else
    // in its middle (geometric while it is wide).
    if let Some(mut h) = hi {
        let mut l = lo.map_or(0, |x| x.0);
        let mut confirm = false;
        while h - l > 1 && (l as f64) < TOLERANCE * h as f64 && budget_left(&trials) {
            let successes: Vec<(usize, u64)> = {
                let mut v: Vec<_> = trials
                    .iter()
                    .filter_map(|t| t.peak_bytes.map(|p| (t.rows, p)))
                    .collect();
                v.sort_unstable();
                v
            };
            let mid = bracket_probe(l, h, &successes, budget, opts.margin, confirm);
            let was_confirm = mid == ((l as f64) / TOLERANCE).floor() as usize + 1;
            match run(mid, &mut trials)? {
                Some(p) => {
                    l = mid;
                    lo = Some((mid, p));
                    // after a success, try once just above it (unless that was the try)
                    confirm = !was_confirm;
                }
                None => {
                    h = mid;
                    confirm = false;
                }
            }
        }
        stopped_by_trials = h - l > 1 && (l as f64) < TOLERANCE * h as f64;
        if l == 0 {
            return Err(FinderError::NothingFits(trials));
        }
    }
    if stopped_by_trials {
        tracing::warn!(
            target: "oomguard::retry",
            runs = trials.len(),
            "find_max_batch: stopped by max_trials before the bracket was within 5%"
        );
    }
    Ok(FinderReport {
        max_batch: lo.map_or(0, |l| l.0),
        trials,
        fit,
        budget_bytes: budget,
        stopped_by_max_trials: stopped_by_trials,
    })
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
    if k.is_nan() || k <= 0.0 || !k.is_finite() {
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

/// The search stops once the largest success is at least this fraction of the smallest failure.
pub const TOLERANCE: f64 = 0.95;

/// The next probe inside the bracket `(l, h)` (`l` ran, `h` did not). `confirm`: the last probe
/// ran and a probe just above it could end the search (`l` within [`TOLERANCE`] of it).
fn bracket_probe(
    l: usize,
    h: usize,
    successes: &[(usize, u64)],
    budget: u64,
    margin: f64,
    confirm: bool,
) -> usize {
    let inside = |x: usize| x.clamp(l + 1, h - 1);
    // The smallest failure that would end the search.
    let just_above = ((l as f64) / TOLERANCE).floor() as usize + 1;
    // Close to the end: one probe at the tolerance settles it if it runs.
    if l as f64 >= 0.9 * h as f64 {
        return inside((TOLERANCE * h as f64).ceil() as usize);
    }
    // The model of the largest successes: a parabola through three (memory growing faster
    // than the rows), else the secant through two; aimed at the budget.
    let model = |target: f64| -> Option<usize> {
        if let [.., a, b, c] = successes {
            if let Some(g) = quadratic_rows(*a, *b, *c, target) {
                return Some(g);
            }
        }
        if let [.., (r1, p1), (r2, p2)] = successes {
            let f = LinearFit::through(*r1, *p1, *r2, *p2)?;
            return Some(
                ((target - f.fixed_bytes) / f.per_row_bytes)
                    .floor()
                    .max(0.0) as usize,
            );
        }
        None
    };
    if let Some(m) = model(budget as f64) {
        if m < just_above && just_above < h {
            // The model puts the maximum within the tolerance of `l`: a failure just above
            // ends the search.
            return just_above;
        }
        let aimed = model(budget as f64 * (1.0 - margin)).unwrap_or(m);
        if aimed > l && aimed < h {
            return inside(aimed);
        }
    }
    if confirm && just_above < h && h / l.max(1) < 4 {
        // The model is out of the bracket (memory jumps): try just above the last success once.
        return just_above;
    }
    if l > 0 && h / l >= 4 {
        inside(((l as f64) * (h as f64)).sqrt() as usize)
    } else {
        inside(l + (h - l) / 2)
    }
}
