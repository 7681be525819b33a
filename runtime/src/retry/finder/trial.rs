//! One trial: the step run a few times back to back at one size, under one peak.

use std::fmt;
use std::time::Instant;

use crate::retry::classify::IsOom;
use crate::retry::last_report;
use crate::retry_report::RetryReport;
use crate::source::MemorySource;

use super::error::FinderError;
use super::report::{rise_tolerance, Trial};

/// Peak bytes allocated and held while `f` runs, above `baseline`: what was allocated when the
/// finder started, not when this trial did. Memory an earlier trial left allocated (a library's
/// workspace made at the first backward, state a step makes once) is then in every trial's
/// peak, as it will be in every step that follows; measured from each trial's start, only the
/// trial that made it carried it, and the fit's slope came out low.
fn measure_peak<S: MemorySource + ?Sized, T>(
    device: &S,
    baseline: u64,
    f: impl FnOnce() -> T,
) -> Result<(T, u64, u64), crate::Error> {
    crate::source::guards::reset_peak_keeping_scopes(device)?;
    let out = f();
    let after = device.usage()?;
    // (held: above what was in use, so that memory a kept cache already held counts)
    Ok((
        out,
        after.used_peak.saturating_sub(baseline),
        after.reserved_peak.saturating_sub(baseline),
    ))
}

/// How much the running held peak rose over the second half of the steps (`held[k]`: the most
/// the source held by the end of step `k + 1`).
fn held_rise(held: &[u64]) -> u64 {
    match held.len() {
        0 | 1 => 0,
        n => held[n - 1].saturating_sub(held[n / 2 - 1]),
    }
}

/// Runs trials of a step on a source.
pub(super) struct TrialRunner<'a, S: ?Sized, F> {
    pub(super) device: &'a S,
    step: F,
    /// Bytes available to the step's peak.
    budget: u64,
    /// Bytes allocated when the finder started: every trial's peak is measured above it.
    baseline: u64,
    /// The largest batch worth having ([`FinderOptions::max`](super::FinderOptions::max)).
    max: usize,
}

/// What the steps of one trial did.
struct Ran<E> {
    /// `Err`: the step that failed (the trial stopped there).
    result: Result<(), E>,
    /// Peak bytes allocated above what was allocated when the finder started.
    peak: u64,
    /// Peak bytes held above what was allocated when the finder started.
    reserved_peak: u64,
    /// Steps run.
    steps: u32,
    /// How much the held peak rose over the second half of the steps.
    rise: u64,
    /// Verification runs: how much the bytes in use after a step rose over the second half of
    /// the steps (memory the step keeps between calls).
    kept: u64,
    /// The first step on this thread that did not run its whole batch in one pass.
    inner: Option<RetryReport>,
}

impl<'a, S: MemorySource + ?Sized, F> TrialRunner<'a, S, F> {
    pub(super) fn new(device: &'a S, step: F, budget: u64, baseline: u64, max: usize) -> Self {
        Self {
            device,
            step,
            budget,
            baseline,
            max,
        }
    }

