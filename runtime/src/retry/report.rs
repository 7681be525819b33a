//! What the engine tells its caller: a report of every attempt, the step's value, or an error
//! holding every attempt's out-of-memory error.

use std::fmt;
use std::time::Duration;

use super::classify::{IsOom, OomRequest};
use super::consensus::ConsensusError;
use super::memory::StepMode;
use super::plan::BatchPlan;
use crate::source::Churn;

/// Why an attempt did not count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttemptOutcome {
    /// This rank ran out of memory.
    Oom,
    /// This rank succeeded, but another rank ran out of memory, so the attempt was discarded.
    PeerOom,
}

/// A failed attempt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttemptRecord {
    /// The plan the attempt ran.
    pub plan: BatchPlan,
    /// What happened.
    pub outcome: AttemptOutcome,
    /// The error's message, in full (for [`AttemptOutcome::Oom`]). Reports print only its
    /// first line: a candle error made with `bt()` carries a backtrace on
    /// the lines after it when `RUST_BACKTRACE` is set.
    pub error: Option<String>,
    /// The plan tried next (`None`: the engine gave up).
    pub next: Option<BatchPlan>,
    /// Bytes allocated on the device right after the failure (before the cache was emptied).
    pub allocated_bytes: u64,
    /// Bytes reserved from the device right after the failure.
    pub reserved_bytes: u64,
    /// Time the attempt took.
    pub elapsed: Duration,
    /// The attempt failed on a single request larger than the device's whole capacity (or a
    /// budget's whole limit): the same plan was not retried (emptying the cache cannot help).
    pub too_large: Option<OomRequest>,
}

/// Why the engine stopped a step before its policy ran out of plans.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum StopReason {
    /// Attempts started with more memory allocated than the previous one, twice (bytes
    /// allocated on the source when each attempt started, in order): the step keeps memory
    /// across attempts (a leak), so a smaller plan cannot help. See
    /// [`RetryEngine::stop_when_held_grows`](super::RetryEngine::stop_when_held_grows).
    HeldGrew {
        /// [`RetryReport::held_bytes`] when the engine stopped.
        held: Vec<u64>,
    },
    /// A request larger than the whole capacity did not shrink when the plan did: it does not
    /// depend on the batch, so no plan can serve it.
    TooLarge {
        /// The request of the last attempt.
        request: OomRequest,
        /// The plans of the last two attempts (larger first).
        plans: (BatchPlan, BatchPlan),
    },
}

/// `a -> b -> c` in readable sizes.
pub(crate) fn held_path(held: &[u64]) -> String {
    held.iter()
        .map(|b| crate::ByteSize(*b).to_string())
        .collect::<Vec<_>>()
        .join(" -> ")
}

impl fmt::Display for StopReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StopReason::HeldGrew { held } => write!(
                f,
                "allocated grew {} between attempts: the step keeps memory across attempts (a \
                 leak), so a retry cannot help; drop everything an attempt allocates before it \
                 returns (tensors kept in a collection outside the closure, a graph held by a \
                 value that outlives it)",
                held_path(held)
            ),
            StopReason::TooLarge { request, plans } => write!(
                f,
                "{request} did not shrink when the plan did ({} -> {}): it does not depend on \
                 the batch, so no plan can serve it",
                plans.0, plans.1
            ),
        }
    }
}

/// A try of one size up after a run of clean steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Regrow {
    /// The larger plan tried.
    pub tried: BatchPlan,
    /// Whether it worked (it is remembered) or hit OOM (the step fell back to the known plan).
    pub succeeded: bool,
}

