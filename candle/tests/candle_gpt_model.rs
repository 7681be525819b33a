//! The model of `examples/candle_gpt` (the same file, `model.rs`), built small on CPU: every
//! parameter gets a gradient (the example trained only its tied embedding through the head
//! while it used candle-nn's forward-only `LayerNorm` module and `softmax_last_dim`), and a few
//! SGD steps through `train_step` lower the loss.

#[path = "../examples/candle_gpt/model.rs"]
mod model;

use candle_core::{DType, Device};
use candle_nn::{Optimizer, VarBuilder, VarMap, SGD};
use oomguard::retry::{BatchPlan, RetryEngine};
use oomguard::ByteSize;
use oomguard_candle::{chunk_rows, train_step, GradAccumulator, Params};

use model::{synthetic_tokens, Config, Gpt};

fn tiny() -> Config {
    Config {
        layers: 2,
        width: 16,
        heads: 2,
        vocab: 32,
        seq: 8,
    }
}

fn build() -> (VarMap, Gpt) {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let model = Gpt::new(tiny(), vb, &Device::Cpu).unwrap();
    (varmap, model)
}

#[test]
fn every_parameter_of_the_model_gets_a_gradient() {
    let (varmap, model) = build();
    let params = Params::from_varmap(&varmap);
    // 2 blocks × (2 norms × 2 + 4 linears × 2) + wte + wpe + ln_f × 2
    assert_eq!(params.trained_vars().len(), 2 * 12 + 4);
    let tokens = synthetic_tokens(1, 6, &tiny(), &Device::Cpu).unwrap();
    // Split in 3 chunks, as after an OOM.
    let plan = BatchPlan::new(6, 3).unwrap();
    let mut acc = GradAccumulator::new(&params);
    for c in plan.chunks() {
        let loss = model.loss(&chunk_rows(&tokens, &c).unwrap()).unwrap();
        acc.backward(&loss, &c).unwrap();
    }
    // Fails, naming them, when any parameter got no gradient.
    let grads = acc.into_grads().unwrap();
    let data = varmap.data().lock().unwrap();
    for (name, var) in data.iter() {
        let g = grads.get(var.as_tensor()).unwrap();
        let norm = g
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(norm > 0.0 && norm.is_finite(), "{name}: |g|² = {norm}");
    }
}

#[test]
fn sgd_steps_through_train_step_lower_the_loss() {
    let (varmap, model) = build();
    let tokens = synthetic_tokens(7, 8, &tiny(), &Device::Cpu).unwrap();
    let mut opt = SGD::new(varmap.all_vars(), 0.5).unwrap();
    // 8 rows of 1 MiB "activations" on a 5 MiB card: every step runs as micro-batches.
    let card = oomguard::Device::sim(ByteSize::mib(5));
    let engine = RetryEngine::new();
    let mut losses = Vec::new();
    for _ in 0..8 {
        let done = train_step(&engine, &card, &[&tokens], &varmap, &mut opt, |c, rows| {
            let _acts = oomguard_candle::charge(&card, c.len() << 20)?;
            model.loss(&rows[0])
        })
        .unwrap();
        assert_eq!(done.rows, 8);
        assert!(done.report.final_plan.num_chunks() > 1, "{}", done.report);
        losses.push(done.loss);
    }
    let (first, last) = (losses[0], losses[losses.len() - 1]);
    assert!(
        (first - (tiny().vocab as f64).ln()).abs() < 0.5,
        "starts near ln(vocab): {losses:?}"
    );
    assert!(last < first - 0.05, "the loss falls: {losses:?}");
}
