//! [`find_max_batch`]: the search, then the verification of the batch found.

use std::fmt;

use crate::retry::classify::IsOom;
use crate::source::MemorySource;

use super::bracket::{bisection_point, settled};
use super::error::FinderError;
use super::options::{FinderOptions, MAX_VERIFICATIONS, VERIFY_EXTENSION};
use super::report::{FinderReport, Trial};
use super::search::{Search, SearchState};
use super::trial::TrialRunner;

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
/// one more run, not counted in [`FinderReport::runs`]; each step marked on the source with
/// [`MemorySource::mark_step`], as `train_step` marks its steps, so that a loop at the edge of
/// memory settles on a step plan there as it will in training), and goes on, up to
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
/// [`RetryEngine::start_from_finder`](crate::retry::RetryEngine::start_from_finder).
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
    step: impl FnMut(usize) -> Result<T, E>,
) -> Result<FinderReport, FinderError<E>>
where
    E: IsOom + fmt::Debug + fmt::Display,
{
    check_options(&opts)?;
    device.empty_cache()?;
    // Room for the step: what the device can still give (the cache is empty), capped by the
    // allocator's limit, and never more than the device's capacity (a source that says
    // `u64::MAX` for "unknown" switched off the checks measured against 0.1 % of the budget:
    // a step keeping memory at every call was reported safe for a loop).
    let capacity = device.info().total_bytes;
    let budget = match device.available()? {
        room if capacity > 0 => room.min(capacity),
        room => room,
    };
    let baseline = device.usage()?.used;

    let mut trials: Vec<Trial> = Vec::new();
    let mut runner = TrialRunner::new(device, step, budget, baseline, opts.max);
    let (state, stopped_by_trials) = search(&mut runner, budget, opts, &mut trials)?;
    if state.l == 0 {
        device.empty_cache()?;
        return Err(FinderError::NothingFits(trials));
    }
    // Verification: the batch found must run a loop of steps, not only a trial's few.
    let (max_batch, verification) = if opts.verify_steps > 0 {
        verify(&mut runner, state.l, opts)?
    } else {
        (state.l, Vec::new())
    };
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

/// Refuses options the search cannot run with.
fn check_options<E: fmt::Debug + fmt::Display>(opts: &FinderOptions) -> Result<(), FinderError<E>> {
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
    Ok(())
}

/// The search: trials where [`Search::next_probe`] says until it is over or `max_trials` runs
/// are spent (then the second value is `true`). Every trial is in `trials`.
fn search<S, T, E>(
    runner: &mut TrialRunner<'_, S, impl FnMut(usize) -> Result<T, E>>,
    budget: u64,
    opts: FinderOptions,
    trials: &mut Vec<Trial>,
) -> Result<(SearchState, bool), FinderError<E>>
where
    S: MemorySource + ?Sized,
    E: IsOom + fmt::Debug + fmt::Display,
{
    let steps_per_trial = opts.steps_per_trial;
    let budget_left = |trials: &Vec<Trial>| (trials.len() as u32) < opts.max_trials;

    let search = Search::new(budget, opts);
    let mut state = SearchState::default();
    let mut stopped_by_trials = false;
    while let Some(probe) = search.next_probe(&state, trials) {
        if !budget_left(trials) {
            stopped_by_trials = true;
            break;
        }
        let peak = runner.run(probe.rows, steps_per_trial, steps_per_trial, trials)?;
        state.observe(&search, probe, peak, trials);
    }
    Ok((state, stopped_by_trials))
}

/// The verification of the batch the search `found`: [`FinderOptions::verify_steps`]
/// consecutive steps, stepping down (a fifth, then by halves, then bisecting) until a batch
/// runs them. Returns the largest batch verified and every verification run.
fn verify<S, T, E>(
    runner: &mut TrialRunner<'_, S, impl FnMut(usize) -> Result<T, E>>,
    found: usize,
    opts: FinderOptions,
) -> Result<(usize, Vec<Trial>), FinderError<E>>
where
    S: MemorySource + ?Sized,
    E: IsOom + fmt::Debug + fmt::Display,
{
    let mut verification = Vec::new();
    let (mut ok, mut failed): (Option<usize>, Option<usize>) = (None, None);
    let mut rows = found;
    while verification.len() < MAX_VERIFICATIONS {
        let mut v = Vec::new();
        let most = opts.verify_steps.saturating_mul(VERIFY_EXTENSION);
        let peak = runner.run(rows, opts.verify_steps, most, &mut v)?;
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
    let Some(max_batch) = ok else {
        runner.device.empty_cache()?;
        return Err(FinderError::LoopFails {
            found,
            smallest: verification.iter().map(|t| t.rows).min().unwrap_or(found),
            steps: opts.verify_steps,
            verification,
        });
    };
    if max_batch < found {
        tracing::warn!(
            target: "oomguard::retry",
            found,
            verified = max_batch,
            steps = opts.verify_steps,
            "find_max_batch: the batch the search found ran out of memory within a loop of steps; returning the largest batch verified"
        );
    }
    Ok((max_batch, verification))
}