/// What the engine did, for speed, about a plan whose steps churn without allocator retries
/// (pages moved, synchronisations inside the allocator; a step with allocator retries moves
/// down at once, see [`RetryReport::thrash_moved_to`]). Decided by time per row of successful
/// attempts (the median over the measured steps), the larger plan winning ties.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SpeedDecision {
    /// `thrashing` churned in every step of the thrash window: from the next step `smaller`
    /// runs, one step to settle, then `steps` measured steps, and the faster per row is kept.
    Trying {
        /// The plan whose steps churned.
        thrashing: BatchPlan,
        /// The next smaller plan (the policy's, for [`Pressure::Thrash`](super::Pressure)).
        smaller: BatchPlan,
        /// `thrashing`'s time per row over the window.
        thrashing_per_row: Duration,
        /// Steps of `smaller` that are measured.
        steps: u32,
    },
    /// The trial ended: `kept` runs from the next step (and is remembered). When it is
    /// `thrashing`, the engine moved back to it: the smaller plan was not faster per row.
    Chose {
        /// The plan whose steps churned.
        thrashing: BatchPlan,
        /// The smaller plan tried.
        smaller: BatchPlan,
        /// `thrashing`'s time per row.
        thrashing_per_row: Duration,
        /// `smaller`'s time per row.
        smaller_per_row: Duration,
        /// The faster of the two.
        kept: BatchPlan,
    },
    /// `thrashing` churned through another window, but `smaller` was measured slower per row:
    /// the plan stays; the smaller one is tried again after `windows_left` more windows.
    Stayed {
        /// The plan whose steps churned (kept).
        thrashing: BatchPlan,
        /// The smaller plan that lost.
        smaller: BatchPlan,
        /// `thrashing`'s time per row when they were compared.
        thrashing_per_row: Duration,
        /// `smaller`'s time per row when they were compared.
        smaller_per_row: Duration,
        /// Thrash windows to go before the next trial.
        windows_left: u32,
    },
}

impl SpeedDecision {
    /// The plan the engine moves to from the next step because of this decision (`None`: it
    /// stays on the plan of this step).
    pub fn moves_to(&self) -> Option<BatchPlan> {
        match *self {
            SpeedDecision::Trying { smaller, .. } => Some(smaller),
            SpeedDecision::Chose {
                thrashing, kept, ..
            } if kept == thrashing => Some(thrashing),
            _ => None,
        }
    }
}

impl fmt::Display for SpeedDecision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            SpeedDecision::Trying {
                thrashing,
                smaller,
                thrashing_per_row,
                steps,
            } => write!(
                f,
                "{thrashing} churned in every step of the thrash window ({thrashing_per_row:.3?} \
                 per row): trying {smaller} for {steps} measured steps; the faster per row is kept"
            ),
            SpeedDecision::Chose {
                thrashing,
                smaller,
                thrashing_per_row,
                smaller_per_row,
                kept,
            } => {
                write!(
                    f,
                    "{smaller} took {smaller_per_row:.3?} per row, {thrashing} \
                     {thrashing_per_row:.3?}: "
                )?;
                if kept == thrashing {
                    write!(
                        f,
                        "moved back to {thrashing} (the smaller plan is not faster per row)"
                    )
                } else {
                    write!(f, "kept {smaller} (faster per row)")
                }
            }
            SpeedDecision::Stayed {
                thrashing,
                smaller,
                thrashing_per_row,
                smaller_per_row,
                windows_left,
            } => write!(
                f,
                "{thrashing} churned again; kept, as {smaller} took {smaller_per_row:.3?} per row \
                 against {thrashing_per_row:.3?} (tried again after {windows_left} more thrash \
                 windows)"
            ),
        }
    }
}

