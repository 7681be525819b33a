//! `find_max_batch_train` on CPU: a simulated card charged per row stands for the GPU. The finder
//! runs `train_step`'s own attempt, so a loop seeded from it does not retry, where a loop seeded
//! from `find_max_batch` over a step written by hand does.

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Optimizer, SGD};
use oomguard::retry::{find_max_batch, Chunk, FinderOptions};
use oomguard::ByteSize;
use oomguard_candle::{charge, find_max_batch_train, train_step, Charge};
use oomguard_harness::checks::check_train_finder_seeding;

/// A loop's batch on the simulated card: its tensors and the memory they would hold on a GPU
/// (1 MiB per row, held as long as the batch).
struct Batch {
    tensors: Vec<Tensor>,
    _memory: Charge,
}

impl AsRef<[Tensor]> for Batch {
    fn as_ref(&self) -> &[Tensor] {
        &self.tensors
    }
}

fn values(w: &Var) -> Vec<f32> {
    w.as_tensor().flatten_all().unwrap().to_vec1().unwrap()
}

#[test]
fn the_train_finder_measures_train_steps_attempt_and_its_seed_never_retries() {
    // A simulated 256 MiB card: the batch holds 1 MiB per row, a chunk's activations 2 MiB per
    // row, so about 85 rows fit train_step's attempt.
    let card = oomguard::Device::sim(ByteSize::mib(256));
    let dev = Device::Cpu;
    let w = Var::zeros((4, 1), DType::F32, &dev).unwrap();
    let mut sgd = SGD::new(vec![w.clone()], 0.01).unwrap();
    let mut make_batch = |rows: usize| -> candle_core::Result<Batch> {
        let memory = charge(&card, rows << 20)?;
        let x = Tensor::ones((rows, 4), DType::F32, &dev)?;
        let y = Tensor::ones((rows, 1), DType::F32, &dev)?;
        Ok(Batch {
            tensors: vec![x, y],
            _memory: memory,
        })
    };
    let mut loss = |c: &Chunk, rows: &[Tensor]| -> candle_core::Result<Tensor> {
        let _activations = charge(&card, c.len() << 21)?;
        (rows[0].matmul(w.as_tensor())? - &rows[1])?
            .sqr()?
            .mean_all()
    };

    // The old route: find_max_batch over a step written by hand (forward, backward, update) on
    // a copy of the weight, charged as the loss closure charges. It does not hold a batch as
    // the loop does.
    let found_old = {
        let w2 = Var::zeros((4, 1), DType::F32, &dev).unwrap();
        let mut opt = SGD::new(vec![w2.clone()], 0.01).unwrap();
        find_max_batch(&card, FinderOptions::default(), |rows| {
            let _activations = charge(&card, rows << 21)?;
            let x = Tensor::ones((rows, 4), DType::F32, &dev)?;
            let l = x.matmul(w2.as_tensor())?.sqr()?.mean_all()?;
            opt.backward_step(&l)?;
            l.to_scalar::<f32>()
        })
        .unwrap()
    };

    // The new route: train_step's own attempt, with the loop's make_batch and loss closure.
    let before = values(&w);
    let found = find_max_batch_train(
        &card,
        FinderOptions::default(),
        &w,
        &mut make_batch,
        &mut loss,
    )
    .unwrap();
    assert_eq!(values(&w), before, "the finder trained nothing");
    // one set of gradients of the (4, 1) f32 weight is accumulated over a split step's chunks
    check_train_finder_seeding(&found_old, &found, 16, |engine, rows| {
        let b = make_batch(rows).unwrap();
        let refs: Vec<&Tensor> = b.tensors.iter().collect();
        let done = train_step(engine, &card, &refs, &w, &mut sgd, &mut loss).unwrap();
        (done.rows, done.report.retries())
    });
    assert!(values(&w) != before, "the loop trained");
}

#[test]
fn the_train_finder_refuses_a_batch_of_the_wrong_rows() {
    let card = oomguard::Device::sim(ByteSize::mib(256));
    let dev = Device::Cpu;
    let w = Var::zeros((4, 1), DType::F32, &dev).unwrap();
    let err = find_max_batch_train(
        &card,
        FinderOptions::default(),
        &w,
        |rows| Ok(vec![Tensor::ones((rows + 1, 4), DType::F32, &dev)?]),
        |c, rows| {
            let _a = charge(&card, c.len() << 20)?;
            rows[0].matmul(w.as_tensor())?.mean_all()
        },
    )
    .unwrap_err();
    let text = err.to_string();
    assert!(text.contains("gave a batch of 2 rows"), "{text}");
}

#[test]
fn the_train_finder_stops_at_a_parameter_without_gradient() {
    // The same check as train_step's: a trained variable the loss does not reach is an error
    // naming it, not a batch size.
    let card = oomguard::Device::sim(ByteSize::mib(256));
    let dev = Device::Cpu;
    let w = Var::zeros((4, 1), DType::F32, &dev).unwrap();
    let unused = Var::zeros(3, DType::F32, &dev).unwrap();
    let err = find_max_batch_train(
        &card,
        FinderOptions::default(),
        vec![w.clone(), unused],
        |rows| Ok(vec![Tensor::ones((rows, 4), DType::F32, &dev)?]),
        |_c, rows| rows[0].matmul(w.as_tensor())?.mean_all(),
    )
    .unwrap_err();
    let text = err.to_string();
    assert!(text.contains("no gradient reached 1 of the 2"), "{text}");
    assert!(text.contains("#1 [3] F32"), "{text}");
}
