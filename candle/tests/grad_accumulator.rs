//! `GradAccumulator` and `train_step` refuse what would silently train the wrong thing: a
//! parameter that gets no gradient (a forward-only op cut the graph), a loss that is not a
//! scalar, chunks that miss rows; and weight half-precision losses exactly.

use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{Optimizer, VarBuilder, VarMap, SGD};
use oomguard::retry::{BatchPlan, RetryEngine};
use oomguard::ByteSize;
use oomguard_candle::{train_step, GradAccumulator, Params, TrainStepError};

/// A linear layer under candle-nn's `LayerNorm` module: the norm's forward is forward-only on a
/// contiguous input with a bias, so neither its own weights nor anything below get gradients.
struct Cut {
    varmap: VarMap,
    lin: candle_nn::Linear,
    ln: candle_nn::LayerNorm,
    head: candle_nn::Linear,
}

impl Cut {
    fn new() -> Self {
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        Self {
            lin: candle_nn::linear(4, 4, vb.pp("lin")).unwrap(),
            ln: candle_nn::layer_norm(4, 1e-5, vb.pp("ln")).unwrap(),
            head: candle_nn::linear(4, 1, vb.pp("head")).unwrap(),
            varmap,
        }
    }
    fn loss(&self, x: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
        let h = self.ln.forward(&self.lin.forward(x)?)?;
        (self.head.forward(&h)? - y)?.sqr()?.mean_all()
    }
}

fn batch(rows: usize) -> (Tensor, Tensor) {
    let x: Vec<f32> = (0..rows * 4)
        .map(|i| ((i * 37 % 101) as f32) / 50.0 - 1.0)
        .collect();
    let x = Tensor::from_vec(x, (rows, 4), &Device::Cpu).unwrap();
    let y = x.sum_keepdim(1).unwrap();
    (x, y)
}

#[test]
fn a_parameter_without_gradient_is_an_error_that_names_it() {
    let m = Cut::new();
    let (x, y) = batch(16);
    let plan = BatchPlan::whole(16).unwrap();
    let mut acc = GradAccumulator::new(&m.varmap);
    for c in plan.chunks() {
        acc.backward(&m.loss(&x, &y).unwrap(), &c).unwrap();
    }
    // On the old code these were skipped: only `head` trained.
    let msg = acc.into_grads().unwrap_err().to_string();
    assert!(msg.contains("no gradient reached 4 of the 6"), "{msg}");
    for name in [
        "`lin.weight` [4, 4]",
        "`lin.bias` [4]",
        "`ln.weight` [4]",
        "`ln.bias` [4]",
    ] {
        assert!(msg.contains(name), "{name} missing from: {msg}");
    }
    assert!(!msg.contains("head"), "{msg}");
    assert!(
        msg.contains("layer_norm_slow") && msg.contains("Params::freeze"),
        "{msg}"
    );
}

#[test]
fn train_step_fails_on_a_cut_graph_and_updates_nothing() {
    let m = Cut::new();
    let (x, y) = batch(16);
    let before: Vec<f32> = m.head.weight().flatten_all().unwrap().to_vec1().unwrap();
    let mut opt = SGD::new(m.varmap.all_vars(), 0.1).unwrap();
    let sim = oomguard::Device::sim(ByteSize::gib(1));
    let err = train_step(
        &RetryEngine::new(),
        &sim,
        &[&x, &y],
        &m.varmap,
        &mut opt,
        |_, r| m.loss(&r[0], &r[1]),
    )
    .unwrap_err();
    assert!(matches!(err, TrainStepError::Retry(_)), "{err}");
    assert!(err.to_string().contains("`ln.weight` [4] F32"), "{err}");
    let after: Vec<f32> = m.head.weight().flatten_all().unwrap().to_vec1().unwrap();
    assert_eq!(before, after, "no update after the error");
}

#[test]
fn frozen_parameters_are_the_explicit_opt_out_and_stay_unchanged() {
    let m = Cut::new();
    let (x, y) = batch(16);
    let frozen: Vec<Var> = {
        let data = m.varmap.data().lock().unwrap();
        [
            "lin.weight",
            "lin.bias",
            "ln.weight",
            "ln.bias",
            "head.bias",
        ]
        .iter()
        .map(|n| data[*n].clone())
        .collect()
    };
    let params = Params::from_varmap(&m.varmap).freeze(&frozen);
    assert_eq!(params.trained_vars().len(), 1);
    // The optimizer has every variable; `head.bias` does get a gradient, but is frozen.
    let mut opt = SGD::new(m.varmap.all_vars(), 0.1).unwrap();
    let snapshot =
        |v: &Var| -> Vec<f32> { v.as_tensor().flatten_all().unwrap().to_vec1().unwrap() };
    let before: Vec<Vec<f32>> = frozen.iter().map(snapshot).collect();
    let head_w = m
        .head
        .weight()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let sim = oomguard::Device::sim(ByteSize::gib(1));
    let done = train_step(
        &RetryEngine::new(),
        &sim,
        &[&x, &y],
        &params,
        &mut opt,
        |_, r| m.loss(&r[0], &r[1]),
    )
    .unwrap();
    assert_eq!(done.rows, 16);
    let after: Vec<Vec<f32>> = frozen.iter().map(snapshot).collect();
    assert_eq!(before, after, "frozen parameters are not updated");
    let head_after = m
        .head
        .weight()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    assert_ne!(head_w, head_after, "the trained one is");
}