/// What happened during one step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RetryReport {
    /// The call site (`file:line:column`).
    pub site: String,
    /// Train or eval (part of the memory key).
    pub mode: StepMode,
    /// Rows the caller asked for.
    pub requested_batch: usize,
    /// The plan of the first attempt.
    pub initial_plan: BatchPlan,
    /// Whether the first plan came from remembered limits.
    pub from_memory: bool,
    /// The plan that succeeded (or the last one tried).
    pub final_plan: BatchPlan,
    /// Failed attempts, in order.
    pub attempts: Vec<AttemptRecord>,
    /// A regrow attempted in this step.
    pub regrow: Option<Regrow>,
    /// The smaller plan the engine moved to after this step because the allocator thrashed:
    /// for good when the steps of the window made the allocator retry, as a trial otherwise
    /// ([`RetryReport::speed`]).
    pub thrash_moved_to: Option<BatchPlan>,
    /// The allocator's churn during the attempt that succeeded ([`Churn`]: allocator retries,
    /// pages moved, synchronisations), as thrash detection counted it; zero for a step that
    /// failed, and for a first attempt that ran without a loop and churned nothing.
    pub churn: Churn,
    /// A decision by time per row about a plan that churned ([`SpeedDecision`]).
    pub speed: Option<SpeedDecision>,
    /// Total time of the step, retries included.
    pub elapsed: Duration,
    /// The commit phase's failure, when it failed (`#[oom_retry(commit = ...)]`). The commit runs
    /// once and is never retried, an out-of-memory included: its error is the step's error.
    pub commit_error: Option<CommitFailure>,
    /// The plan file could not be read or written (corrupt, locked, unwritable): what is
    /// remembered is not persisted, and why.
    pub memory_error: Option<String>,
    /// The step failed without a retry: the message of the error that ended it (an error that
    /// is not an out-of-memory, or any error after a nested step committed, see
    /// [`RetryReport::nested_commit`]). `None` when the step succeeded or gave up
    /// ([`RetryReport::gave_up`]).
    pub failure: Option<String>,
    /// A step nested in this step's attempt committed (its update was applied), then the
    /// attempt failed: it was not retried, since a retry would apply that update again. The
    /// nested step's report, with its [`commit_error`](RetryReport::commit_error) when its
    /// commit failed (the last one, when several committed).
    pub nested_commit: Option<Box<RetryReport>>,
    /// What to change, when the engine can tell (e.g. `batch =` on a training step, which is
    /// never shrunk).
    pub hint: Option<String>,
    /// Bytes allocated on the source when each attempt started: the first when the step
    /// started, each later one once the failed attempt's memory was dropped and the cache
    /// emptied (the device synchronised). Equal values mean each attempt gave back what it
    /// took; values that rise again and again, that the step keeps memory across attempts (see
    /// [`RetryReport::held_grew`]). Empty for a step whose first attempt ran without a loop
    /// set up ([`RetryEngine::begin_any_memo`](super::RetryEngine::begin_any_memo)).
    pub held_bytes: Vec<u64>,
    /// Why the engine stopped before the policy ran out of plans (`None`: it did not).
    pub stopped: Option<StopReason>,
    /// The micro-batch the first attempt started from because the engine was seeded with it
    /// ([`RetryEngine::start_from`](super::RetryEngine::start_from)) and nothing was remembered
    /// for the step (`None`: not seeded, or something remembered took precedence).
    pub seeded: Option<usize>,
}

/// A commit phase that failed (see [`RetryReport::commit_error`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommitFailure {
    /// The error's message.
    pub error: String,
    /// Whether it was an out-of-memory (which is not retried in the commit).
    pub oom: bool,
}

