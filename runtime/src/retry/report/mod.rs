//! What the engine tells its caller: a report of every attempt, the step's value, or an error
//! holding every attempt's out-of-memory error.

mod display;
mod last;
mod record;
mod speed;

pub(crate) use display::{held_path, message_line};
pub use last::{clear_last_report, last_report, record_commit_error, record_hint};
pub(crate) use last::{
    committed_since, mark_last_committed, set_last_clean, set_last_report, watch_steps,
};
pub use record::{AttemptOutcome, AttemptRecord, CommitFailure, Regrow, RetryReport, StopReason};
pub use speed::SpeedDecision;
