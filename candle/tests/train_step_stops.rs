//! Issue 32, points 11 and 13 on candle's `train_step` (CPU tensors, a simulated card charged
//! per chunk): a step that keeps memory across attempts is stopped and named, and a step can
//! start from the plan `find_max_batch` found.

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Optimizer, SGD};
use oomguard::retry::{find_max_batch, FinderOptions, RetryEngine};
use oomguard::ByteSize;
use oomguard_candle::{charge, train_step};
use oomguard_harness::checks::assert_stopped_for_a_leak;

fn data() -> (Tensor, Tensor) {
    let x: Vec<f32> = (0..256)
        .map(|i| ((i * 37 % 101) as f32) / 50.0 - 1.0)
        .collect();
    let x = Tensor::from_vec(x, (64, 4), &Device::Cpu).unwrap();
    let y = x.sum_keepdim(1).unwrap();
    (x, y)
}

fn loss(w: &Var, x: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
    (x.matmul(w.as_tensor())? - y)?.sqr()?.mean_all()
}

/// The closure keeps each chunk's "activations" across attempts. Before: `train_step` halved
/// down to micro-batches of 1 row (8 attempts) and failed with "the policy allows nothing
/// smaller", the growth unsaid; now it stops early and names the growth.
#[test]
fn a_leaking_chunk_loss_is_stopped_and_named() {
    let (x, y) = data();
    let sim = oomguard::Device::sim(ByteSize::mib(40));
    let w = Var::zeros((4, 1), DType::F32, &Device::Cpu).unwrap();
    let mut sgd = SGD::new(vec![w.clone()], 0.01).unwrap();
    let mut kept = Vec::new();
    let e = train_step(
        &RetryEngine::new(),
        &sim,
        &[&x, &y],
        &w,
        &mut sgd,
        |chunk, rows| {
            kept.push(charge(&sim, chunk.len() << 20)?); // kept: a leak
            loss(&w, &rows[0], &rows[1])
        },
    )
    .unwrap_err();
    assert_stopped_for_a_leak::<candle_core::Error>(&e);
    assert_eq!(
        w.as_tensor().sum_all().unwrap().to_scalar::<f32>().unwrap(),
        0.0,
        "nothing was updated"
    );
}

/// `find_max_batch` trains the model it measures (it runs real steps); its report seeds the
/// engine, and `train_step` then starts from that plan: no out-of-memory on the way down
/// (before: every first step started from the whole batch and failed its way down).
#[test]
fn a_step_starts_from_the_batch_the_finder_found() {
    let (x, y) = data();
    let sim = oomguard::Device::sim(ByteSize::mib(40));
    let w = Var::zeros((4, 1), DType::F32, &Device::Cpu).unwrap();
    let mut sgd = SGD::new(vec![w.clone()], 0.01).unwrap();
    let opts = FinderOptions {
        max: 64,
        verify_steps: 2,
        ..FinderOptions::default()
    };
    // the finder's step: 1 MiB per row on the card
    let found = find_max_batch(&sim, opts, |rows| charge(&sim, rows << 20).map(drop)).unwrap();
    assert!(found.max_batch >= 30 && found.max_batch < 40, "{found}");
    let engine = RetryEngine::new().start_from_finder(&found);
    let done = train_step(&engine, &sim, &[&x, &y], &w, &mut sgd, |chunk, rows| {
        let _acts = charge(&sim, chunk.len() << 20)?;
        loss(&w, &rows[0], &rows[1])
    })
    .unwrap();
    assert_eq!(done.report.retries(), 0, "{}", done.report);
    assert_eq!(done.report.seeded, Some(found.max_batch));
    assert!(done.report.final_plan.micro_batch() <= found.max_batch);
    assert_eq!(done.rows, 64);
    assert!(done.report.to_string().contains("RetryEngine::start_from"));
    // without the seed, the same step fails on the way down
    let w2 = Var::zeros((4, 1), DType::F32, &Device::Cpu).unwrap();
    let mut sgd2 = SGD::new(vec![w2.clone()], 0.01).unwrap();
    let plain = train_step(
        &RetryEngine::new(),
        &sim,
        &[&x, &y],
        &w2,
        &mut sgd2,
        |chunk, rows| {
            let _acts = charge(&sim, chunk.len() << 20)?;
            loss(&w2, &rows[0], &rows[1])
        },
    )
    .unwrap();
    assert!(plain.report.retries() >= 1);
    assert_eq!(plain.report.seeded, None);
}