    /// A trial: `steps_per_trial` steps back to back; with `extend_to` above it (verification),
    /// more while the source's held peak still rose over the second half of the steps so far.
    /// Adds it to `trials`; returns its peak (`None`: out of memory).
    pub(super) fn run<T, E>(
        &mut self,
        rows: usize,
        steps_per_trial: u32,
        extend_to: u32,
        trials: &mut Vec<Trial>,
    ) -> Result<Option<u64>, FinderError<E>>
    where
        F: FnMut(usize) -> Result<T, E>,
        E: IsOom + fmt::Debug + fmt::Display,
    {
        // A cache whose free memory serves any request (oomguard's growable segments move pages
        // to where a request needs them) is kept between trials: emptying it only unmapped
        // every page for the next trial to map again (2 MiB at a time: 63 s for 11 trials on an
        // H100 where libtorch's 20 MiB pages took 25.5 s for 10, docs/GPU.md run 55).
        if self.device.retry_empties_cache() {
            self.device.empty_cache()?;
        }
        let t0 = Instant::now();
        let ran = self.run_steps(rows, steps_per_trial, extend_to)?;
        if let Some(r) = ran.inner {
            let report = Box::new(r);
            return Err(
                if report.retries() == 0 && report.final_plan.batch() == report.requested_batch {
                    FinderError::SplitInside { rows, report }
                } else {
                    FinderError::RetriesInside { rows, report }
                },
            );
        }
        if ran.result.is_ok() && ran.kept > rise_tolerance(self.budget) {
            // A loop would run out of memory whatever the batch: no batch to report.
            self.device.empty_cache()?;
            return Err(FinderError::StepKeepsMemory {
                rows,
                steps: ran.steps,
                kept_bytes: ran.kept,
            });
        }
        let (peak_bytes, oom_request) = match ran.result {
            Ok(()) => (Some(ran.peak), None),
            Err(e) if e.is_oom() => (None, e.oom_request()),
            Err(e) => return Err(FinderError::Step(e)),
        };
        trials.push(Trial {
            rows,
            peak_bytes,
            reserved_peak_bytes: ran.reserved_peak,
            steps: ran.steps,
            held_rise_bytes: ran.rise,
            elapsed: t0.elapsed(),
            oom_request,
        });
        tracing::debug!(target: "oomguard::retry", rows, ?peak_bytes, steps = ran.steps, "batch finder trial");
        // Nothing measured at two sizes (or at the only size there is): the search would
        // climb to `max` on nothing.
        let successes: Vec<&Trial> = trials.iter().filter(|t| t.peak_bytes.is_some()).collect();
        let all_zero = successes.iter().all(|t| t.peak_bytes == Some(0));
        if all_zero && (successes.len() >= 2 || (peak_bytes.is_some() && rows >= self.max)) {
            return Err(FinderError::Unmeasured {
                measured: self.device.info(),
                rows: successes.iter().map(|t| t.rows).collect(),
            });
        }
        Ok(peak_bytes)
    }

    /// The trial's steps back to back, the cache kept between them, under one peak.
    fn run_steps<T, E>(
        &mut self,
        rows: usize,
        steps_per_trial: u32,
        extend_to: u32,
    ) -> Result<Ran<E>, FinderError<E>>
    where
        F: FnMut(usize) -> Result<T, E>,
        E: fmt::Debug + fmt::Display,
    {
        let budget = self.budget;
        let device = self.device;
        let step = &mut self.step;
        let mut steps = 0;
        let mut inner = None;
        let mut held: Vec<u64> = Vec::new();
        let mut used_after: Vec<u64> = Vec::new();
        let mut rise = 0;
        let mut usage_error = None;
        let verifying = extend_to > steps_per_trial;
        let (res, peak, reserved_peak) = measure_peak(device, self.baseline, || {
            last_report::watch_steps(true);
            let mut res = Ok(());
            loop {
                if steps >= steps_per_trial {
                    rise = held_rise(&held);
                    if steps >= extend_to || rise <= rise_tolerance(budget) {
                        break;
                    }
                }
                steps += 1;
                if verifying {
                    // a loop at one size, as `train_step`'s (which marks each step it runs):
                    // at the edge of memory it settles on a step plan there as it will in
                    // training (a trial's two steps at a new size are left unmarked, so no
                    // plan laid out for one size meets the next)
                    device.mark_step();
                }
                if let Err(e) = step(rows) {
                    res = Err(e);
                    break;
                }
                if extend_to > steps_per_trial {
                    match device.usage() {
                        Ok(u) => {
                            held.push(u.reserved_peak);
                            used_after.push(u.used);
                        }
                        Err(e) => {
                            usage_error = Some(e);
                            break;
                        }
                    }
                }
            }
            inner = last_report::watch_steps(false);
            usage_error.map_or(Ok(res), Err)
        })?;
        let result = res?;
        Ok(Ran {
            result,
            peak,
            reserved_peak,
            steps,
            rise,
            // (the same measure as the held peak's: state a step makes once, in its first
            // steps, is not in it; a step that keeps memory at every call is)
            kept: held_rise(&used_after),
            inner,
        })
    }
}
