//! Commits on this thread: what makes a failed attempt impossible to retry.
//!
//! A step's commit (the optimizer update) runs once. When a step is nested in another step's
//! attempt (an `#[oom_retry(commit = ..)]` function called from an `#[oom_retry]` function, a
//! [`RetryEngine::run`](super::RetryEngine::run) inside another's attempt), rerunning the outer
//! attempt would run the inner commit again: the update would land twice. So every commit is
//! counted on its thread ([`note_commit`]), and an engine whose attempt failed after a commit
//! ran inside it does not retry it, whatever the error ([`RetryReport::nested_commit`] says
//! which step committed). An error that left a commit (its own, or a nested one's) is marked
//! where its type can carry the mark ([`IsOom::after_commit`](super::IsOom::after_commit)), so
//! that [`IsOom::is_oom`](super::IsOom::is_oom) says `false` for it on any thread too.
//!
//! [`RetryReport::nested_commit`]: super::RetryReport::nested_commit

use std::cell::Cell;
use std::fmt;

use crate::retry_report::RetryReport;

thread_local! {
    /// Commits started on this thread (never reset: attempts compare two readings).
    static COMMITS: Cell<u64> = const { Cell::new(0) };
}

/// Commits started on this thread so far.
pub(crate) fn commits() -> u64 {
    COMMITS.try_with(Cell::get).unwrap_or(0)
}

/// Tells enclosing retry loops on this thread that a step's commit is starting: an attempt of
/// theirs that fails after this point is not retried (it would run this commit again).
/// [`RetryEngine::run`](super::RetryEngine::run), [`RetryEngine::run_step`](super::RetryEngine::run_step)
/// and `#[oom_retry(commit = ..)]` call it; call it yourself before the commit of a step you
/// drive by hand ([`RetryLoop`](super::advanced::RetryLoop)), after `next` returned `Break(Ok(..))`.
pub fn note_commit() {
    let _ = COMMITS.try_with(|c| {
        let n = c.get() + 1;
        c.set(n);
        super::last_report::mark_last_committed(n);
    });
}

/// The mark an error carries once an update was applied (see [`IsOom::after_commit`]): the
/// report of the step, with its [`commit_error`](RetryReport::commit_error) or
/// [`nested_commit`](RetryReport::nested_commit). It is the context an `anyhow::Error` gets;
/// oomguard's own error carries the same as [`Error::AfterCommit`](crate::Error::AfterCommit).
/// An error chain holding it is never an out-of-memory for [`IsOom`].
///
/// [`IsOom::after_commit`]: super::IsOom::after_commit
/// [`IsOom`]: super::IsOom
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AfterCommit {
    /// The step's report.
    pub report: Box<RetryReport>,
}

impl fmt::Display for AfterCommit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (not retried: an update was already applied)",
            self.report.headline()
        )
    }
}

impl std::error::Error for AfterCommit {}

/// The mark in the `source()` chain of an error whose update was (maybe in part) applied, for
/// an error that holds the update's own error in a field rather than marked: a `train_step`'s
/// `TrainStepError::Update` reports it as its source, so that a walk of the chain
/// ([`chain_is_oom`](super::chain_is_oom), a boxed `dyn Error`, an `anyhow::Error`) stops there
/// instead of finding the optimizer's out-of-memory and calling the step retryable. The
/// update's error is in the variant (and its message).
///
/// ```
/// use oomguard_runtime::retry::advanced::{chain_is_oom, UpdateApplied};
/// assert!(!chain_is_oom(&UpdateApplied));
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UpdateApplied;

impl fmt::Display for UpdateApplied {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(
            "an update was already applied, maybe in part: not retryable (the update's own \
             error is in the error that holds this mark)",
        )
    }
}

impl std::error::Error for UpdateApplied {}

/// An `io::Error` marked as coming after a commit (see [`IsOom::after_commit`]); its source is
/// the original error.
///
/// [`IsOom::after_commit`]: super::IsOom::after_commit
#[derive(Debug)]
pub(crate) struct AfterCommitIo {
    pub(crate) error: std::io::Error,
    pub(crate) mark: AfterCommit,
}

impl fmt::Display for AfterCommitIo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.mark, self.error)
    }
}

impl std::error::Error for AfterCommitIo {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}