/// This thread's last report; `valid` false once cleared (the report's buffers are kept, so
/// that the next one reuses them instead of allocating).
struct LastSlot {
    valid: bool,
    report: Option<RetryReport>,
    /// While `find_max_batch` runs a trial: the first step that ended on this thread without
    /// running its whole batch in one pass (see [`watch_steps`]).
    watch: Option<Option<RetryReport>>,
    /// The commit number ([`super::commit`]) of `report`'s step when it committed, else 0.
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
/// [`RetryEngine`]: super::RetryEngine
pub fn last_report() -> Option<RetryReport> {
    LAST.with(|l| {
        let l = l.borrow();
        l.report.as_ref().filter(|_| l.valid).cloned()
    })
}

/// Records that the commit phase of the step last reported on this thread at `site` failed
/// (the macros' glue calls it; a hand-written commit may too). Returns the report with the
/// failure recorded (`None` when the last report is not `site`'s).
pub fn record_commit_error(site: &str, error: String, oom: bool) -> Option<RetryReport> {
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
pub fn record_hint(site: &str, hint: String) {
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

impl RetryReport {
    /// The report of a step at `site` that has made no attempt yet: `requested_batch` rows
    /// planned as `plan`, nothing else recorded.
    pub(crate) fn starting(
        site: String,
        mode: StepMode,
        requested_batch: usize,
        plan: BatchPlan,
    ) -> Self {
        RetryReport {
            site,
            mode,
            requested_batch,
            initial_plan: plan,
            from_memory: false,
            final_plan: plan,
            attempts: Vec::new(),
            regrow: None,
            thrash_moved_to: None,
            churn: Churn::default(),
            speed: None,
            elapsed: Duration::ZERO,
            commit_error: None,
            memory_error: None,
            failure: None,
            nested_commit: None,
            hint: None,
            held_bytes: Vec::new(),
            stopped: None,
            seeded: None,
        }
    }
}

impl RetryReport {
    /// Number of retries: failed attempts that were followed by another attempt (the same as
    /// `attempts.len()` when the step succeeded; one fewer when it gave up).
    pub fn retries(&self) -> usize {
        self.attempts.iter().filter(|a| a.next.is_some()).count()
    }

    /// Whether the engine gave up: the last attempt ran out of memory and no plan was left.
    pub fn gave_up(&self) -> bool {
        self.attempts.last().is_some_and(|a| a.next.is_none())
    }

    /// Whether the bytes allocated when an attempt started ([`RetryReport::held_bytes`]) rose
    /// above the previous attempt's start at least twice: the step keeps memory across
    /// attempts. One rise alone is not counted (something made once, on first use, such as
    /// a library's workspace).
    pub fn held_grew(&self) -> bool {
        self.held_bytes.windows(2).filter(|w| w[1] > w[0]).count() >= 2
    }
}

impl RetryReport {
    /// The first line of the report: the site, and what happened to the step.
    pub(crate) fn headline(&self) -> Headline<'_> {
        Headline(self)
    }

    /// The copy of the report an error carries ([`IsOom::with_retry_report`]): the last
    /// attempt's error text is left out, as it is the error the report is attached to.
    pub(crate) fn attached(&self) -> RetryReport {
        let mut r = self.clone();
        if r.gave_up() {
            if let Some(a) = r.attempts.last_mut() {
                a.error = None;
            }
        }
        r
    }
}

/// [`RetryReport::headline`].
pub(crate) struct Headline<'a>(&'a RetryReport);

impl fmt::Display for Headline<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let r = self.0;
        let retries = r.retries();
        let plural = if retries == 1 { "y" } else { "ies" };
        write!(f, "{} ({:?}): ", r.site, r.mode)?;
        if r.gave_up() {
            return write!(
                f,
                "gave up (out of memory) after {} attempt{} ({retries} retr{plural}); last tried \
                 {} in {:.3?}",
                r.attempts.len(),
                if r.attempts.len() == 1 { "" } else { "s" },
                r.final_plan,
                r.elapsed
            );
        }
        if r.failure.is_some() {
            write!(
                f,
                "failed on attempt {} ({}) in {:.3?}, not retried",
                r.attempts.len() + 1,
                r.final_plan,
                r.elapsed
            )?;
            if let Some(n) = &r.nested_commit {
                write!(
                    f,
                    ": the step at {} committed during the attempt (a retry would apply its \
                     update again)",
                    n.site
                )?;
            }
            return Ok(());
        }
        write!(
            f,
            "{} after {retries} retr{plural} in {:.3?}",
            r.final_plan, r.elapsed
        )?;
        if let Some(c) = &r.commit_error {
            let what = if c.oom { "out of memory" } else { "an error" };
            write!(f, ", then its commit failed ({what}; not retried)")?;
        }
        Ok(())
    }
}

