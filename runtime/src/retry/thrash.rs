//! Thrash detection, and what the engine does about it.
//!
//! A step thrashes when the allocator churned during it ([`Churn`]): it freed its whole cache
//! and retried (one allocation away from a hard OOM, and slow: every retry synchronises the
//! device and re-maps memory), moved pages (unmapped free pages to map them where a request
//! fits), or synchronised streams inside the allocator. Mapping new pages while there is room is
//! not churn: a settled loop moves nothing. After `window` such steps in a row:
//! - if the allocator retried in the last of them, the engine moves to the next smaller plan at
//!   once, as Composer does (the plan is close to a hard OOM);
//! - otherwise the churn costs time but is safe: the engine tries the next smaller plan for a
//!   few steps and keeps whichever of the two runs faster per row ([`SpeedBook`]). A smaller
//!   plan that lost is tried again only after more and more thrash windows.

use rustc_hash::FxHashMap as HashMap;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use super::memory::{Limits, MemoryKey};
use crate::retry_report::{BatchPlan, SpeedDecision};
use crate::source::Churn;

/// Counts consecutive thrashing steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ThrashDetector {
    window: u32,
}

impl ThrashDetector {
    /// Trips after `window` consecutive thrashing steps (`window` of 0 is treated as 1).
    pub(crate) fn new(window: u32) -> Self {
        Self {
            window: window.max(1),
        }
    }

    /// Steps in a row that trip it.
    pub(crate) fn window(&self) -> u32 {
        self.window
    }

    /// Records one successful step into `streak`; `retries_before`/`retries_after` are the
    /// allocator's `num_alloc_retries` around the step. Returns `true` (and resets the streak)
    /// when the engine should move to a smaller plan.
    #[cfg(test)]
    pub(crate) fn observe(
        &self,
        streak: &mut u32,
        retries_before: u64,
        retries_after: u64,
    ) -> bool {
        self.observe_churn(
            streak,
            &Churn::retries(retries_after.saturating_sub(retries_before)),
        )
    }

    /// Records one successful step into `streak`, `churn` being the allocator's churn during
    /// it ([`Churn::since`]): any counter above 0 makes it a thrashing step. Returns `true`
    /// (and resets the streak) after `window` of them in a row.
    pub(crate) fn observe_churn(&self, streak: &mut u32, churn: &Churn) -> bool {
        if churn.any() {
            *streak += 1;
        } else {
            *streak = 0;
        }
        if *streak >= self.window {
            *streak = 0;
            return true;
        }
        false
    }
}

/// Steps of the smaller plan run before its time is measured: its first step maps the pages
/// its layout needs (legitimately, and slowly).
pub(crate) const SETTLE_STEPS: u32 = 1;
/// Thrash windows a plan stays on after the smaller plan lost to it once; doubled with each
/// further loss.
pub(crate) const WINDOWS_AFTER_LOSS: u32 = 8;

/// The time per row of one step: `elapsed` over `rows`, in nanoseconds.
pub(crate) fn per_row(elapsed: Duration, rows: usize) -> u64 {
    let n = elapsed.as_nanos() / rows.max(1) as u128;
    u64::try_from(n).unwrap_or(u64::MAX)
}

/// The lower median of `samples` (nanoseconds per row).
fn median(samples: &[u64]) -> u64 {
    let mut v = samples.to_vec();
    v.sort_unstable();
    v.get(v.len().saturating_sub(1) / 2).copied().unwrap_or(0)
}

/// A smaller plan under trial.
#[derive(Clone, Debug)]
struct Trial {
    thrashing: BatchPlan,
    /// The limits that gave `thrashing`: restored if the smaller plan loses.
    limits: Limits,
    /// The limits that give `smaller` (learned when the trial starts): while a step starts
    /// from them the trial goes on, whatever its batch (the last batch of an epoch is smaller).
    tried: Limits,
    thrashing_per_row: u64,
    smaller: BatchPlan,
    settle_left: u32,
    samples: Vec<u64>,
    needed: u32,
}

/// A smaller plan measured slower than the plan that churned.
#[derive(Clone, Copy, Debug)]
struct Loss {
    thrashing: BatchPlan,
    smaller: BatchPlan,
    thrashing_per_row: u64,
    smaller_per_row: u64,
    /// Thrash windows to let pass before trying `smaller` again.
    windows_left: u32,
    /// Losses in a row of `smaller` against `thrashing`.
    count: u32,
}

