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
//! offline and ran on the H100 (issue 25).

use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::{GradientsAccumulator, GradientsParams, Optimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, FloatDType, Tensor};

pub use burn::tensor::backend::ExecutionError;

/// The message `Tensor::into_data` panics with (burn-tensor 0.21.0,
/// `src/tensor/api/base.rs`: `try_into_data().expect(..)`), followed by `": "` and the
/// `ExecutionError`'s display.
pub const INTO_DATA_EXPECT: &str =
    "Error while reading data: use `try_into_data` instead to catch the error at runtime";

/// The message of `Result::unwrap` on an error, followed by the error's `Debug` (cubecl's
/// device thread panics with it when a reservation fails in `initialize_memory`, and
/// `ComputeClient::empty`/`create` do on the caller's thread).
pub const UNWRAP: &str = "called `Result::unwrap()` on an `Err` value: ";

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

/// Initialises every lazily initialised float parameter of `model` (burn creates a parameter's
/// tensor on its first use) and waits for the device(s): a parameter whose initialisation runs
/// out of memory inside a step stays broken for good (its tensor is never allocated; on the
/// H100 a fresh GPT's first step at twice its maximum batch then trained on NaN), so it must
/// happen before any attempt, where an out-of-memory is an error of its own.
pub(crate) fn materialize<B: Backend, M: burn::module::Module<B>>(
    model: &M,
) -> Result<(), ExecutionError> {
    /// Counts the parameters it initialised.
    struct Init(usize);
    impl<B: Backend> ModuleVisitor<B> for Init {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            if !p.is_initialized() {
                let _ = p.val();
                self.0 += 1;
            }
        }
    }
    let mut init = Init(0);
    model.visit(&mut init);
    // Only a step that initialised something waits for the device (every later step finds
    // them all initialised and adds no synchronisation).
    if init.0 > 0 {
        for d in model.devices() {
            B::sync(&d)?;
        }
    }
    Ok(())
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