/// The first line of an error's text: what a report prints for each attempt, one line each
/// whatever `RUST_BACKTRACE` is (candle's `Error::bt()` appends a backtrace of about 35 lines
/// after the message; the full text stays in [`AttemptRecord::error`]).
fn message_line(text: &str) -> &str {
    text.lines().next().unwrap_or("")
}

impl fmt::Display for RetryReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.headline())?;
        if let Some(m) = self.seeded {
            write!(
                f,
                "\n  started from micro-batches of {m} rows (RetryEngine::start_from; nothing \
                 remembered for this step)"
            )?;
        }
        for (i, a) in self.attempts.iter().enumerate() {
            write!(f, "\n  attempt {}: {} → {:?}", i + 1, a.plan, a.outcome)?;
            if let Some(e) = &a.error {
                write!(f, ": {}", message_line(e))?;
            }
            if let Some(r) = &a.too_large {
                write!(
                    f,
                    " [{r}: larger than the whole, so the same plan was not retried]"
                )?;
            }
        }
        match &self.stopped {
            Some(s) => write!(f, "\n  stopped: {s}")?,
            None if self.held_grew() => write!(
                f,
                "\n  allocated grew {} between attempts: the step keeps memory across attempts \
                 (a leak?)",
                held_path(&self.held_bytes)
            )?,
            None => {}
        }
        if let Some(d) = &self.speed {
            write!(f, "\n  speed: {d}")?;
        }
        if let Some(p) = self.thrash_moved_to {
            if !matches!(self.speed, Some(SpeedDecision::Trying { .. })) {
                write!(
                    f,
                    "\n  allocator thrashing ({}): moved to {p} before a hard out-of-memory",
                    self.churn
                )?;
            }
        }
        if let Some(e) = &self.failure {
            write!(f, "\n  error: {}", message_line(e))?;
        }
        if let Some(m) = &self.memory_error {
            write!(f, "\n  plan file: {m}")?;
        }
        if let Some(c) = &self.commit_error {
            let what = if c.oom { "out of memory" } else { "error" };
            write!(f, "\n  commit failed ({what}, not retried): {}", c.error)?;
        }
        if let Some(h) = &self.hint {
            write!(f, "\n  hint: {h}")?;
        }
        if let Some(n) = &self.nested_commit {
            write!(f, "\n  nested step that committed: ")?;
            // indented one level more
            for (i, line) in n.to_string().lines().enumerate() {
                if i > 0 {
                    f.write_str("\n  ")?;
                }
                f.write_str(line)?;
            }
        }
        Ok(())
    }
}

/// A step's value with the report of how it was obtained.
#[derive(Clone, Debug)]
pub struct Retried<T> {
    /// What the commit returned.
    pub value: T,
    /// How the step went.
    pub report: RetryReport,
}

/// One failed attempt of a step that gave up.
#[derive(Debug)]
pub struct FailedAttempt<E> {
    /// The plan it ran.
    pub plan: BatchPlan,
    /// This rank's error (`None`: this rank succeeded and another rank hit OOM).
    pub error: Option<E>,
}

/// The step did not complete. Nothing was committed.
#[derive(Debug)]
#[non_exhaustive]
pub enum RetryError<E> {
    /// The step failed with an error that is not out-of-memory; it was not retried.
    Step {
        /// The step's error.
        error: E,
        /// How the step went until then.
        report: Box<RetryReport>,
    },
    /// Out of memory at every plan the policy allowed.
    GaveUp {
        /// Every attempt, with its error.
        failures: Vec<FailedAttempt<E>>,
        /// How the step went.
        report: Box<RetryReport>,
    },
    /// Another rank failed (with a non-OOM error, or gave up); this rank stopped with it.
    PeerFailed {
        /// How the step went.
        report: Box<RetryReport>,
    },
    /// The arguments were wrong (a batch of 0 rows).
    InvalidArgument(String),
    /// The ranks could not agree.
    Consensus(ConsensusError),
}