#[test]
fn a_loss_that_is_not_a_scalar_is_refused() {
    let w = Var::ones(4, DType::F32, &Device::Cpu).unwrap();
    let (x, _) = batch(8);
    let plan = BatchPlan::whole(8).unwrap();
    let c = plan.chunk(0).unwrap();
    let mut acc = GradAccumulator::new(&w);
    // per-row losses, not their mean
    let per_row = x.broadcast_mul(w.as_tensor()).unwrap().sum(1).unwrap();
    let e = acc.backward(&per_row, &c).unwrap_err().to_string();
    assert!(e.contains("shape [8]") && e.contains("per-row mean"), "{e}");
    // one element of any rank is a scalar
    acc.backward(&per_row.mean_keepdim(0).unwrap(), &c).unwrap();
    assert_eq!(acc.rows(), 8);
}

/// A NaN or infinite loss was accumulated, and `train_step` then stepped every parameter to NaN
/// and returned `Ok` (found by a hostile pass of the glue): refused, naming the rows.
#[test]
fn a_loss_that_is_not_finite_is_refused() {
    let w = Var::ones(4, DType::F32, &Device::Cpu).unwrap();
    let (x, _) = batch(8);
    let loss = x.broadcast_mul(w.as_tensor()).unwrap().mean_all().unwrap();
    let plan = BatchPlan::new(8, 2).unwrap();
    for bad in [f64::NAN, f64::INFINITY] {
        let mut acc = GradAccumulator::new(&w);
        let c = plan.chunk(1).unwrap();
        let e = acc
            .backward(&(&loss * bad).unwrap(), &c)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("the loss of rows 4..8") && e.contains("not trained on"),
            "{e}"
        );
    }
}

/// An integer loss was accumulated by hand (`Ok`), and through `train_step` was refused as "no
/// gradient reached ..." pointing at forward-only ops (found by a hostile pass of the glue).
#[test]
fn a_loss_that_is_not_a_float_is_refused() {
    let w = Var::ones(4, DType::F32, &Device::Cpu).unwrap();
    let (x, _) = batch(8);
    let loss = x.broadcast_mul(w.as_tensor()).unwrap().mean_all().unwrap();
    let plan = BatchPlan::whole(8).unwrap();
    let mut acc = GradAccumulator::new(&w);
    let e = acc
        .backward(&loss.to_dtype(DType::U32).unwrap(), &plan.chunk(0).unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("is U32, not a float"), "{e}");
}

#[test]
fn chunks_that_miss_rows_or_mix_batches_are_errors() {
    let w = Var::ones(4, DType::F32, &Device::Cpu).unwrap();
    let (x, _) = batch(8);
    let loss = x.broadcast_mul(w.as_tensor()).unwrap().mean_all().unwrap();
    let plan = BatchPlan::new(8, 2).unwrap();
    let mut acc = GradAccumulator::new(&w);
    acc.backward(&loss, &plan.chunk(0).unwrap()).unwrap();
    let e = acc.into_grads().unwrap_err().to_string();
    assert!(e.contains("only 4 of the batch's 8 rows"), "{e}");
    let mut acc = GradAccumulator::new(&w);
    acc.backward(&loss, &plan.chunk(0).unwrap()).unwrap();
    let other = BatchPlan::new(6, 2).unwrap();
    let e = acc
        .backward(&loss, &other.chunk(1).unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("batch of 6 rows") && e.contains("batch of 8 rows"),
        "{e}"
    );
}

/// The same chunk backpropagated twice covers 8 rows of a batch of 8, but rows 4..8 never ran:
/// refused before its second backward. Before: accepted, and `into_grads` passed (it counted
/// rows).
#[test]
fn a_chunk_backpropagated_twice_is_refused() {
    let w = Var::ones(4, DType::F32, &Device::Cpu).unwrap();
    let (x, _) = batch(8);
    let loss = x.broadcast_mul(w.as_tensor()).unwrap().mean_all().unwrap();
    let plan = BatchPlan::new(8, 2).unwrap();
    let mut acc = GradAccumulator::new(&w);
    acc.backward(&loss, &plan.chunk(0).unwrap()).unwrap();
    let e = acc
        .backward(&loss, &plan.chunk(0).unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("rows 0..4") && e.contains("exactly once"), "{e}");
    assert_eq!(acc.rows(), 4);
    let e = acc.into_grads().unwrap_err().to_string();
    assert!(e.contains("rows 4..8 never ran"), "{e}");
}

