//! The error of oomguard-burn's steps: burn's `ExecutionError`, a cubecl out-of-memory seen as a
//! panic, or a refusal (rows that do not match the batch, a loss that is not one value,
//! parameters without a gradient, a model with nothing to train, parameters burn can no longer
//! initialise).

use oomguard::IsOom;

use crate::compat::ExecutionError;

/// Why a micro-batch, a step or a [`catch_oom`](crate::catch_oom) closure failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An error burn returned (`try_into_data`, `Backend::sync`, ...). An out-of-memory when it
    /// holds one of cubecl's out-of-memory errors ([`IsOom`] for `ExecutionError`, feature
    /// `burn` of oomguard).
    #[error("{0}")]
    Execution(#[from] ExecutionError),
    /// A cubecl out-of-memory that surfaced as a panic (`Tensor::into_data`, a reservation that
    /// failed on the device thread); always an out-of-memory.
    #[error(
        "cubecl ran out of device memory (seen as a panic): {}",
        .message.lines().next().unwrap_or("")
    )]
    DevicePanic {
        /// The panic's message (the device thread's when the caller only saw `CallError`).
        message: String,
    },
    /// An oomguard error (e.g. a simulated device's out-of-memory in a CPU test of a step, or a
    /// memory source's error); an out-of-memory when it is one.
    #[error("{0}")]
    Oomguard(#[from] oomguard::Error),
    /// The batch's tensors do not have the rows the plan splits (e.g. a tensor of 16 rows in a
    /// step of batch 8), or the chunks backpropagated do not cover the batch's rows exactly once
    /// (a chunk twice, chunks of two plans, a chunk left out); not retried.
    #[error("{0}")]
    Rows(String),
    /// The chunk's loss is not one value (the chunk's mean loss, e.g. `loss.mean()`), or it is
    /// NaN or infinite; not retried, no update.
    #[error("{0}")]
    Loss(String),
    /// Float parameters that require a gradient got none from the backward pass (a module that
    /// cuts the graph, or a parameter the loss does not use); the optimizer did not step.
    #[error(
        "{} parameter(s) requiring a gradient got none from the backward pass: {}; a module cut \
         the graph or the loss does not use them (freeze unused ones: `Module::no_grad()` for \
         a module, `Param::set_require_grad(false)` for one parameter); the optimizer did not \
         step",
        .params.len(),
        oomguard::train::name_list(.params)
    )]
    NoGradient {
        /// Their paths in the module (`"blocks.0.attn.query.weight"`).
        params: Vec<String>,
    },
    /// No float parameter of the model requires a gradient (it has none, or every one is frozen:
    /// `Module::no_grad()`, `Param::set_require_grad(false)`): the optimizer's step would change
    /// nothing. Refused before the first chunk; not retried.
    #[error(
        "no float parameter of the model requires a gradient ({params} parameter(s), all frozen \
         or none): the optimizer's step would change nothing. Train at least one \
         (`Param::set_require_grad(true)`, or a module built without `Module::no_grad()`)"
    )]
    NothingToTrain {
        /// The model's float parameters (all of them frozen), 0 for a model with none.
        params: usize,
    },
    /// Lazy parameters whose initialisation failed earlier outside
    /// [`train_step`](crate::train_step) (an out-of-memory panic in burn's `Param::val`, e.g.
    /// during a forward inside `find_max_batch`): burn 0.21 lost their initialiser and poisoned
    /// their lock, so they can never be created; not retried. Build the model again (or load a
    /// record into a new one).
    #[error(
        "{} lazy parameter(s) cannot be initialised any more: {}; an earlier initialisation \
         outside train_step ran out of memory and burn lost their initialiser; build the model \
         again (or load a record into a new one)",
        .params.len(),
        .params.join(", ")
    )]
    BrokenParameters {
        /// Their paths in the module (`"fc1.weight"`).
        params: Vec<String>,
    },
}

impl IsOom for Error {
    fn is_budget_exceeded(&self) -> bool {
        matches!(self, Error::Oomguard(e) if IsOom::is_budget_exceeded(e))
    }
    /// The failed request against the whole capacity, for oomguard's out-of-memory (cubecl's
    /// do not say what was requested).
    fn oom_request(&self) -> Option<oomguard::retry::OomRequest> {
        match self {
            Error::Oomguard(e) => IsOom::oom_request(e),
            _ => None,
        }
    }
    fn oom_in_use(&self) -> Option<u64> {
        match self {
            Error::Oomguard(e) => IsOom::oom_in_use(e),
            _ => None,
        }
    }
    fn is_oom(&self) -> bool {
        match self {
            Error::Execution(e) => e.is_oom(),
            Error::DevicePanic { .. } => true,
            Error::Oomguard(e) => IsOom::is_oom(e),
            Error::Rows(_)
            | Error::Loss(_)
            | Error::NoGradient { .. }
            | Error::NothingToTrain { .. }
            | Error::BrokenParameters { .. } => false,
        }
    }
}