/// What the engine knows about one site's speed.
#[derive(Clone, Debug, Default)]
struct SiteSpeed {
    /// The plan of `churning`'s samples.
    plan: Option<BatchPlan>,
    /// Times per row of this plan's last churning steps in a row (at most a window of them).
    churning: Vec<u64>,
    trial: Option<Trial>,
    loss: Option<Loss>,
}

/// The outcome of [`SpeedBook::observe`] for the engine to act on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SpeedAction {
    /// Nothing to change.
    None,
    /// Start a trial of the smaller plan: learn its limits.
    Try(BatchPlan, SpeedDecision),
    /// The trial ended; with `Some(limits)` the larger plan won: restore them.
    Chose(SpeedDecision, Option<Limits>),
    /// The plan churned through a window but its smaller plan lost before: stay.
    Stayed(SpeedDecision),
}

/// What one successful step tells the speed book.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Observed<'a> {
    pub key: &'a MemoryKey,
    pub plan: BatchPlan,
    pub per_row: u64,
    pub churn: Churn,
    /// The thrash detector tripped at this step.
    pub tripped: bool,
    /// The limits in force after this step (before any thrash move).
    pub limits: Limits,
    /// The rows the step was asked for.
    pub batch: usize,
    /// The policy's next smaller plan for [`super::Pressure::Thrash`] (asked only when tripped).
    pub smaller: Option<BatchPlan>,
    /// Steps a trial measures.
    pub window: u32,
}

/// Times per row of the plans that churned, per site, and the trials of smaller plans.
#[derive(Debug, Default)]
pub(crate) struct SpeedBook {
    sites: Mutex<HashMap<MemoryKey, SiteSpeed>>,
    /// Trials under way: while none is, a step that churned nothing need not look at the book.
    trials: AtomicUsize,
}

impl SpeedBook {
    fn sites(&self) -> MutexGuard<'_, HashMap<MemoryKey, SiteSpeed>> {
        // Updates are whole assignments of plain data: a poisoned map is still a valid map.
        self.sites.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a step with `churn` must be shown to the book.
    pub(crate) fn wants(&self, churn: &Churn) -> bool {
        churn.any() || self.trials.load(Relaxed) > 0
    }

    /// Takes one successful step at a site whose detector tripped without an allocator retry, or
    /// that churned, or while a trial is under way; says what the engine must change.
    pub(crate) fn observe(&self, o: Observed<'_>) -> SpeedAction {
        let mut sites = self.sites();
        let site = match sites.get_mut(o.key) {
            Some(s) => s,
            None if o.churn.any() => sites.entry(o.key.clone()).or_default(),
            None => return SpeedAction::None,
        };
        if let Some(action) = self.trial_step(site, &o) {
            return action;
        }
        // The churning steps of the plan in a row, for its time per row.
        if !o.churn.any() || site.plan != Some(o.plan) {
            site.churning.clear();
            site.plan = Some(o.plan);
        }
        if o.churn.any() {
            site.churning.push(o.per_row);
            let w = o.window.max(1) as usize;
            if site.churning.len() > w {
                site.churning.remove(0);
            }
        }
        if !o.tripped {
            return SpeedAction::None;
        }
        let Some(smaller) = o.smaller else {
            return SpeedAction::None;
        };
        let thrashing_per_row = median(&site.churning);
        if let Some(l) = &mut site.loss {
            if l.thrashing == o.plan && l.smaller == smaller && l.windows_left > 0 {
                l.windows_left -= 1;
                return SpeedAction::Stayed(SpeedDecision::Stayed {
                    thrashing: o.plan,
                    smaller,
                    thrashing_per_row: Duration::from_nanos(l.thrashing_per_row),
                    smaller_per_row: Duration::from_nanos(l.smaller_per_row),
                    windows_left: l.windows_left,
                });
            }
        }
        let needed = o.window.max(1);
        site.trial = Some(Trial {
            thrashing: o.plan,
            limits: o.limits,
            tried: o.limits.learned(&smaller, o.batch),
            thrashing_per_row,
            smaller,
            settle_left: SETTLE_STEPS,
            samples: Vec::with_capacity(needed as usize),
            needed,
        });
        self.trials.fetch_add(1, Relaxed);
        SpeedAction::Try(
            smaller,
            SpeedDecision::Trying {
                thrashing: o.plan,
                smaller,
                thrashing_per_row: Duration::from_nanos(thrashing_per_row),
                steps: needed,
            },
        )
    }

