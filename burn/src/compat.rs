//! Everything that depends on the burn / cubecl version: burn 0.21.0 over cubecl 0.10.0.
//!
//! A move to burn 0.22+ changes this file (and the text forms of cubecl's errors in the
//! runtime's `retry/classify_burn.rs`, feature `burn`), and nothing else:
//! - the panic message `Tensor::into_data` raises ([`INTO_DATA_EXPECT`]);
//! - how a backward pass becomes per-parameter gradients and how they are summed
//!   (`GradientsParams::from_grads`, `GradientsAccumulator`);
//! - how a parameter's gradient is looked up and whether it requires one;
//! - how the optimizer steps (`Optimizer::step(lr, module, grads) -> module`);
//! - the cubecl client calls of the CUDA memory source (feature `cuda`).
//!
//! Why 0.21.0: burn 0.22.1's `cuda` feature needs cubecl-llvm, whose build script downloads an
//! LLVM bundle, so it cannot be built offline; 0.21.0 (cubecl-cuda 0.10.0, cudarc 0.19.10) builds
//! offline and ran on the H100 (docs/GPU.md, burn's runs).

use std::panic::{catch_unwind, AssertUnwindSafe};

use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId, Parameter};
use burn::optim::{GradientsAccumulator, GradientsParams, Optimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Bool, DType, FloatDType, Int, Tensor};

use crate::Error;

pub use burn::tensor::backend::ExecutionError;

/// The message `Tensor::into_data` panics with (burn-tensor 0.21.0,
/// `src/tensor/api/base.rs`: `try_into_data().expect(..)`), followed by `": "` and the
/// `ExecutionError`'s display.
pub const INTO_DATA_EXPECT: &str =
    "Error while reading data: use `try_into_data` instead to catch the error at runtime";

// cubecl's device thread panics with `UNWRAP` when a reservation fails in `initialize_memory`,
// and `ComputeClient::empty`/`create` do on the caller's thread.
pub use oomguard::retry::advanced::UNWRAP;

/// The `Debug` of cubecl-common's `CallError`: the caller's panic when the task it waited for
/// panicked on the device thread (`ComputeClient::read` and others unwrap it).
pub const CALL_ERROR: &str = "CallError";

/// `loss × weight` in at least f32 (a half-precision loss is cast to f32 first, so the weight
/// and the backward seed are not rounded to 8 or 11 bits).
pub(crate) fn weighted_loss<B: Backend>(loss: Tensor<B, 1>, weight: f64) -> Tensor<B, 1> {
    let loss = match loss.dtype() {
        DType::F16 | DType::BF16 => loss.cast(FloatDType::F32),
        _ => loss,
    };
    loss.mul_scalar(weight)
}

/// Initialises every lazily initialised parameter of `model` (burn creates a parameter's tensor
/// on its first use) and waits for the device(s): a parameter whose initialisation runs out of
/// memory inside a step stays broken for good (its tensor is never allocated; on the H100 a
/// fresh GPT's first step at twice its maximum batch then trained on NaN), so it must happen
/// before any attempt, where an out-of-memory is an error of its own.
///
/// burn 0.21's `Param::val` takes the initialiser out of the parameter and holds the
/// parameter's lock while it runs, so an out-of-memory panic there loses the initialiser and
/// poisons the lock: every later use of that parameter panics. The initialisers therefore run
/// on a clone of the model (a clone of a lazy `Param` carries its own copy of the initialiser
/// and its own lock, and keeps the parameter's id), which replaces `*model` only once every
/// initialiser and the sync succeeded: after a failure `*model` is as it was, still lazy, and a
/// later call initialises it. A parameter that an earlier use outside `train_step` broke this
/// way is refused by name ([`Error::BrokenParameters`]).
pub(crate) fn materialize<B: Backend, M: burn::module::Module<B>>(
    model: &mut M,
) -> Result<(), Error> {
    let mut lazy = Lazy::default();
    model.visit(&mut lazy);
    if !lazy.broken.is_empty() {
        return Err(Error::BrokenParameters {
            params: lazy.broken,
        });
    }
    // Every later step finds them all initialised: no clone, no synchronisation.
    if lazy.count == 0 {
        return Ok(());
    }
    let trial = model.clone();
    trial.visit(&mut Init);
    for d in trial.devices() {
        B::sync(&d)?;
    }
    *model = trial;
    Ok(())
}

/// Counts the lazy parameters without initialising them, and names those whose initialiser is
/// gone (probed with `lazy_device`, which reads the parameter's lock: it panics when the lock is
/// poisoned, and falls through to the missing initialiser when that was taken).
#[derive(Default)]
struct Lazy {
    count: usize,
    path: Vec<String>,
    broken: Vec<String>,
}

