//! The GPT-2-shaped model of `examples/tch_gpt` trains, on CPU with a tiny shape: after one
//! backward every parameter has a defined, finite, non-zero gradient (the gradient check, which
//! is shown to catch an unused and a zero-gradient variable); the loss starts at ln(vocab) and
//! falls under AdamW; attention is causal; the loss is the mean over rows of each row's loss
//! (what chunk weighting by row share relies on); and GPT-2 small has GPT-2's 124,439,808
//! parameters.

#[allow(dead_code)] // the example uses more of them
#[path = "../examples/tch_gpt/grads.rs"]
mod grads;
#[path = "../examples/tch_gpt/model.rs"]
mod model;

use grads::check_gradients;
use model::{synthetic_tokens, Config, Gpt};
use tch::nn::{self, Init, OptimizerConfig};
use tch::{Device, Kind, Tensor};

fn tiny() -> (nn::VarStore, Gpt, Config) {
    tch::manual_seed(7);
    let vs = nn::VarStore::new(Device::Cpu);
    let cfg = Config::tiny();
    let model = Gpt::new(&vs, cfg).unwrap();
    (vs, model, cfg)
}

#[test]
fn every_parameter_gets_a_finite_nonzero_gradient() {
    let (vs, model, cfg) = tiny();
    let tokens = synthetic_tokens(1, 4, &cfg, Device::Cpu).unwrap();
    model.loss(&tokens).unwrap().f_backward().unwrap();
    let c = check_gradients(&vs).unwrap();
    // wte, wpe, 12 per block (2 layer norms, qkv, proj, fc, fc_out: weight and bias), ln_f.
    assert_eq!(c.trainable as i64, 2 + 12 * cfg.layers + 2, "{c:?}");
    assert_eq!(c.elements, cfg.parameters(), "{c:?}");
    assert!(c.missing.is_empty(), "no gradient: {:?}", c.missing);
    assert!(c.zero.is_empty(), "zero gradient: {:?}", c.zero);
    assert!(
        c.non_finite.is_empty(),
        "non-finite gradient: {:?}",
        c.non_finite
    );
    assert!(c.passed());
}

#[test]
fn the_gradient_check_names_an_unused_and_a_zero_gradient_variable() {
    let (vs, model, cfg) = tiny();
    let unused = vs.root().var("unused", &[3], Init::Const(1.0));
    let zeroed = vs.root().var("zeroed", &[3], Init::Const(1.0));
    let _ = unused;
    let tokens = synthetic_tokens(2, 2, &cfg, Device::Cpu).unwrap();
    // `zeroed` is in the graph with a zero gradient (multiplied by 0).
    let loss = model.loss(&tokens).unwrap() + (&zeroed * 0.0).sum(Kind::Float);
    loss.backward();
    let c = check_gradients(&vs).unwrap();
    assert_eq!(c.missing, vec!["unused".to_string()]);
    assert_eq!(c.zero, vec!["zeroed".to_string()]);
    assert!(!c.passed());
}

#[test]
fn the_loss_starts_at_ln_vocab_and_falls_under_adamw() {
    let (vs, model, cfg) = tiny();
    let mut opt = nn::AdamW::default().build(&vs, 3e-3).unwrap();
    let tokens = synthetic_tokens(3, 8, &cfg, Device::Cpu).unwrap();
    let mut losses = Vec::new();
    for _ in 0..30 {
        let loss = model.loss(&tokens).unwrap();
        losses.push(loss.double_value(&[]));
        loss.backward();
        opt.step();
        opt.zero_grad();
    }
    let ln_vocab = (cfg.vocab as f64).ln();
    assert!(
        (losses[0] - ln_vocab).abs() < 0.05,
        "first loss {} vs ln(vocab) {ln_vocab}",
        losses[0]
    );
    let last = *losses.last().unwrap();
    assert!(
        last < losses[0] - 0.5,
        "loss did not fall by 0.5 in 30 steps: {losses:?}"
    );
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
}

#[test]
fn attention_is_causal() {
    let (_vs, model, cfg) = tiny();
    let a = synthetic_tokens(4, 1, &cfg, Device::Cpu).unwrap();
    let s = cfg.seq;
    let input = a.narrow(1, 0, s);
    // The last token changed: the logits of every earlier position stay the same.
    let b = input.copy();
    b.narrow(1, s - 1, 1)
        .copy_(&(input.narrow(1, s - 1, 1) + 1).remainder(cfg.vocab));
    let la = model.forward(&input).unwrap();
    let lb = model.forward(&b).unwrap();
    let earlier = (la.narrow(1, 0, s - 1) - lb.narrow(1, 0, s - 1))
        .abs()
        .max()
        .double_value(&[]);
    let last = (la.narrow(1, s - 1, 1) - lb.narrow(1, s - 1, 1))
        .abs()
        .max()
        .double_value(&[]);
    assert_eq!(earlier, 0.0, "a future token changed earlier logits");
    assert!(last > 0.0, "the changed token changed nothing");
}

#[test]
fn the_loss_is_the_mean_of_the_rows_losses() {
    let (_vs, model, cfg) = tiny();
    let tokens = synthetic_tokens(5, 4, &cfg, Device::Cpu).unwrap();
    let whole = model.loss(&tokens).unwrap().double_value(&[]);
    let rows: f64 = (0..4)
        .map(|r| {
            model
                .loss(&tokens.narrow(0, r, 1))
                .unwrap()
                .double_value(&[])
        })
        .sum::<f64>()
        / 4.0;
    assert!((whole - rows).abs() < 1e-5, "{whole} vs {rows}");
}

#[test]
fn gpt2_small_has_gpt2s_parameter_count_and_bad_shapes_are_errors() {
    assert_eq!(Config::gpt2_small(1024).parameters(), 124_439_808);
    let vs = nn::VarStore::new(Device::Cpu);
    let bad = Config {
        heads: 3,
        ..Config::tiny()
    };
    let Err(err) = Gpt::new(&vs, bad) else {
        panic!("width 32 with 3 heads built");
    };
    assert!(err.to_string().contains("not a multiple of heads"), "{err}");
    // Rows longer than the context are an error, not a panic.
    let (_vs, model, cfg) = tiny();
    let long = Tensor::zeros([1, cfg.seq + 2], (Kind::Int64, Device::Cpu));
    let err = model.loss(&long).expect_err("seq + 2 tokens");
    assert!(err.to_string().contains("context"), "{err}");
}
