//! `oomguard_burn::find_max_batch` on a burn step (ndarray + `Autodiff`): the step's memory is
//! a simulated card charged per row, and a cubecl out-of-memory *panic* past some rows is a
//! failed run of the search, not a crash. `find_max_batch_train` runs `train_step`'s own attempt,
//! so a loop seeded from it does not retry, where a loop seeded from `find_max_batch` over a
//! step written by hand does.

use burn::backend::{Autodiff, NdArray};
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{GradientsParams, Optimizer, SgdConfig};
use burn::tensor::{Distribution, Tensor};
use oomguard::retry::{Chunk, FinderOptions};
use oomguard::ByteSize;
use oomguard_burn::{chunk_rows, find_max_batch, find_max_batch_train, train_step, Error};
use oomguard_harness::checks::{check_finder_through_oom_panics, check_train_finder_seeding};

type B = Autodiff<NdArray>;

/// A forward and backward pass over `rows` random rows, read back (as a real step would).
fn burn_step(model: &Linear<B>, rows: usize) -> Result<f32, Error> {
    let dev = Default::default();
    let x = Tensor::<B, 2>::random([rows, 4], Distribution::Default, &dev);
    let loss = model.forward(x).powi_scalar(2).mean();
    let _grads = loss.backward();
    Ok(loss.try_into_data()?.iter::<f32>().next().unwrap_or(0.0))
}

#[test]
fn finds_the_batch_a_burn_step_fits_through_oom_panics() {
    let model: Linear<B> = LinearConfig::new(4, 1).init(&Default::default());
    check_finder_through_oom_panics(|card, case| {
        find_max_batch(card, FinderOptions::default(), |rows| {
            let _held = case.hold(card, rows)?;
            if case.panics_at(rows) {
                // What cubecl raises when a reservation fails.
                panic!(
                    "called `Result::unwrap()` on an `Err` value: can't allocate buffer of size: {}\n",
                    rows << 20
                );
            }
            burn_step(&model, rows)
        })
        .unwrap()
    });
}

/// A loop's batch on the simulated card: its tensors and the memory they would hold on a GPU
/// (1 MiB per row, held as long as the batch).
struct Batch {
    x: Tensor<B, 2>,
    y: Tensor<B, 2>,
    _memory: oomguard::DeviceBuffer<u8>,
}

/// A batch of `rows` rows on `card`.
fn batch(card: &oomguard::Device, rows: usize) -> Result<Batch, Error> {
    let dev = Default::default();
    let memory = card.alloc::<u8>(rows << 20)?;
    Ok(Batch {
        x: Tensor::ones([rows, 4], &dev),
        y: Tensor::zeros([rows, 1], &dev),
        _memory: memory,
    })
}

fn weights(model: &Linear<B>) -> Vec<f32> {
    model.weight.val().into_data().to_vec().unwrap()
}

