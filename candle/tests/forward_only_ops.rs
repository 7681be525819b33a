//! candle-nn 0.11.1's forward-only ops, as the crate docs and the README describe them, checked
//! on CPU: their outputs carry no backward op, so nothing below them gets a gradient; the
//! differentiable replacements the docs name do pass gradients to every input.

use candle_core::{DType, Device, Module, Tensor, Var, D};
use candle_nn::{ops, VarBuilder, VarMap};

fn input() -> Var {
    let x: Vec<f32> = (0..24).map(|i| ((i * 7 % 11) as f32) / 5.0 - 1.0).collect();
    Var::from_tensor(&Tensor::from_vec(x, (2, 3, 4), &Device::Cpu).unwrap()).unwrap()
}

/// Which of `vars` get a gradient from `out`'s weighted sum (weights break the symmetry that
/// makes a normalisation's gradient vanish).
fn reached(out: &Tensor, vars: &[&Var]) -> Vec<bool> {
    let w = Tensor::arange(0f32, out.elem_count() as f32, &Device::Cpu)
        .unwrap()
        .reshape(out.shape())
        .unwrap();
    let g = (out * w).unwrap().sum_all().unwrap().backward().unwrap();
    vars.iter()
        .map(|v| g.get(v.as_tensor()).is_some())
        .collect()
}

#[test]
fn layer_norm_module_with_bias_cuts_the_graph_and_layer_norm_slow_does_not() {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let ln = candle_nn::layer_norm(4, 1e-5, vb.pp("ln")).unwrap();
    let vars = varmap.all_vars();
    assert_eq!(vars.len(), 2, "weight and bias");
    let x = input();
    let mut all: Vec<&Var> = vec![&x];
    all.extend(vars.iter());

    // the module on a contiguous input with a bias: ops::layer_norm, apply_op3_no_bwd
    let out = ln.forward(x.as_tensor()).unwrap();
    assert_eq!(reached(&out, &all), [false, false, false]);
    let out = ops::layer_norm(x.as_tensor(), ln.weight(), ln.bias().unwrap(), 1e-5).unwrap();
    assert_eq!(reached(&out, &all), [false, false, false]);

    // the replacement, with the module's own weight and bias: same values, every gradient
    let slow = ops::layer_norm_slow(x.as_tensor(), ln.weight(), ln.bias().unwrap(), 1e-5).unwrap();
    assert_eq!(reached(&slow, &all), [true, true, true]);
    let diff = (slow - out)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(
        diff < 1e-5,
        "layer_norm_slow differs from layer_norm by {diff}"
    );
}

#[test]
fn softmax_last_dim_cuts_the_graph_and_softmax_does_not() {
    let x = input();
    let fast = ops::softmax_last_dim(x.as_tensor()).unwrap();
    assert_eq!(reached(&fast, &[&x]), [false]);
    let slow = ops::softmax(x.as_tensor(), D::Minus1).unwrap();
    assert_eq!(reached(&slow, &[&x]), [true]);
    let diff = (slow - fast)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(diff < 1e-6, "{diff}");
}

#[test]
fn rms_norm_cuts_the_graph_and_rms_norm_slow_does_not() {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let norm = candle_nn::rms_norm(4, 1e-5, vb.pp("norm")).unwrap();
    let alpha = varmap.all_vars().pop().unwrap();
    let x = input();
    let out = norm.forward(x.as_tensor()).unwrap();
    assert_eq!(reached(&out, &[&x, &alpha]), [false, false]);
    let out = ops::rms_norm(x.as_tensor(), alpha.as_tensor(), 1e-5).unwrap();
    assert_eq!(reached(&out, &[&x, &alpha]), [false, false]);
    let slow = ops::rms_norm_slow(x.as_tensor(), alpha.as_tensor(), 1e-5).unwrap();
    assert_eq!(reached(&slow, &[&x, &alpha]), [true, true]);
}
