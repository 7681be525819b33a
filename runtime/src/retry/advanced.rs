//! The retry engine's finer controls and details, for code that goes beyond running steps:
//! custom policies, driving a step by hand across ranks, reading every field of a report,
//! inspecting or persisting remembered plans, classifying framework errors from their text.
//!
//! What a step needs day to day is in [`retry`](super) itself ([`RetryEngine`](super::RetryEngine),
//! [`Step`](super::Step), [`BatchPlan`](super::BatchPlan), [`last_report`](super::last_report),
//! [`find_max_batch`](super::find_max_batch), …). Everything here is as stable as those; it is
//! apart only so that the main module stays short. The items used before this module existed
//! are still reachable at their old paths (`retry::Shrink`), hidden from the documentation.
//!
//! - **Policies**: the built-in ones besides [`Accumulate`](super::Accumulate) ([`Shrink`],
//!   [`EmptyCacheRetry`], [`FnPolicy`], [`KeepsRows`]), the combinators of [`PolicyExt`]
//!   ([`Chain`], [`Floor`], [`MaxRetries`]) and what a policy is told ([`RetryContext`],
//!   [`Pressure`]).
//! - **The report's parts**: [`AttemptRecord`], [`AttemptOutcome`], [`StopReason`],
//!   [`OomRequest`], [`CommitFailure`], [`Regrow`], [`SpeedDecision`], [`StepMode`],
//!   [`PlanError`], and a failed attempt of [`RetryError::GaveUp`](super::RetryError::GaveUp)
//!   ([`FailedAttempt`]).
//! - **Nested steps**: [`note_commit`], [`AfterCommit`], [`UpdateApplied`].
//! - **A loop driven by hand**: [`RetryLoop`] (from
//!   [`RetryEngine::begin`](super::RetryEngine::begin)).
//! - **Several ranks**: the agreement between them ([`Consensus`]; [`LocalGroup`],
//!   [`SingleProcess`], [`ConsensusError`]), and the gradient
//!   all-reduce of a data-parallel step ([`GradientSync`]).
//! - **Remembered plans**: [`PlanMemory`], its keys ([`MemoryKey`], [`DeviceKey`]), what it
//!   holds ([`Limits`]), its errors ([`MemoryError`]), the engine's per-site memo
//!   ([`SiteMemo`]), and the lock figures of its file ([`LOCK_WAIT`], [`STALE_LOCK`]).
//! - **The finder's fit**: [`LinearFit`], [`Trial`].
//! - **Figures**: [`MAX_ATTEMPTS`], [`DEFAULT_REGROW_AFTER`], [`DEFAULT_THRASH_WINDOW`],
//!   [`LARGER_BATCH_SHARE`], [`MAX_VERIFICATIONS`], [`VERIFY_EXTENSION`].
//! - **Classifying by text** (for frameworks that flatten errors to strings): [`chain_is_oom`],
//!   [`libtorch_text_is_oom`], [`libtorch_text_is_budget_exceeded`],
//!   [`libtorch_text_oom_request`], [`oomguard_allocator_refusal`], and with the `burn`
//!   feature `cubecl_text_is_oom`; a caught panic's message ([`panic_text`], [`UNWRAP`]).

pub use super::classify::chain_is_oom;
#[cfg(feature = "burn")]
pub use super::classify_burn::cubecl_text_is_oom;
pub use super::classify_tch::{
    libtorch_text_is_budget_exceeded, libtorch_text_is_oom, libtorch_text_oom_request,
    oomguard_allocator_refusal,
};
#[doc(hidden)]
pub use super::clock::{Clock, ManualClock};
pub use super::commit::{note_commit, AfterCommit, UpdateApplied};
pub use super::consensus::{Consensus, ConsensusError, LocalGroup, SingleProcess};
pub use super::decision::MAX_ATTEMPTS;
pub use super::engine::RetryLoop;
pub use super::engine::{SiteMemo, DEFAULT_REGROW_AFTER, DEFAULT_THRASH_WINDOW};
pub use super::finder::{
    LinearFit, Trial, LARGER_BATCH_SHARE, MAX_VERIFICATIONS, VERIFY_EXTENSION,
};
pub use super::gradients::GradientSync;
pub use super::memory::{
    DeviceKey, Limits, MemoryError, MemoryKey, PlanMemory, LOCK_WAIT, STALE_LOCK,
};
pub use super::policy::{
    Chain, EmptyCacheRetry, Floor, FnPolicy, KeepsRows, MaxRetries, PolicyExt, Pressure,
    RetryContext, Shrink,
};
pub use super::result::FailedAttempt;
pub use crate::panic_text::{panic_text, UNWRAP};
pub use crate::retry_report::{
    AttemptOutcome, AttemptRecord, CommitFailure, OomRequest, PlanError, Regrow, SpeedDecision,
    StepMode, StopReason,
};
