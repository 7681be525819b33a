//! The report of one step: its attempts, the plans, why it stopped, what it learned.

use std::time::Duration;

use super::churn::Churn;
use super::oom_request::OomRequest;
use super::plan::BatchPlan;
use super::speed::SpeedDecision;
use super::step_mode::StepMode;

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

/// Why the engine stopped a step before its policy ran out of smaller plans.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum StopReason {
    /// Attempts started with more memory allocated than the previous one, twice (bytes
    /// allocated on the source when each attempt started, in order): the step keeps memory
    /// across attempts (a leak), so a smaller plan cannot help. See
    /// [`RetryEngine::stop_when_held_grows`](crate::retry::RetryEngine::stop_when_held_grows).
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
    /// The policy's limit on retries in one step
    /// ([`RetryPolicy::retry_limit`](crate::retry::RetryPolicy::retry_limit), set by
    /// `max_retries`: 16 in the training policy, 32 in the inference one) was reached: smaller
    /// plans may be left, but the policy gives up after `max` retries.
    RetryLimit {
        /// The limit.
        max: u32,
    },
    /// The engine's own cap of failed attempts in one step
    /// ([`MAX_ATTEMPTS`](crate::retry::advanced::MAX_ATTEMPTS), whatever the policy says) was
    /// reached: the policy was not asked again.
    AttemptCap {
        /// The cap.
        max: u32,
    },
    /// With several ranks: another rank's plan runs fewer rows than its batch while a rank's
    /// policy keeps every row ([`RetryPolicy::keeps_rows`](crate::retry::RetryPolicy::keeps_rows):
    /// a training step), so no plan serves both; every rank gives up rather than train one rank
    /// on part of its batch.
    RanksDisagreeOnRows {
        /// The most rows any rank's plan dropped.
        dropped: usize,
    },
    /// With several ranks: the ranks met in one agreement from different steps (another call
    /// site, or train beside eval: one rank ran a step the others did not, or in another
    /// order), so what they would agree on belongs to different steps; every rank stops.
    RanksAtDifferentSteps,
    /// With several ranks: another rank gave up for lack of memory (no plan of its policy
    /// fit), so this rank stopped with it ([`RetryError::PeerFailed`](crate::retry::RetryError::PeerFailed)).
    /// That error is an out-of-memory like the peer's give-up, so that every rank's caller
    /// sees the same kind of failure: a step nested in a retried one fails on every rank as an
    /// out-of-memory, and every rank's outer step retries with a smaller plan together.
    PeerGaveUp,
}

/// A try of one size up after a run of clean steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Regrow {
    /// The larger plan tried.
    pub tried: BatchPlan,
    /// Whether it worked (it is remembered) or hit OOM (the step fell back to the known plan).
    pub succeeded: bool,
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
    /// Whether remembered limits set the first plan: false when nothing is remembered for the
    /// step, and when what is remembered does not bind at this batch (a micro-batch cap above
    /// it, or above the caller's own cap), so that the plan is the one it would be without.
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
    /// set up ([`RetryEngine::begin_any_memo`](crate::retry::RetryEngine::begin_any_memo)).
    pub held_bytes: Vec<u64>,
    /// Why the engine stopped before the policy ran out of smaller plans (`None`: it did not).
    pub stopped: Option<StopReason>,
    /// The micro-batch the first attempt started from because the engine was seeded with it
    /// ([`RetryEngine::start_from`](crate::retry::RetryEngine::start_from)) and nothing was remembered
    /// for the step (`None`: not seeded, something remembered took precedence, or the seed
    /// would not change the first plan: the batch is no larger than the seed, or a micro-batch
    /// cap already below it applies).
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

    /// Whether the texts add the leak hint: held memory grew twice and no stop already says
    /// so (or says that no plan could help).
    pub(crate) fn may_leak(&self) -> bool {
        self.held_grew()
            && matches!(
                self.stopped,
                None | Some(StopReason::RetryLimit { .. } | StopReason::AttemptCap { .. })
            )
    }
}

impl RetryReport {
    /// The copy of the report an error carries ([`IsOom::with_retry_report`]): the last
    /// attempt's error text is left out, as it is the error the report is attached to.
    ///
    /// [`IsOom::with_retry_report`]: crate::retry::IsOom::with_retry_report
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
