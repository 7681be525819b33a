//! The candle-transformers model of the H100 example `candle_convmixer` does the real job: every
//! trainable parameter gets a gradient and the loss falls (a figure measured on a cut graph means
//! nothing: candle-nn's fused layer norm and `softmax_last_dim` are forward-only).
//!
//! On the GPU (ignored without one; `.gpu/run` runs it): ConvMixer's depthwise convolutions are
//! 1024 separate convolutions per layer in candle, over 5 minutes for one step on a CPU (tried).

#[path = "../examples/candle_convmixer/model.rs"]
mod convmixer;

use candle_core::{DType, Device, Tensor};
use candle_nn::{Optimizer, VarBuilder, VarMap, SGD};

#[test]
#[ignore = "needs a CUDA device"]
fn convmixer_trains_every_parameter() -> candle_core::Result<()> {
    let dev = Device::new_cuda(0)?;
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
    let model = convmixer::ConvMixer::new(convmixer::Config::tiny(), vb)?;
    let trainable = convmixer::trainable(&varmap);
    let all = varmap.all_vars().len();
    assert!(
        trainable.len() < all,
        "BatchNorm running statistics are buffers, not trained"
    );
    let (x, y) = convmixer::synthetic_batch(1, 2, &model.cfg, &dev)?;
    let loss = model.loss(&x, &y)?;
    let grads = loss.backward()?;
    let missing: Vec<String> = trainable
        .iter()
        .filter(|(_, v)| grads.get(v.as_tensor()).is_none())
        .map(|(n, _)| n.clone())
        .collect();
    assert!(missing.is_empty(), "no gradient for {missing:?}");
    for (name, v) in &trainable {
        let g = grads.get(v.as_tensor()).unwrap();
        let n: f32 = g.sqr()?.sum_all()?.to_scalar()?;
        assert!(n.is_finite(), "{name}: {n}");
    }
    let mut opt = SGD::new(trainable.iter().map(|(_, v)| v.clone()).collect(), 0.1)?;
    let first: f32 = loss.to_scalar()?;
    let mut last = first;
    for _ in 0..2 {
        let l = model.loss(&x, &y)?;
        opt.backward_step(&l)?;
        last = model.loss(&x, &y)?.to_scalar()?;
    }
    assert!(last < first, "the loss falls: {first} -> {last}");
    // Eval-mode batch norm uses running statistics: a row's loss does not depend on the others,
    // so a batch split into micro-batches is exact.
    let whole = model.per_row_loss(&x, &y)?;
    let halves = Tensor::cat(
        &[
            model.per_row_loss(&x.narrow(0, 0, 1)?, &y.narrow(0, 0, 1)?)?,
            model.per_row_loss(&x.narrow(0, 1, 1)?, &y.narrow(0, 1, 1)?)?,
        ],
        0,
    )?;
    let d: f32 = (whole - halves)?.abs()?.max_all()?.to_scalar()?;
    assert!(d < 1e-5, "{d}");
    Ok(())
}
