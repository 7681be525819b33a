//! The report of a retried step, as plain data: its attempts and plans ([`BatchPlan`],
//! [`Chunk`]), the request an out-of-memory failed on ([`OomRequest`]), the allocator's churn
//! ([`Churn`]), the step's mode ([`StepMode`]) and what the engine decided ([`SpeedDecision`],
//! [`StopReason`]).
//!
//! It lies at the bottom layer, beside the errors, because [`Error`](crate::Error) holds a
//! report (`RetriesExhausted`, `AfterCommit`); it names nothing above it. The engine that fills
//! it in lives in [`retry`](crate::retry), which re-exports every item here (and
//! [`source`](crate::source) re-exports [`Churn`], the crate root [`BatchPlan`] and [`Chunk`]).

mod churn;
mod display;
mod oom_request;
mod plan;
mod record;
mod speed;
mod step_mode;

pub use churn::Churn;
pub(crate) use display::{held_path, message_line};
pub use oom_request::OomRequest;
pub use plan::{BatchPlan, Chunk, PlanError};
pub use record::{AttemptOutcome, AttemptRecord, CommitFailure, Regrow, RetryReport, StopReason};
pub use speed::SpeedDecision;
pub use step_mode::StepMode;
