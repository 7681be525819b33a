//! The search: which batch to try next, from what the runs so far say.

use super::bracket::{
    bisection_point, bisection_runs, reach_above, reach_below, settle_above, settled,
};
use super::fit::{power_law_rows, quadratic_peak, quadratic_rows, LinearFit};
use super::options::FinderOptions;
use super::report::Trial;

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
pub(super) struct Probe {
    pub(super) rows: usize,
    kind: ProbeKind,
    /// The peak the model predicted for it.
    predicted: Option<f64>,
}

/// The fixed inputs of the search.
pub(super) struct Search {
    budget: u64,
    opts: FinderOptions,
}

/// What the runs so far say.
#[derive(Debug, Default)]
pub(super) struct SearchState {
    /// The largest batch that ran (0: none yet).
    pub(super) l: usize,
    /// Its peak.
    l_peak: u64,
    /// The smallest batch that did not run.
    h: Option<usize>,
    /// The linear fit of the jump (refitted through the jump when it ran as predicted).
    pub(super) fit: Option<LinearFit>,
    /// The jump ran and its peak is what the fit predicted: memory looks affine.
    affine: bool,
    /// The affine prediction was confirmed by a refinement (or needs none): done.
    trusted: bool,
    /// A jump or refine was tried.
    jumped: bool,
    /// The last run's peak was what the model predicted (within 2% of the budget).
    model_held: bool,
}

impl Search {
    pub(super) fn new(budget: u64, opts: FinderOptions) -> Self {
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
    pub(super) fn next_probe(&self, s: &SearchState, trials: &[Trial]) -> Option<Probe> {
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
        if let Some(p) = self.linear_probe(s) {
            return Some(p);
        }
        Some(self.search_probe(s, trials, &successes))
    }

    /// The jump, then the refinement: the linear fit's predictions (`None`: neither is due).
    fn linear_probe(&self, s: &SearchState) -> Option<Probe> {
        let opts = &self.opts;
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
        None
    }

    /// Search: where the model of the successes meets the budget, kept where bisection can
    /// still settle the bracket in what is left of `TARGET_RUNS` (or, past that, in the
    /// fewest runs bisection needs).
    fn search_probe(&self, s: &SearchState, trials: &[Trial], successes: &[(usize, u64)]) -> Probe {
        let opts = &self.opts;
        let l = s.l;
        let above = settle_above(l);
        let aim = self.aim(s, successes, above);
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
        Probe {
            rows,
            kind: ProbeKind::Search,
            predicted: self.model_peak(successes, rows),
        }
    }

    /// Where the model of the successes meets the budget (`above`: the smallest size whose
    /// failure settles the bracket).
    fn aim(&self, s: &SearchState, successes: &[(usize, u64)], above: usize) -> usize {
        let opts = &self.opts;
        let budget = self.budget as f64;
        let l = s.l;
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
        match self.model(successes, budget) {
            // The model puts the maximum within the tolerance of `l`: a failure just above
            // ends the search.
            Some(m) if m < above => above,
            Some(m) => {
                let aimed = self
                    .model(successes, budget * (1.0 - opts.margin / 2.0))
                    .unwrap_or(m)
                    .max(above);
                // Nothing failed yet: no lower than proportional, nor, once the linear jump
                // ran with less memory than predicted (memory growing more slowly than the
                // rows: the secant undershoots and would creep up), than the power law through
                // the two largest successes.
                if s.h.is_none() {
                    let power = s
                        .jumped
                        .then(|| power_law_rows(successes, budget * (1.0 - opts.margin / 2.0)))
                        .flatten();
                    aimed.max(proportional).max(power.unwrap_or(0))
                } else {
                    aimed
                }
            }
            // Memory did not grow between the probes (rows padded to buckets, a fixed
            // workspace).
            None => proportional.max(above),
        }
    }
}

impl SearchState {
    /// Takes the outcome of `probe` (`peak`: `None` when it ran out of memory).
    pub(super) fn observe(
        &mut self,
        search: &Search,
        probe: Probe,
        peak: Option<u64>,
        trials: &[Trial],
    ) {
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