#[test]
fn the_train_finder_measures_train_steps_attempt_and_its_seed_never_retries() {
    // A simulated 256 MiB card: the batch holds 1 MiB per row, a chunk's activations 2 MiB per
    // row, so about 85 rows fit train_step's attempt.
    let card = oomguard::Device::sim(ByteSize::mib(256));
    let dev = Default::default();
    let mut model: Linear<B> = LinearConfig::new(4, 1).init(&dev);
    let mut make_batch = |rows: usize| batch(&card, rows);
    let mut loss = |m: &Linear<B>, c: &Chunk, b: &Batch| -> Result<Tensor<B, 1>, Error> {
        let _activations = card.alloc::<u8>(c.len() << 21)?;
        let pred = m.forward(chunk_rows(&b.x, c)?);
        Ok((pred - chunk_rows(&b.y, c)?).powi_scalar(2).mean())
    };

    // The old route: find_max_batch over a step written by hand (forward, backward, update) on
    // a copy of the model, charged as the loss closure charges. It does not hold a batch as
    // the loop does.
    let found_old = {
        let mut copy = model.clone();
        let mut opt = SgdConfig::new().init::<B, Linear<B>>();
        find_max_batch(&card, FinderOptions::default(), |rows| {
            let _activations = card.alloc::<u8>(rows << 21)?;
            let x = Tensor::<B, 2>::ones([rows, 4], &dev);
            let l = copy.forward(x).powi_scalar(2).mean();
            let grads = GradientsParams::from_grads(l.backward(), &copy);
            copy = opt.step(0.01, copy.clone(), grads);
            Ok(l.try_into_data()?.iter::<f32>().next().unwrap_or(0.0))
        })
        .unwrap()
    };

    // The new route: train_step's own attempt, with the loop's make_batch and loss closure.
    let before = weights(&model);
    let found = find_max_batch_train(
        &card,
        FinderOptions::default(),
        &model,
        &mut make_batch,
        &mut loss,
    )
    .unwrap();
    assert_eq!(weights(&model), before, "the finder trained nothing");
    // one set of gradients of the 4 -> 1 linear layer (weight and bias, f32) is accumulated
    // over a split step's chunks: 20 bytes
    let mut sgd = SgdConfig::new().init();
    check_train_finder_seeding(&found_old, &found, 20, |engine, rows| {
        let b = make_batch(rows).unwrap();
        let step = |m: &Linear<B>, c: &Chunk| loss(m, c, &b);
        let done = train_step(engine, &card, rows, &mut model, &mut sgd, 0.01, step).unwrap();
        (done.rows, done.report.retries())
    });
    assert!(weights(&model) != before, "the loop trained");
}

#[test]
fn the_train_finder_refuses_a_batch_of_the_wrong_rows() {
    let card = oomguard::Device::sim(ByteSize::mib(256));
    let dev = Default::default();
    let model: Linear<B> = LinearConfig::new(4, 1).init(&dev);
    let err = find_max_batch_train(
        &card,
        FinderOptions::default(),
        &model,
        |rows| Ok(Tensor::<B, 2>::ones([rows + 1, 4], &dev)),
        |m: &Linear<B>, c: &Chunk, x: &Tensor<B, 2>| {
            let _a = card.alloc::<u8>(c.len() << 20)?;
            Ok(m.forward(chunk_rows(x, c)?).mean())
        },
    )
    .unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("shape [2, 4] has 2 rows; the plan splits a batch of 1"),
        "{text}"
    );
}

/// A model with a frozen table beside its trained head: one set of accumulated gradients holds
/// the head's only. It counted every parameter (a frozen 1024 × 1024 f32 table: 4 MiB), which
/// shrank the micro-batches a seeded engine starts from (found by a hostile pass of the glue).
#[derive(Module, Debug)]
struct FrozenBase<B: burn::tensor::backend::Backend> {
    head: Linear<B>,
    table: Linear<B>,
}

#[test]
fn accumulation_counts_the_trained_parameters_only() {
    let card = oomguard::Device::sim(ByteSize::mib(256));
    let dev = Default::default();
    let model = FrozenBase::<B> {
        head: LinearConfig::new(4, 1).init(&dev),
        table: LinearConfig::new(1024, 1024)
            .with_bias(false)
            .init(&dev)
            .no_grad(),
    };
    let mut make_batch = |rows: usize| batch(&card, rows);
    let mut loss = |m: &FrozenBase<B>, c: &Chunk, b: &Batch| -> Result<Tensor<B, 1>, Error> {
        let _activations = card.alloc::<u8>(c.len() << 21)?;
        let pred = m.head.forward(chunk_rows(&b.x, c)?);
        Ok((pred - chunk_rows(&b.y, c)?).powi_scalar(2).mean())
    };
    let found = find_max_batch_train(
        &card,
        FinderOptions::default(),
        &model,
        &mut make_batch,
        &mut loss,
    )
    .unwrap();
    // the head: 4 weights and 1 bias, f32
    assert_eq!(found.accumulation_bytes, Some(20), "{found}");
}
