//! The error of oomguard-tch: tch's `TchError`, a libtorch out-of-memory seen as a panic, an
//! oomguard error, or a refusal of [`train_step`](crate::train_step) (a loss that is not one
//! value, variables without a gradient, variables the optimizer does not update).

use oomguard::retry::{libtorch_text_is_budget_exceeded, libtorch_text_oom_request};
use oomguard::IsOom;
use tch::TchError;

/// Why a tch call, a step or a [`catch_oom`](crate::catch_oom) closure failed.
///
/// It implements [`IsOom`], so `#[oom_retry]` works on functions returning
/// `Result<_, oomguard_tch::Error>`; `?` converts a `TchError` into it. (`TchError` implements
/// [`IsOom`] too, through oomguard's `tch` feature, which this crate turns on: a function that
/// returns `Result<_, TchError>` needs no conversion.)
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An error tch returned (an `f_*` method). An out-of-memory when it is
    /// `TchError::Torch(text)` and `text` starts with one of libtorch's out-of-memory messages
    /// ([`oomguard::retry::libtorch_text_is_oom`]).
    #[error("{0}")]
    Torch(#[from] TchError),
    /// A libtorch out-of-memory that surfaced as a panic of a plain tch method (which unwraps
    /// its `f_*` twin); always an out-of-memory.
    #[error("libtorch ran out of memory (seen as a panic of a tch method): {message}")]
    OomPanic {
        /// libtorch's text (the `TchError::Torch` the method unwrapped).
        message: String,
    },
    /// An oomguard error (e.g. a simulated device's out-of-memory in a CPU test of a step, or a
    /// memory source's error); an out-of-memory when it is one.
    #[error("{0}")]
    Oomguard(#[from] oomguard::Error),
    /// The chunk's loss is not one value (give the chunk's per-row mean loss, e.g.
    /// `loss.mean(Kind::Float)`), or it is NaN or infinite; not retried, no update.
    #[error("{0}")]
    Loss(String),
    /// Variables of the `VarStore` that require a gradient got none from the backward passes of
    /// a step (the loss does not depend on them, or a `detach()` / `no_grad` cut the graph: a
    /// loss that requires no gradient at all names every one); the optimizer did not step.
    /// Freeze one on purpose with `set_requires_grad(false)`; not retried.
    #[error(
        "{}: the loss does not depend on them, or a `detach()`, `no_grad` or an integer cast cut \
         the graph; freeze a variable on purpose with `set_requires_grad(false)`. The optimizer \
         did not step",
        oomguard::train::missing_gradients(.params, *.trained)
    )]
    NoGradient {
        /// Their names in the `VarStore` (`"layer1.weight"`), sorted.
        params: Vec<String>,
        /// The variables that require a gradient, these included.
        trained: usize,
    },
    /// Variables of the `VarStore` that require a gradient are not among the optimizer's (it was
    /// built from another `VarStore`, or before they were made, or they were made not trainable,
    /// `zeros_no_train`, and given `requires_grad` by hand: tch's optimizer holds the store's
    /// trainable variables only): their gradients would never be applied; not retried.
    #[error(
        "{} variable(s) of the VarStore require a gradient but are not the optimizer's ({}): \
         their gradients would never be applied. Build the optimizer from the VarStore given to \
         train_step after making every variable it trains, as a trainable one (a variable made \
         with `*_no_train` and given `requires_grad` by hand is never the optimizer's)",
        .params.len(),
        oomguard::train::name_list(.params)
    )]
    NotOptimized {
        /// Their names in the `VarStore`, sorted.
        params: Vec<String>,
    },
    /// No variable of the `VarStore` requires a gradient (it has none, or all are frozen, e.g.
    /// `VarStore::freeze`): the optimizer's step would change nothing. Refused before the first
    /// chunk; not retried.
    #[error(
        "no variable of the VarStore requires a gradient ({variables} variable(s), all frozen or \
         none): the optimizer's step would change nothing. Train at least one (unfreeze with \
         `VarStore::unfreeze` or `set_requires_grad(true)`)"
    )]
    NothingToTrain {
        /// The store's variables (all of them frozen), 0 for an empty store.
        variables: usize,
    },
    /// The batch [`find_max_batch_train`](crate::find_max_batch_train)'s `make_batch(rows)`
    /// gave is not `rows` rows (its tensors disagree on dimension 0, or have another count);
    /// not retried.
    #[error("{0}")]
    Batch(String),
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
            Error::Loss(_)
            | Error::NoGradient { .. }
            | Error::NothingToTrain { .. }
            | Error::NotOptimized { .. }
            | Error::Batch(_) => false,
        }
    }
    /// A budget's out-of-memory: oomguard's own, or a refusal of oomguard's allocator under
    /// libtorch ([`crate::allocator`]) against a budget, as tch returned it or a plain method
    /// panicked with it ([`oomguard::retry::libtorch_text_is_budget_exceeded`]).
    fn is_budget_exceeded(&self) -> bool {
        match self {
            Error::Torch(e) => IsOom::is_budget_exceeded(e),
            Error::OomPanic { message } => libtorch_text_is_budget_exceeded(message),
            Error::Oomguard(e) => IsOom::is_budget_exceeded(e),
            _ => false,
        }
    }
    /// The failed request against the whole capacity, for oomguard's out-of-memory, and for a
    /// refusal of oomguard's allocator under libtorch, which writes both in its text
    /// ([`oomguard::retry::libtorch_text_oom_request`]); libtorch's own texts are not parsed
    /// for it.
    fn oom_request(&self) -> Option<oomguard::retry::OomRequest> {
        match self {
            Error::Torch(e) => IsOom::oom_request(e),
            Error::OomPanic { message } => libtorch_text_oom_request(message),
            Error::Oomguard(e) => IsOom::oom_request(e),
            _ => None,
        }
    }
}