impl<E> RetryError<E> {
    /// The step's own error, for callers that must return `E`: the non-OOM error, or the last
    /// out-of-memory error of a step that gave up, with the report attached where `E` can carry
    /// it ([`IsOom::with_retry_report`]). `None` when this rank had no error of its own (another
    /// rank failed, consensus failed, invalid argument).
    pub fn into_error(self) -> Option<E>
    where
        E: IsOom,
    {
        match self {
            RetryError::Step { error, .. } => Some(error),
            RetryError::GaveUp { failures, report } => failures
                .into_iter()
                .rev()
                .find_map(|f| f.error)
                .map(|e| e.with_retry_report(&report.attached())),
            _ => None,
        }
    }

    /// The report, when the step ran at all.
    pub fn report(&self) -> Option<&RetryReport> {
        match self {
            RetryError::Step { report, .. }
            | RetryError::GaveUp { report, .. }
            | RetryError::PeerFailed { report } => Some(report),
            _ => None,
        }
    }
}

impl<E: fmt::Display> fmt::Display for RetryError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RetryError::Step { error, report } => match &report.nested_commit {
                Some(n) => write!(
                    f,
                    "step failed, not retried (the step at {} committed during the attempt): \
                     {error}",
                    n.site
                ),
                None => write!(f, "step failed: {error}"),
            },
            RetryError::GaveUp { failures, report } => {
                match &report.stopped {
                    Some(why) => write!(
                        f,
                        "out of memory at {} after {} attempts; stopped: {why}",
                        report.site,
                        failures.len()
                    )?,
                    None => write!(
                        f,
                        "out of memory at {} after {} attempts; the policy allows nothing smaller",
                        report.site,
                        failures.len()
                    )?,
                }
                if report.stopped.is_none() && report.held_grew() {
                    write!(
                        f,
                        "\n  allocated grew {} between attempts: the step keeps memory across \
                         attempts (a leak?)",
                        held_path(&report.held_bytes)
                    )?;
                }
                for (i, a) in failures.iter().enumerate() {
                    write!(f, "\n  attempt {} ({}): ", i + 1, a.plan)?;
                    match &a.error {
                        Some(e) => write!(f, "{}", message_line(&e.to_string()))?,
                        None => write!(f, "another rank ran out of memory")?,
                    }
                }
                Ok(())
            }
            RetryError::PeerFailed { report } => {
                write!(f, "another rank failed at {}; stopped with it", report.site)
            }
            RetryError::InvalidArgument(m) => write!(f, "invalid argument: {m}"),
            RetryError::Consensus(e) => write!(f, "{e}"),
        }
    }
}

impl<E: fmt::Display + fmt::Debug> std::error::Error for RetryError<E> {}

impl<E: IsOom> IsOom for RetryError<E> {
    fn is_oom(&self) -> bool {
        match self {
            RetryError::GaveUp { .. } => true,
            // after a nested commit: never retryable
            RetryError::Step { error, report } => report.nested_commit.is_none() && error.is_oom(),
            _ => false,
        }
    }
    /// A budget's out-of-memory when the last failure that has an error of this rank is one
    /// (a step that gave up), or the step's own error is one (and nothing committed inside it).
    fn is_budget_exceeded(&self) -> bool {
        match self {
            RetryError::GaveUp { failures, .. } => failures
                .iter()
                .rev()
                .find_map(|f| f.error.as_ref())
                .is_some_and(IsOom::is_budget_exceeded),
            RetryError::Step { error, report } => {
                report.nested_commit.is_none() && error.is_budget_exceeded()
            }
            _ => false,
        }
    }
}
