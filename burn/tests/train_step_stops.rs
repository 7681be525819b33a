//! Issue 32, points 11 and 13 on burn's `train_step` (ndarray under `Autodiff`, a simulated
//! card charged per chunk): a step that keeps memory across attempts is stopped and named,
//! and a step can start from the plan `find_max_batch` found.

use burn::backend::{Autodiff, NdArray};
use burn::nn::{Linear, LinearConfig};
use burn::optim::SgdConfig;
use burn::tensor::{Tensor, TensorData};
use oomguard::retry::{FinderOptions, RetryEngine};
use oomguard::ByteSize;
use oomguard_burn::{chunk_rows, find_max_batch, train_step};
use oomguard_harness::checks::assert_stopped_for_a_leak;

type B = Autodiff<NdArray>;

fn data() -> (Tensor<B, 2>, Tensor<B, 2>) {
    let dev = Default::default();
    let x: Vec<f32> = (0..256)
        .map(|i| ((i * 37 % 101) as f32) / 50.0 - 1.0)
        .collect();
    let x = Tensor::<B, 2>::from_data(TensorData::new(x, [64, 4]), &dev);
    let y = x.clone().sum_dim(1).detach();
    (x, y)
}

fn mse(m: &Linear<B>, x: Tensor<B, 2>, y: Tensor<B, 2>) -> Tensor<B, 1> {
    (m.forward(x) - y).powi_scalar(2).mean()
}

fn weights(m: &Linear<B>) -> Vec<f32> {
    m.weight.val().into_data().iter::<f32>().collect()
}

/// The closure keeps each chunk's "activations" across attempts. Before: `train_step` halved
/// down to micro-batches of 1 row and failed with "the policy allows nothing smaller", the
/// growth unsaid; now it stops early, names the growth, and the model is unchanged.
#[test]
fn a_leaking_chunk_loss_is_stopped_and_named() {
    let (x, y) = data();
    let sim = oomguard::Device::sim(ByteSize::mib(40));
    let mut model = LinearConfig::new(4, 1).init::<B>(&Default::default());
    let before = weights(&model);
    let mut opt = SgdConfig::new().init::<B, Linear<B>>();
    let mut kept = Vec::new();
    let e = train_step(
        &RetryEngine::new(),
        &sim,
        64,
        &mut model,
        &mut opt,
        0.05,
        |m, chunk| {
            kept.push(sim.alloc::<u8>(chunk.len() << 20)?); // kept: a leak
            Ok(mse(m, chunk_rows(&x, chunk)?, chunk_rows(&y, chunk)?))
        },
    )
    .unwrap_err();
    assert_stopped_for_a_leak::<oomguard_burn::Error>(&e);
    assert_eq!(weights(&model), before, "nothing was updated");
}

/// The finder's report seeds the engine, and `train_step` starts from that plan with no
/// out-of-memory on the way down (before: no way to start from it).
#[test]
fn a_step_starts_from_the_batch_the_finder_found() {
    let (x, y) = data();
    let sim = oomguard::Device::sim(ByteSize::mib(40));
    let mut model = LinearConfig::new(4, 1).init::<B>(&Default::default());
    let mut opt = SgdConfig::new().init::<B, Linear<B>>();
    let opts = FinderOptions {
        max: 64,
        verify_steps: 2,
        ..FinderOptions::default()
    };
    let found = find_max_batch(&sim, opts, |rows| {
        sim.alloc::<u8>(rows << 20).map(drop)?;
        Ok(())
    })
    .unwrap();
    assert!(found.max_batch >= 30 && found.max_batch < 40, "{found}");
    let engine = RetryEngine::new().start_from_finder(&found);
    let done = train_step(&engine, &sim, 64, &mut model, &mut opt, 0.05, |m, chunk| {
        let _acts = sim.alloc::<u8>(chunk.len() << 20)?;
        Ok(mse(m, chunk_rows(&x, chunk)?, chunk_rows(&y, chunk)?))
    })
    .unwrap();
    assert_eq!(done.report.retries(), 0, "{}", done.report);
    assert_eq!(done.report.seeded, Some(found.max_batch));
    assert_eq!(done.rows, 64);
}
