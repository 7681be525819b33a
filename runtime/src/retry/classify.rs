//! Typed out-of-memory classification: the [`IsOom`] trait.
//!
//! Retrying is only safe for errors that mean "not enough memory". Errors are classified by
//! type, never by matching message text: oomguard's own errors, [`BackendError`]s of kind
//! out-of-memory, cudarc's `CUDA_ERROR_OUT_OF_MEMORY` and `CUBLAS_STATUS_ALLOC_FAILED` (with the
//! `cuda` feature), and any `dyn std::error::Error` whose `source()` chain holds one of those.

use std::error::Error as StdError;

use super::commit::{AfterCommit, AfterCommitIo, UpdateApplied};
use crate::backend::BackendError;
use crate::error::{BudgetExceeded, Error, OomError};
use crate::retry_report::{OomRequest, RetryReport};

/// Whether an error means the device ran out of memory (so a smaller footprint may succeed).
///
/// Implement it for your own error enums, delegating to the variants that wrap device errors
/// (`#[oom_retry]` also needs `Display` on the error: its report quotes each attempt's error):
///
/// ```
/// use oomguard_runtime::retry::IsOom;
/// use oomguard_runtime::{Device, ByteSize};
///
/// #[derive(Debug)]
/// enum TrainError { Device(oomguard_runtime::Error), Data(String) }
///
/// impl IsOom for TrainError {
///     fn is_oom(&self) -> bool {
///         match self {
///             TrainError::Device(e) => IsOom::is_oom(e),
///             TrainError::Data(_) => false,
///         }
///     }
/// }
///
/// let dev = Device::sim(ByteSize::mib(1));
/// let err = TrainError::Device(dev.alloc::<u8>(2 << 20).unwrap_err());
/// assert!(err.is_oom());
/// assert!(!TrainError::Data("bad row".into()).is_oom());
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` does not implement `IsOom`: the retry engine cannot tell whether it is an out-of-memory",
    label = "the error type of this step",
    note = "for `anyhow::Error` (`anyhow::Result`), enable oomguard's `anyhow` feature: oomguard = {{ version = \"0.1\", features = [\"anyhow\"] }}",
    note = "for `candle_core::Error`, enable the `candle` feature (or use oomguard-candle); for tch's `TchError`, the `tch` feature (or use oomguard-tch); for an error type of your own, implement `oomguard::retry::IsOom` for it"
)]
pub trait IsOom {
    /// `true` when the error is an out-of-memory.
    fn is_oom(&self) -> bool;

    /// `true` when the out-of-memory is a memory budget's ([`BudgetExceeded`]): emptying the
    /// cache cannot help, so the engine skips the same-plan retry. `false` by default.
    fn is_budget_exceeded(&self) -> bool {
        false
    }

    /// The single request that failed and the most its device (or budget) could ever give,
    /// when the error knows them: oomguard's [`OomError`] (the device's capacity) and
    /// [`BudgetExceeded`] (the budget's limit), also inside other errors (a `source()` chain,
    /// candle's wrappers, `io::Error`). A request larger than the whole capacity cannot be
    /// served by emptying the cache, whatever else is freed: the retry engine skips the
    /// same-plan retry for it ([`Pressure::TooLarge`](super::Pressure::TooLarge)) and stops
    /// when the request does not shrink with the plan. `None` by default.
    fn oom_request(&self) -> Option<OomRequest> {
        None
    }

    /// Bytes in use against the same capacity as [`IsOom::oom_request`]'s when the request
    /// failed: the device's allocated bytes ([`OomError::allocated`]) or the budget's
    /// ([`BudgetExceeded::in_use`]), read through the same wrappers. The retry engine tells
    /// with it one allocation failing again (same size, no more in use before it) from another
    /// allocation of the same size that a smaller plan reached (with the first one's memory in
    /// use). `None` by default (then the size alone is compared).
    fn oom_in_use(&self) -> Option<u64> {
        None
    }

    /// The error a step that gave up returns, with the report of its attempts attached when the
    /// type can carry it: oomguard's [`Error`] becomes [`Error::RetriesExhausted`], an
    /// `anyhow::Error` (feature `anyhow`) gets the report as context, an `io::Error` wraps it.
    /// By default the error is returned as it is; the report is always in
    /// [`last_report`](super::last_report).
    fn with_retry_report(self, _report: &RetryReport) -> Self
    where
        Self: Sized,
    {
        self
    }

    /// The error of a step after an update was applied: its commit failed, or a step nested in
    /// its attempt committed before the attempt failed. No layer may retry it (a retry would
    /// apply the update again), so it is marked where the type can carry a mark, and
    /// [`IsOom::is_oom`] of the result is `false`: oomguard's [`Error`] becomes
    /// [`Error::AfterCommit`], an `anyhow::Error` gets an [`AfterCommit`] context, an
    /// `io::Error` is wrapped (kind `Other`). An error already marked is returned as it is (it
    /// carries the innermost report). By default the error is returned unchanged: the engines
    /// still refuse to retry it on this thread, as they count commits
    /// ([`note_commit`](super::note_commit)), but a retry loop of your own would not know.
    fn after_commit(self, _report: &RetryReport) -> Self
    where
        Self: Sized,
    {
        self
    }
}

impl IsOom for Error {
    fn is_oom(&self) -> bool {
        Error::is_oom(self)
    }
    fn oom_request(&self) -> Option<OomRequest> {
        match self {
            Error::Oom(e) => e.oom_request(),
            Error::BudgetExceeded(e) => e.oom_request(),
            // the last error of a nested step that gave up
            Error::RetriesExhausted { error, .. } => error.oom_request(),
            _ => None,
        }
    }
    fn oom_in_use(&self) -> Option<u64> {
        match self {
            Error::Oom(e) => e.oom_in_use(),
            Error::BudgetExceeded(e) => e.oom_in_use(),
            Error::RetriesExhausted { error, .. } => error.oom_in_use(),
            _ => None,
        }
    }
    fn is_budget_exceeded(&self) -> bool {
        match self {
            Error::BudgetExceeded(_) => true,
            Error::RetriesExhausted { error, .. } => error.is_budget_exceeded(),
            _ => false,
        }
    }
    fn with_retry_report(self, report: &RetryReport) -> Self {
        match self {
            // a nested retried step: keep the inner report, the outer is in `last_report`
            e @ (Error::RetriesExhausted { .. } | Error::AfterCommit { .. }) => e,
            error => Error::RetriesExhausted {
                error: Box::new(error),
                report: Box::new(report.clone()),
            },
        }
    }
    fn after_commit(self, report: &RetryReport) -> Self {
        match self {
            e @ Error::AfterCommit { .. } => e,
            error => Error::AfterCommit {
                error: Box::new(error),
                report: Box::new(report.clone()),
            },
        }
    }
}

impl IsOom for OomError {
    fn is_oom(&self) -> bool {
        true
    }
    fn oom_request(&self) -> Option<OomRequest> {
        Some(OomRequest {
            requested: self.requested,
            capacity: self.device_total,
            budget: false,
        })
    }
    fn oom_in_use(&self) -> Option<u64> {
        Some(self.allocated)
    }
}

impl IsOom for BudgetExceeded {
    fn is_oom(&self) -> bool {
        true
    }
    fn is_budget_exceeded(&self) -> bool {
        true
    }
    fn oom_request(&self) -> Option<OomRequest> {
        Some(OomRequest {
            requested: self.requested,
            capacity: self.limit,
            budget: true,
        })
    }
    fn oom_in_use(&self) -> Option<u64> {
        Some(self.in_use)
    }
}

/// An `io::Error` is an out-of-memory when the error it wraps is one (its `get_ref`, then that
/// error's `source()` chain).
impl IsOom for std::io::Error {
    fn is_oom(&self) -> bool {
        chain_is_oom(self)
    }
    fn is_budget_exceeded(&self) -> bool {
        chain_is_budget(self)
    }
    fn oom_request(&self) -> Option<OomRequest> {
        chain_oom_request(self)
    }
    fn oom_in_use(&self) -> Option<u64> {
        chain_oom_in_use(self)
    }
    fn with_retry_report(self, report: &RetryReport) -> Self {
        std::io::Error::new(
            self.kind(),
            ReportedIo {
                error: self,
                report: Box::new(report.clone()),
            },
        )
    }
    fn after_commit(self, report: &RetryReport) -> Self {
        if self.get_ref().is_some_and(|e| e.is::<AfterCommitIo>()) {
            return self;
        }
        std::io::Error::other(AfterCommitIo {
            error: self,
            mark: AfterCommit {
                report: Box::new(report.clone()),
            },
        })
    }
}

/// An `io::Error` with the report of the retried step that gave up (see
/// [`IsOom::with_retry_report`]); its source is the original error.
#[derive(Debug)]
struct ReportedIo {
    error: std::io::Error,
    report: Box<RetryReport>,
}

impl std::fmt::Display for ReportedIo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}\n{}", self.error, self.report)
    }
}

impl StdError for ReportedIo {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        Some(&self.error)
    }
}

#[cfg(feature = "anyhow")]
impl IsOom for anyhow::Error {
    // anyhow's contexts are not in the `source()` chain as their own types: an `AfterCommit`
    // context is found by downcasting.
    fn is_oom(&self) -> bool {
        self.downcast_ref::<AfterCommit>().is_none() && chain_is_oom(self.as_ref())
    }
    fn is_budget_exceeded(&self) -> bool {
        self.downcast_ref::<AfterCommit>().is_none() && chain_is_budget(self.as_ref())
    }
    fn oom_request(&self) -> Option<OomRequest> {
        chain_oom_request(self.as_ref())
    }
    fn oom_in_use(&self) -> Option<u64> {
        chain_oom_in_use(self.as_ref())
    }
    fn with_retry_report(self, report: &RetryReport) -> Self {
        if self.downcast_ref::<AfterCommit>().is_some() {
            return self;
        }
        self.context(report.clone())
    }
    fn after_commit(self, report: &RetryReport) -> Self {
        if self.downcast_ref::<AfterCommit>().is_some() {
            return self;
        }
        self.context(AfterCommit {
            report: Box::new(report.clone()),
        })
    }
}

impl IsOom for BackendError {
    fn is_oom(&self) -> bool {
        BackendError::is_oom(self)
    }
}

#[cfg(feature = "cuda")]
impl IsOom for cudarc::driver::result::DriverError {
    fn is_oom(&self) -> bool {
        self.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY
    }
}

#[cfg(feature = "cuda")]
impl IsOom for cudarc::cublas::result::CublasError {
    fn is_oom(&self) -> bool {
        self.0 == cudarc::cublas::sys::cublasStatus_t::CUBLAS_STATUS_ALLOC_FAILED
    }
}

impl<T: IsOom + ?Sized> IsOom for &T {
    fn is_oom(&self) -> bool {
        (**self).is_oom()
    }
    fn is_budget_exceeded(&self) -> bool {
        (**self).is_budget_exceeded()
    }
    fn oom_request(&self) -> Option<OomRequest> {
        (**self).oom_request()
    }
    fn oom_in_use(&self) -> Option<u64> {
        (**self).oom_in_use()
    }
}

impl<T: IsOom + ?Sized> IsOom for Box<T> {
    fn is_oom(&self) -> bool {
        (**self).is_oom()
    }
    fn is_budget_exceeded(&self) -> bool {
        (**self).is_budget_exceeded()
    }
    fn oom_request(&self) -> Option<OomRequest> {
        (**self).oom_request()
    }
    fn oom_in_use(&self) -> Option<u64> {
        (**self).oom_in_use()
    }
}

impl<T: IsOom + ?Sized> IsOom for std::sync::Arc<T> {
    fn is_oom(&self) -> bool {
        (**self).is_oom()
    }
    fn is_budget_exceeded(&self) -> bool {
        (**self).is_budget_exceeded()
    }
    fn oom_request(&self) -> Option<OomRequest> {
        (**self).oom_request()
    }
    fn oom_in_use(&self) -> Option<u64> {
        (**self).oom_in_use()
    }
}

macro_rules! dyn_is_oom {
    ($($t:ty),*) => {$(
        impl IsOom for $t {
            fn is_oom(&self) -> bool {
                chain_is_oom(self)
            }
            fn is_budget_exceeded(&self) -> bool {
                chain_is_budget(self)
            }
            fn oom_request(&self) -> Option<OomRequest> {
                chain_oom_request(self)
            }
            fn oom_in_use(&self) -> Option<u64> {
                chain_oom_in_use(self)
            }
        }
    )*};
}
dyn_is_oom!(
    dyn StdError + 'static,
    dyn StdError + Send + 'static,
    dyn StdError + Send + Sync + 'static
);

/// Whether `err` or any error in its `source()` chain is a known out-of-memory error.
///
/// Known types: oomguard's [`Error`], [`OomError`], [`BudgetExceeded`], [`BackendError`], and with
/// the `cuda` feature cudarc's `DriverError` and `CublasError`. Errors of other types are looked
/// through, not guessed at: their messages are never read.
///
/// ```
/// use oomguard_runtime::retry::advanced::chain_is_oom;
/// use oomguard_runtime::{Device, ByteSize};
///
/// #[derive(Debug)]
/// struct Wrapper(oomguard_runtime::Error);
/// impl std::fmt::Display for Wrapper {
///     fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result { f.write_str("layer 3 failed") }
/// }
/// impl std::error::Error for Wrapper {
///     fn source(&self) -> Option<&(dyn std::error::Error + 'static)> { Some(&self.0) }
/// }
///
/// let dev = Device::sim(ByteSize::mib(1));
/// let e = Wrapper(dev.alloc::<u8>(2 << 20).unwrap_err());
/// assert!(chain_is_oom(&e));
/// ```
pub fn chain_is_oom(err: &(dyn StdError + 'static)) -> bool {
    chain_any(err, known_is_oom)
}

/// Whether `err` or any error in its `source()` chain is a memory budget's out-of-memory.
pub(super) fn chain_is_budget(err: &(dyn StdError + 'static)) -> bool {
    chain_any(err, |e| {
        e.is::<BudgetExceeded>()
            || e.downcast_ref::<Error>()
                .is_some_and(|e| e.is_budget_exceeded())
    })
}

/// The failed request and its capacity ([`IsOom::oom_request`]) of the first oomguard
/// out-of-memory in `err`'s `source()` chain.
pub(super) fn chain_oom_request(err: &(dyn StdError + 'static)) -> Option<OomRequest> {
    chain_oom_figure(err, |e| e.oom_request())
}

/// The bytes in use when it failed ([`IsOom::oom_in_use`]) of the first oomguard
/// out-of-memory in `err`'s `source()` chain.
pub(super) fn chain_oom_in_use(err: &(dyn StdError + 'static)) -> Option<u64> {
    chain_oom_figure(err, |e| e.oom_in_use())
}

/// `figure` of the first oomguard out-of-memory (an [`Error`]'s, an [`OomError`], a
/// [`BudgetExceeded`]) in `err`'s `source()` chain that has it.
fn chain_oom_figure<T>(
    err: &(dyn StdError + 'static),
    figure: impl Fn(&dyn IsOom) -> Option<T>,
) -> Option<T> {
    chain_find(err, |e| {
        if let Some(e) = e.downcast_ref::<Error>() {
            return match e {
                Error::Oom(_) | Error::BudgetExceeded(_) => figure(e),
                _ => None,
            };
        }
        if let Some(e) = e.downcast_ref::<OomError>() {
            return figure(e);
        }
        e.downcast_ref::<BudgetExceeded>().and_then(|e| figure(e))
    })
}

/// Walks the chain: each error, then the error an `io::Error` wraps (its `source()` skips it),
/// then `source()`.
fn chain_any(
    err: &(dyn StdError + 'static),
    pred: impl Fn(&(dyn StdError + 'static)) -> bool,
) -> bool {
    chain_find(err, |e| pred(e).then_some(())).is_some()
}

/// [`chain_any`]'s walk, returning what `find` returns for the first error it answers.
fn chain_find<T>(
    err: &(dyn StdError + 'static),
    find: impl Fn(&(dyn StdError + 'static)) -> Option<T>,
) -> Option<T> {
    let mut cur = Some(err);
    // Bounded, in case a source chain loops.
    for _ in 0..64 {
        let e = cur?;
        if is_after_commit(e) {
            // an update was applied: nothing below makes it retryable
            return None;
        }
        if let Some(found) = find(e) {
            return Some(found);
        }
        cur = match e
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
        {
            Some(inner) => Some(inner as &(dyn StdError + 'static)),
            None => e.source(),
        };
    }
    None
}

/// Whether `e` is the mark of an error after a commit ([`IsOom::after_commit`]).
fn is_after_commit(e: &(dyn StdError + 'static)) -> bool {
    e.is::<AfterCommit>()
        || e.is::<AfterCommitIo>()
        || e.is::<UpdateApplied>()
        || matches!(e.downcast_ref::<Error>(), Some(Error::AfterCommit { .. }))
}

fn known_is_oom(e: &(dyn StdError + 'static)) -> bool {
    if let Some(e) = e.downcast_ref::<Error>() {
        return IsOom::is_oom(e);
    }
    if e.is::<OomError>() || e.is::<BudgetExceeded>() {
        return true;
    }
    if let Some(e) = e.downcast_ref::<BackendError>() {
        return IsOom::is_oom(e);
    }
    #[cfg(feature = "cuda")]
    {
        if let Some(e) = e.downcast_ref::<cudarc::driver::result::DriverError>() {
            return IsOom::is_oom(e);
        }
        if let Some(e) = e.downcast_ref::<cudarc::cublas::result::CublasError>() {
            return IsOom::is_oom(e);
        }
    }
    false
}

#[cfg(test)]
mod tests;