impl Lazy {
    fn probe<P: Parameter>(&mut self, p: &Param<P>) {
        if p.is_initialized() {
            return;
        }
        self.count += 1;
        if catch_unwind(AssertUnwindSafe(|| p.lazy_device())).is_err() {
            self.broken.push(self.path.join("."));
        }
    }
}

impl<B: Backend> ModuleVisitor<B> for Lazy {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }
    fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
        self.probe(p);
    }
    fn visit_int<const D: usize>(&mut self, p: &Param<Tensor<B, D, Int>>) {
        self.probe(p);
    }
    fn visit_bool<const D: usize>(&mut self, p: &Param<Tensor<B, D, Bool>>) {
        self.probe(p);
    }
}

/// Initialises every lazy parameter it visits.
struct Init;

fn init<P: Parameter>(p: &Param<P>) {
    if !p.is_initialized() {
        let _ = p.val();
    }
}

impl<B: Backend> ModuleVisitor<B> for Init {
    fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
        init(p);
    }
    fn visit_int<const D: usize>(&mut self, p: &Param<Tensor<B, D, Int>>) {
        init(p);
    }
    fn visit_bool<const D: usize>(&mut self, p: &Param<Tensor<B, D, Bool>>) {
        init(p);
    }
}

/// The first element of a tensor as `f64`, read from the device (the read that reveals an
/// error of the work that produced it).
pub(crate) fn read_f64<B: Backend>(t: Tensor<B, 1>) -> Result<f64, ExecutionError> {
    let data = t.try_into_data()?;
    let v = data
        .iter::<f64>()
        .next()
        .ok_or_else(|| ExecutionError::WithContext {
            reason: "oomguard-burn: the loss tensor is empty".into(),
        })?;
    Ok(v)
}

/// Waits for the device's queued work and returns its stream's errors (cubecl 0.10's `sync`
/// flushes them: an out-of-memory of a backward kernel surfaces here).
pub(crate) fn sync<B: Backend>(device: &B::Device) -> Result<(), ExecutionError> {
    B::sync(device)
}

/// The gradients of a backward pass, per parameter of `model`.
pub(crate) fn backward<B: AutodiffBackend, M: AutodiffModule<B>>(
    weighted: &Tensor<B, 1>,
    model: &M,
) -> GradientsParams {
    GradientsParams::from_grads(weighted.backward(), model)
}

/// Sums per-parameter gradients (burn's `GradientsAccumulator`).
pub(crate) struct Summed<M>(GradientsAccumulator<M>);

impl<M> Summed<M> {
    pub(crate) fn new() -> Self {
        Self(GradientsAccumulator::new())
    }
    pub(crate) fn add<B: AutodiffBackend>(&mut self, model: &M, grads: GradientsParams)
    where
        M: AutodiffModule<B>,
    {
        self.0.accumulate(model, grads)
    }
    pub(crate) fn take(mut self) -> GradientsParams {
        self.0.grads()
    }
}

/// Applies `grads` to a copy of `model` and returns the updated model.
pub(crate) fn optimizer_step<B, M, O>(optim: &mut O, lr: f64, model: M, grads: GradientsParams) -> M
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    O: Optimizer<M, B>,
{
    optim.step(lr, model, grads)
}

/// The paths (`"blocks.3.attn.query.weight"`) of the float parameters of `model` that require a
/// gradient and have none in `grads`.
/// What `model`'s float parameters are: how many, how many require a gradient, and those
/// ones' elements (what one set of its gradients holds).
pub(crate) fn trainable<B: AutodiffBackend, M: AutodiffModule<B>>(model: &M) -> Trainable {
    let mut v = Trainable::default();
    model.visit(&mut v);
    v
}

/// See [`trainable`].
#[derive(Default)]
pub(crate) struct Trainable {
    pub(crate) floats: usize,
    pub(crate) trainable: usize,
    /// Elements of the trainable ones.
    pub(crate) elements: usize,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Trainable {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        self.floats += 1;
        let value = param.val();
        if value.is_require_grad() {
            self.trainable += 1;
            self.elements += value.shape().num_elements();
        }
    }
}

pub(crate) fn missing_gradients<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: &GradientsParams,
) -> Vec<String> {
    let mut v = MissingGrads::<'_> {
        grads,
        path: Vec::new(),
        missing: Vec::new(),
    };
    model.visit(&mut v);
    v.missing
}

struct MissingGrads<'a> {
    grads: &'a GradientsParams,
    path: Vec<String>,
    missing: Vec<String>,
}

impl MissingGrads<'_> {
    fn check<B: AutodiffBackend, const D: usize>(&mut self, id: ParamId, requires: bool) {
        if requires && self.grads.get::<B::InnerBackend, D>(id).is_none() {
            self.missing.push(self.path.join("."));
        }
    }
}

impl<B: AutodiffBackend> ModuleVisitor<B> for MissingGrads<'_> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let requires = param.val().is_require_grad();
        self.check::<B, D>(param.id, requires);
    }
}