/// 24 rows in 3 chunks of 8 (weights 1/3, which bf16 rounds to 0.333984375), every chunk's
/// mean loss exactly 1 in bf16: any error comes from how the weights are applied.
fn bf16_chunks(var_dtype: DType) -> (f64, f64, DType) {
    let w = Var::ones(1, var_dtype, &Device::Cpu).unwrap();
    let x = Tensor::ones((24, 1), DType::BF16, &Device::Cpu).unwrap();
    let plan = BatchPlan::new(24, 3).unwrap();
    let mut acc = GradAccumulator::new(&w);
    for c in plan.chunks() {
        let rows = oomguard_candle::chunk_rows(&x, &c).unwrap();
        let loss = rows
            .broadcast_mul(&w.as_tensor().to_dtype(DType::BF16).unwrap())
            .unwrap()
            .mean_all()
            .unwrap();
        assert_eq!(loss.dtype(), DType::BF16);
        acc.backward(&loss, &c).unwrap();
    }
    let loss = acc.loss();
    let grads = acc.into_grads().unwrap();
    let g = grads.get(w.as_tensor()).unwrap();
    let dtype = g.dtype();
    let g = g.to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap()[0];
    (loss, g, dtype)
}

#[test]
fn a_bf16_loss_is_weighted_in_f32_or_better() {
    // The exact loss and gradient of the batch are both 1. The old code multiplied the bf16
    // loss by the weight in bf16: 3 × 0.333984375 = 1.00195 (2e-3 off) for both.
    let (loss, g, dtype) = bf16_chunks(DType::F32);
    assert_eq!(dtype, DType::F32);
    assert!((loss - 1.0).abs() <= 1e-3, "loss {loss}");
    assert!((g - 1.0).abs() <= 1e-3, "gradient {g}");
    // A bf16 parameter gets a bf16 gradient (what its optimizer needs).
    let (loss, g, dtype) = bf16_chunks(DType::BF16);
    assert_eq!(dtype, DType::BF16);
    assert!((loss - 1.0).abs() <= 1e-3, "loss {loss}");
    assert!((g - 1.0).abs() <= 1e-3, "gradient {g}");
    // and SGD accepts it
    let w = Var::ones(1, DType::BF16, &Device::Cpu).unwrap();
    let mut sgd = SGD::new(vec![w.clone()], 0.5).unwrap();
    let mut acc = GradAccumulator::new(&w);
    let plan = BatchPlan::new(3, 3).unwrap();
    for c in plan.chunks() {
        acc.backward(&w.as_tensor().sum_all().unwrap(), &c).unwrap();
    }
    sgd.step(&acc.into_grads().unwrap()).unwrap();
    let v = w
        .as_tensor()
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()[0];
    assert!((v - 0.5).abs() < 1e-2, "{v}");
}

/// A chunk whose loss is NaN was refused after its gradients were added; retrying the chunk on
/// the same accumulator then returned `Ok` with NaN gradients (the refused chunk's rows were
/// never counted, so nothing looked wrong). The accumulator refuses every later call now.
#[test]
fn an_accumulator_refuses_everything_after_a_chunk_failed_past_its_gradients() {
    let (x, y) = batch(8);
    let w = Var::from_tensor(&Tensor::new(&[[0.1f32], [0.2], [0.3], [0.4]], &Device::Cpu).unwrap())
        .unwrap();
    let mut acc = GradAccumulator::new(std::slice::from_ref(&w));
    let plan = BatchPlan::new(8, 2).unwrap();
    let (c0, c1) = (plan.chunk(0).unwrap(), plan.chunk(1).unwrap());
    let part = |c: &oomguard::retry::Chunk| {
        let xs = x.narrow(0, c.start(), c.len()).unwrap();
        let ys = y.narrow(0, c.start(), c.len()).unwrap();
        (xs.matmul(w.as_tensor()).unwrap() - ys)
            .unwrap()
            .sqr()
            .unwrap()
            .mean_all()
            .unwrap()
    };
    let nan = (part(&c0) * f64::NAN).unwrap();
    assert!(acc
        .backward(&nan, &c0)
        .unwrap_err()
        .to_string()
        .contains("NaN"));
    let again = acc.backward(&part(&c0), &c0).unwrap_err().to_string();
    assert!(again.contains("start a new `GradAccumulator`"), "{again}");
    assert!(acc.backward(&part(&c1), &c1).is_err());
    assert!(acc.into_grads().is_err());
}
