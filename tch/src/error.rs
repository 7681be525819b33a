//! The error of oomguard-tch: tch's `TchError`, a libtorch out-of-memory seen as a panic, or an
//! oomguard error.

use std::fmt;

use oomguard::IsOom;
use tch::TchError;

/// Why a tch call, a step or a [`catch_oom`](crate::catch_oom) closure failed.
///
/// It implements [`IsOom`], so `#[oom_retry]` works on functions returning
/// `Result<_, oomguard_tch::Error>`; `?` converts a `TchError` into it. (`TchError` implements
/// [`IsOom`] too, through oomguard's `tch` feature, which this crate turns on: a function that
/// returns `Result<_, TchError>` needs no conversion.)
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// An error tch returned (an `f_*` method). An out-of-memory when it is
    /// `TchError::Torch(text)` and `text` starts with one of libtorch's out-of-memory messages
    /// ([`oomguard::retry::libtorch_text_is_oom`]).
    Torch(TchError),
    /// A libtorch out-of-memory that surfaced as a panic of a plain tch method (which unwraps
    /// its `f_*` twin); always an out-of-memory.
    OomPanic {
        /// libtorch's text (the `TchError::Torch` the method unwrapped).
        message: String,
    },
    /// An oomguard error (e.g. a simulated device's out-of-memory in a CPU test of a step, or a
    /// memory source's error); an out-of-memory when it is one.
    Oomguard(oomguard::Error),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Torch(e) => write!(f, "{e}"),
            Error::OomPanic { message } => write!(
                f,
                "libtorch ran out of memory (seen as a panic of a tch method): {message}"
            ),
            Error::Oomguard(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Torch(e) => Some(e),
            Error::Oomguard(e) => Some(e),
            Error::OomPanic { .. } => None,
        }
    }
}

impl From<TchError> for Error {
    fn from(e: TchError) -> Self {
        Error::Torch(e)
    }
}

impl From<oomguard::Error> for Error {
    fn from(e: oomguard::Error) -> Self {
        Error::Oomguard(e)
    }
}

/// Whether a `TchError` is libtorch's out-of-memory: `TchError::Torch(text)` whose text starts
/// with one of libtorch 2.11's out-of-memory messages; every other variant is not. The same as
/// [`IsOom::is_oom`] on the error.
pub fn tch_error_is_oom(e: &TchError) -> bool {
    IsOom::is_oom(e)
}

impl IsOom for Error {
    fn is_oom(&self) -> bool {
        match self {
            Error::Torch(e) => tch_error_is_oom(e),
            Error::OomPanic { .. } => true,
            Error::Oomguard(e) => IsOom::is_oom(e),
        }
    }
    fn is_budget_exceeded(&self) -> bool {
        matches!(self, Error::Oomguard(e) if IsOom::is_budget_exceeded(e))
    }
}
