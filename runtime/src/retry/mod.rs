//! OOM retry: a training step that runs out of device memory is retried with a smaller footprint
//! instead of crashing, and nothing is lost.
//!
//! - [`IsOom`]: typed out-of-memory classification (never by message text).
//! - [`BatchPlan`]/[`Chunk`]: a batch split into weighted micro-batches.
//! - [`RetryPolicy`] and the built-in policies: same-plan retry after emptying the cache,
//!   gradient accumulation, batch shrinking, floors, retry limits, chains.
//! - [`RetryEngine`]: runs steps, retries, commits once, remembers per call site, device and grad
//!   mode what worked ([`PlanMemory`], optionally a JSON file), regrows after
//!   clean steps, moves down when the allocator thrashes (retries at once; pages moved or
//!   synchronisations: to the faster per row of the plan and the next smaller one,
//!   [`SpeedDecision`]), agrees with other ranks ([`Consensus`]). Drive it
//!   with a closure ([`RetryEngine::run`]), a [`Step`] ([`RetryEngine::run_step`]), or by hand
//!   ([`RetryEngine::begin`] → [`RetryLoop`]).
//! - [`GradientSync`]: the gradient all-reduce of a data-parallel step,
//!   once per step after the agreement (the rule is in its module's documentation).
//! - [`find_max_batch`]: a predictive batch-size finder (linear fit of peak memory).
//!
//! This module holds what a step needs; [`advanced`] holds the rest: the other built-in
//! policies and their combinators, every part of a report, nested commits, ranks, remembered
//! plans, the engine's figures, text classifiers for frameworks that flatten their errors.
//!
//! Better than the anchors: Accelerate shrinks the effective batch silently and string-matches
//! errors; here accumulation keeps the batch, errors are typed, every retry is logged and
//! reported. Lightning and toma search by trial and error; [`find_max_batch`] predicts.
//!
//! # The contract
//!
//! A step is split in two: the **attempt**, which may run many times and must have no lasting
//! effect (it computes gradients, losses, outputs), and the **commit** (the optimizer update),
//! which runs exactly once, after every micro-batch of one attempt succeeded. The engine never
//! commits a partial step, so a retried step gives the same result as an unretried one.
//!
//! - With [`RetryEngine::run`] the attempt is a closure returning what the commit needs (for
//!   example summed gradients); everything it allocated is dropped when it returns `Err`.
//! - With [`RetryEngine::run_step`] the step is a [`Step`]: [`Step::begin`] resets accumulated
//!   state at the start of each attempt, [`Step::micro_batch`] processes one chunk,
//!   [`Step::abort`] may free the state of a failed attempt, [`Step::commit`] runs once.
//!
//! What must not happen in an attempt: changing parameters or optimizer state, advancing a data
//! iterator (fetch the batch before calling the engine), or anything else that cannot be done
//! twice. The commit is not retried: allocate optimizer state before the first step. With
//! `#[oom_retry]` the function body is the attempt and `commit = |value| ...` is the commit: it
//! runs once with the body's value, after the attempt's guards (a `#[leak_check(action =
//! error)]` fails the step before the commit); its error, an out-of-memory included, is the
//! function's error and is recorded in [`RetryReport::commit_error`].
//!
//! Steps nest: a step may run inside another step's attempt. Every commit is counted on its thread
//! ([`note_commit`]); an attempt that fails after a commit ran inside it is
//! not retried (the outer step fails, [`RetryReport::nested_commit`] holds the inner report), and
//! the error is marked ([`IsOom::after_commit`]) so that no layer takes it for a retryable
//! out-of-memory. Driving a step by hand ([`RetryLoop`]), call
//! [`note_commit`] before its commit.

mod classify;
#[cfg(feature = "burn")]
mod classify_burn;
#[cfg(feature = "candle")]
mod classify_candle;
mod classify_tch;
mod clock;
mod commit;
mod consensus;
mod decision;
pub(crate) use decision::VOTE_WORDS;
mod engine;
mod finder;
mod gradients;
mod last_report;
mod memory;
mod policy;
mod result;
mod thrash;

pub mod advanced;

// What a step needs. The rest is in `advanced`.
pub use classify::IsOom;
pub use engine::{RetryEngine, Step};
pub use finder::{find_max_batch, FinderError, FinderOptions, FinderReport};
pub use last_report::last_report;
pub use policy::{inference_policy, training_policy, Accumulate, RetryPolicy};
pub use result::{Retried, RetryError};
// The report's plain data lies below the errors (`Error` holds a report); its paths are here.
pub use crate::retry_report::{BatchPlan, Chunk, RetryReport};

// The engine's own bookkeeping, for the macros' glue.
#[doc(hidden)]
pub use last_report::clear_last_report;
pub(crate) use last_report::{record_commit_error, record_hint};

// The paths these names had before `advanced` existed: still valid, not documented twice.
#[cfg(feature = "burn")]
#[doc(hidden)]
pub use advanced::cubecl_text_is_oom;
#[doc(hidden)]
pub use advanced::{
    chain_is_oom, libtorch_text_is_budget_exceeded, libtorch_text_is_oom,
    libtorch_text_oom_request, note_commit, oomguard_allocator_refusal, AfterCommit,
    AttemptOutcome, AttemptRecord, Chain, Clock, CommitFailure, Consensus, ConsensusError,
    DeviceKey, EmptyCacheRetry, FailedAttempt, Floor, FnPolicy, GradientSync, KeepsRows, Limits,
    LinearFit, LocalGroup, ManualClock, MaxRetries, MemoryError, MemoryKey, OomRequest, PlanError,
    PlanMemory, PolicyExt, Pressure, Regrow, RetryContext, RetryLoop, Shrink, SingleProcess,
    SiteMemo, SpeedDecision, StepMode, StopReason, Trial, UpdateApplied, DEFAULT_REGROW_AFTER,
    DEFAULT_THRASH_WINDOW, LARGER_BATCH_SHARE, LOCK_WAIT, MAX_ATTEMPTS, MAX_VERIFICATIONS,
    STALE_LOCK, VERIFY_EXTENSION,
};