    /// A step of `site`'s trial under way, if any: `Some` with what the engine must do (the
    /// trial goes on, or it ended with a choice); `None` when there is no trial, or it was
    /// abandoned because the plan changed under it.
    fn trial_step(&self, site: &mut SiteSpeed, o: &Observed<'_>) -> Option<SpeedAction> {
        let t = site.trial.as_mut()?;
        if o.limits != t.tried {
            // the limits changed under the trial (an out-of-memory, a regrow, another rank):
            // nothing to compare; what changed them stays
            tracing::debug!(
                target: "oomguard::retry",
                site = %o.key.site,
                plan = %o.plan,
                trial = %t.smaller,
                "speed trial abandoned: the limits changed"
            );
            site.trial = None;
            self.trials.fetch_sub(1, Relaxed);
            return None;
        }
        if t.settle_left > 0 {
            t.settle_left -= 1;
        } else {
            t.samples.push(o.per_row);
        }
        if t.samples.len() < t.needed as usize {
            return Some(SpeedAction::None);
        }
        let t = site.trial.take().expect("matched above");
        self.trials.fetch_sub(1, Relaxed);
        site.churning.clear();
        site.plan = None;
        let smaller_per_row = median(&t.samples);
        let smaller_wins = smaller_per_row < t.thrashing_per_row;
        let decision = SpeedDecision::Chose {
            thrashing: t.thrashing,
            smaller: t.smaller,
            thrashing_per_row: Duration::from_nanos(t.thrashing_per_row),
            smaller_per_row: Duration::from_nanos(smaller_per_row),
            kept: if smaller_wins { t.smaller } else { t.thrashing },
        };
        if smaller_wins {
            site.loss = None;
            return Some(SpeedAction::Chose(decision, None));
        }
        let count = match site.loss {
            Some(l) if l.thrashing == t.thrashing && l.smaller == t.smaller => l.count + 1,
            _ => 1,
        };
        site.loss = Some(Loss {
            thrashing: t.thrashing,
            smaller: t.smaller,
            thrashing_per_row: t.thrashing_per_row,
            smaller_per_row,
            windows_left: WINDOWS_AFTER_LOSS.saturating_mul(1 << (count - 1).min(16)),
            count,
        });
        Some(SpeedAction::Chose(decision, Some(t.limits)))
    }

    /// Forgets a site's speed (its detector moved it down for allocator retries).
    pub(crate) fn forget(&self, key: &MemoryKey) {
        if let Some(s) = self.sites().remove(key) {
            if s.trial.is_some() {
                self.trials.fetch_sub(1, Relaxed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trips_after_window_consecutive() {
        let d = ThrashDetector::new(3);
        let mut s = 0;
        assert!(!d.observe(&mut s, 0, 1));
        assert!(!d.observe(&mut s, 1, 2));
        assert!(!d.observe(&mut s, 2, 2), "a clean step resets");
        assert!(!d.observe(&mut s, 2, 3));
        assert!(!d.observe(&mut s, 3, 4));
        assert!(d.observe(&mut s, 4, 5));
        assert_eq!(s, 0);
        assert_eq!(ThrashDetector::new(0).window(), 1);
    }

    #[test]
    fn pages_moved_and_syncs_are_thrashing_too() {
        let d = ThrashDetector::new(2);
        let mut s = 0;
        let moved = Churn {
            unmaps: 1,
            unmapped_bytes: 2 << 20,
            ..Churn::default()
        };
        let synced = Churn {
            syncs: 1,
            ..Churn::default()
        };
        assert!(!d.observe_churn(&mut s, &moved));
        assert!(d.observe_churn(&mut s, &synced));
        assert!(!d.observe_churn(&mut s, &moved));
        assert!(
            !d.observe_churn(&mut s, &Churn::default()),
            "a settled step resets"
        );
        assert_eq!(s, 0);
    }

    #[test]
    fn median_is_the_lower_middle() {
        assert_eq!(median(&[5, 1, 9]), 5);
        assert_eq!(median(&[4, 1, 9, 7]), 4);
        assert_eq!(median(&[]), 0);
        assert_eq!(per_row(Duration::from_millis(10), 4), 2_500_000);
        assert_eq!(per_row(Duration::from_millis(1), 0), 1_000_000);
    }
}
