//! The last report of each thread ([`last_report`]), and the marks the commits and the batch
//! finder leave on it.

use crate::retry_report::{BatchPlan, Churn, CommitFailure, RetryReport, StepMode};

/// This thread's last report; `valid` false once cleared (the report's buffers are kept, so
/// that the next one reuses them instead of allocating).
struct LastSlot {
    valid: bool,
    report: Option<RetryReport>,
    /// While `find_max_batch` runs a trial: the first step that ended on this thread without
    /// running its whole batch in one pass (see [`watch_steps`]).
    watch: Option<Option<RetryReport>>,
    /// The commit number ([`crate::retry::commit`]) of `report`'s step when it committed, else 0.
    committed: u64,
    /// The report of the last step that committed, once a later step replaced it in `report`:
    /// an enclosing step whose attempt fails reads it ([`committed_since`]).
    prior: Option<RetryReport>,
    /// `prior`'s commit number (0: none).
    prior_committed: u64,
}

impl LastSlot {
    /// `report` is about to be replaced: a committed one moves to `prior` (their buffers are
    /// swapped, so that none is allocated).
    fn keep_committed(&mut self) {
        if self.valid && self.committed != 0 {
            std::mem::swap(&mut self.report, &mut self.prior);
            self.prior_committed = self.committed;
        }
        self.committed = 0;
    }
}

thread_local! {
    static LAST: std::cell::RefCell<LastSlot> = const {
        std::cell::RefCell::new(LastSlot {
            valid: false,
            report: None,
            watch: None,
            committed: 0,
            prior: None,
            prior_committed: 0,
        })
    };
}

/// Whether a step ran (or tried) its whole requested batch in one pass (what a batch finder
/// can measure): no retry, no rows dropped, no split (remembered or not). A step that gave up
/// at its first attempt is a plain out-of-memory.
fn one_pass(r: &RetryReport) -> bool {
    r.retries() == 0
        && r.final_plan.batch() == r.requested_batch
        && r.final_plan.num_chunks() == 1
        && r.initial_plan.num_chunks() == 1
}

/// Starts (`true`) or stops (`false`) watching the steps that end on this thread; stopping
/// returns the first step that did not run its whole batch in one pass, if any. Every step
/// reports here (nested ones included, which `last_report` alone would lose to the outer one).
pub(crate) fn watch_steps(on: bool) -> Option<RetryReport> {
    LAST.try_with(|l| {
        let mut l = l.borrow_mut();
        let seen = l.watch.take().flatten();
        if on {
            l.watch = Some(None);
        }
        seen
    })
    .ok()
    .flatten()
}

/// Marks the last report as its step's commit number `n` (its commit is starting).
pub(crate) fn mark_last_committed(n: u64) {
    let _ = LAST.try_with(|l| {
        let mut l = l.borrow_mut();
        if l.valid {
            l.committed = n;
        }
    });
}

/// The report of the last step on this thread that committed after commit number `seq`, with
/// its commit number.
pub(crate) fn committed_since(seq: u64) -> Option<(u64, RetryReport)> {
    LAST.try_with(|l| {
        let l = l.borrow();
        if l.valid && l.committed > seq {
            return l.report.clone().map(|r| (l.committed, r));
        }
        if l.prior_committed > seq {
            return l.prior.clone().map(|r| (l.prior_committed, r));
        }
        None
    })
    .ok()
    .flatten()
}

/// The report of the last step on this thread (through any [`RetryEngine`] use, `#[oom_retry]`
/// included), to see the retries a step took, the plan it ran with and the rows it processed
/// (`final_plan.batch()` of `requested_batch`). Cleared when a step starts and set when it
/// ends, whether it succeeded or failed; `None` while a step runs and after a step that did not
/// start (a batch of 0 rows).
///
/// [`RetryEngine`]: crate::retry::RetryEngine
pub fn last_report() -> Option<RetryReport> {
    LAST.with(|l| {
        let l = l.borrow();
        l.report.as_ref().filter(|_| l.valid).cloned()
    })
}

/// Records that the commit phase of the step last reported on this thread at `site` failed
/// (the macros' glue calls it; a hand-written commit may too). Returns the report with the
/// failure recorded (`None` when the last report is not `site`'s).
pub(crate) fn record_commit_error(site: &str, error: String, oom: bool) -> Option<RetryReport> {
    LAST.try_with(|l| {
        let mut l = l.borrow_mut();
        if !l.valid {
            return None;
        }
        let r = l.report.as_mut().filter(|r| r.site == site)?;
        r.commit_error = Some(CommitFailure { error, oom });
        Some(r.clone())
    })
    .ok()
    .flatten()
}

/// Adds `hint` ([`RetryReport::hint`]) to the report of the step last reported on this thread
/// at `site` (the macros' glue calls it when it knows what the user should change).
pub(crate) fn record_hint(site: &str, hint: String) {
    let _ = LAST.try_with(|l| {
        let mut l = l.borrow_mut();
        if !l.valid {
            return;
        }
        if let Some(r) = l.report.as_mut().filter(|r| r.site == site) {
            r.hint = Some(hint);
        }
    });
}

/// Forgets this thread's last report (every step does when it starts; `#[oom_retry]` also
/// when a call has nothing to plan, such as a batch of 0 rows).
pub fn clear_last_report() {
    let _ = LAST.try_with(|l| {
        let mut l = l.borrow_mut();
        l.keep_committed();
        l.valid = false;
    });
}

pub(crate) fn set_last_report(r: &RetryReport) {
    let _ = LAST.try_with(|l| {
        let mut l = l.borrow_mut();
        l.keep_committed();
        if let Some(first @ None) = &mut l.watch {
            if !one_pass(r) {
                *first = Some(r.clone());
            }
        }
        match &mut l.report {
            Some(old) => old.clone_from(r),
            none => *none = Some(r.clone()),
        }
        l.valid = true;
    });
}

/// The report of a step whose first attempt, with `plan` and nothing remembered, succeeded,
/// written over the last one in place (no allocation once the site fits).
pub(crate) fn set_last_clean(
    site: &str,
    mode: StepMode,
    plan: BatchPlan,
    elapsed: std::time::Duration,
) {
    let _ = LAST.try_with(|l| {
        let mut l = l.borrow_mut();
        l.keep_committed();
        let r = l.report.get_or_insert_with(|| RetryReport {
            elapsed,
            ..RetryReport::starting(String::new(), mode, 0, plan)
        });
        if r.site != site {
            r.site.clear();
            r.site.push_str(site);
        }
        r.mode = mode;
        r.requested_batch = plan.batch();
        r.initial_plan = plan;
        r.from_memory = false;
        r.final_plan = plan;
        r.attempts.clear();
        r.regrow = None;
        r.thrash_moved_to = None;
        r.churn = Churn::default();
        r.speed = None;
        r.elapsed = elapsed;
        r.commit_error = None;
        r.memory_error = None;
        r.failure = None;
        r.nested_commit = None;
        r.hint = None;
        r.held_bytes.clear();
        r.stopped = None;
        r.seeded = None;
        l.valid = true;
        if plan.num_chunks() > 1 {
            if let Some(None) = l.watch {
                l.watch = l.report.clone().map(Some);
            }
        }
    });
}
