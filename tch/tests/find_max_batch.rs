//! `oomguard_tch::find_max_batch` on a tch step (CPU): the step's memory is a simulated card
//! charged per row, and a libtorch out-of-memory raised as the *panic* of a plain tch method past
//! some rows is a failed run of the search, not a crash.

use oomguard::retry::FinderOptions;
use oomguard::ByteSize;
use oomguard_harness::checks::{check_finder_through_oom_panics, check_train_finder_seeding};
use oomguard_tch::{find_max_batch, Error};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

#[test]
fn finds_the_batch_a_tch_step_fits_through_oom_panics() {
    let vs = nn::VarStore::new(Device::Cpu);
    let model = nn::linear(vs.root(), 4, 1, Default::default());
    let mut sgd = nn::Sgd::default().build(&vs, 0.01).unwrap();
    let mut step = |rows: usize| -> Result<f64, Error> {
        let x = Tensor::f_ones([rows as i64, 4], (Kind::Float, Device::Cpu))?;
        let loss = model.forward(&x).f_square()?.f_mean(Kind::Float)?;
        sgd.zero_grad();
        loss.f_backward()?;
        sgd.step();
        Ok(loss.f_double_value(&[])?)
    };
    check_finder_through_oom_panics(|card, case| {
        find_max_batch(card, FinderOptions::default(), |rows| {
            let _held = case.hold(card, rows)?;
            if case.panics_at(rows) {
                // libtorch's own out-of-memory, as the panic of a plain method: 4 PiB
                let _huge = Tensor::empty([1i64 << 50], (Kind::Float, Device::Cpu));
            }
            step(rows)
        })
        .unwrap()
    });
}

/// A loop's batch on the simulated card: its tensors and the memory they would hold on a GPU
/// (1 MiB per row, held as long as the batch).
struct Batch {
    tensors: Vec<Tensor>,
    _memory: oomguard_tch::Charge,
}

impl AsRef<[Tensor]> for Batch {
    fn as_ref(&self) -> &[Tensor] {
        &self.tensors
    }
}

/// The model's variables as numbers.
fn values(vs: &nn::VarStore) -> Vec<(String, Vec<f32>)> {
    let mut v: Vec<_> = vs
        .variables()
        .into_iter()
        .map(|(n, t)| (n, Vec::<f32>::try_from(t.flatten(0, -1)).unwrap()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

#[test]
fn the_train_finder_measures_train_steps_attempt_and_its_seed_never_retries() {
    // A simulated 256 MiB card: the batch holds 1 MiB per row, a chunk's activations 2 MiB per
    // row, so about 85 rows fit train_step's attempt.
    let card = oomguard::Device::sim(ByteSize::mib(256));
    let vs = nn::VarStore::new(Device::Cpu);
    let model = nn::linear(vs.root() / "fc", 4, 1, Default::default());
    let mut sgd = nn::Sgd::default().build(&vs, 0.01).unwrap();
    let mut make_batch = |rows: usize| -> Result<Batch, Error> {
        let memory = oomguard_tch::charge(&card, rows << 20)?;
        let x = Tensor::f_ones([rows as i64, 4], (Kind::Float, Device::Cpu))?;
        let y = Tensor::f_zeros([rows as i64, 1], (Kind::Float, Device::Cpu))?;
        Ok(Batch {
            tensors: vec![x, y],
            _memory: memory,
        })
    };
    let mut loss = |c: &oomguard::retry::Chunk, rows: &[Tensor]| -> Result<Tensor, Error> {
        let _activations = oomguard_tch::charge(&card, c.len() << 21)?;
        Ok(model
            .forward(&rows[0])
            .f_mse_loss(&rows[1], tch::Reduction::Mean)?)
    };

    // The old route: find_max_batch over a step written by hand (forward, backward, update),
    // charged as the loss closure charges. It does not hold a batch as the loop does.
    let found_old = {
        let copy = nn::VarStore::new(Device::Cpu);
        let m = nn::linear(copy.root() / "fc", 4, 1, Default::default());
        let mut opt = nn::Sgd::default().build(&copy, 0.01).unwrap();
        find_max_batch(&card, FinderOptions::default(), |rows| {
            let _activations = oomguard_tch::charge(&card, rows << 21)?;
            let x = Tensor::f_ones([rows as i64, 4], (Kind::Float, Device::Cpu))?;
            let l = m.forward(&x).f_square()?.f_mean(Kind::Float)?;
            opt.zero_grad();
            l.f_backward()?;
            opt.step();
            Ok(l.f_double_value(&[])?)
        })
        .unwrap()
    };

    // The new route: train_step's own attempt, with the loop's make_batch and loss closure.
    let before = values(&vs);
    let found = oomguard_tch::find_max_batch_train(
        &card,
        FinderOptions::default(),
        &vs,
        &mut sgd,
        &mut make_batch,
        &mut loss,
    )
    .unwrap();
    assert_eq!(values(&vs), before, "the finder trained nothing");
    assert!(vs.trainable_variables().iter().all(|t| !t.grad().defined()));
    // one set of gradients of the 4 -> 1 linear layer (weight and bias, f32) is accumulated
    // over a split step's chunks: 20 bytes
    check_train_finder_seeding(&found_old, &found, 20, |engine, rows| {
        let b = make_batch(rows).unwrap();
        let refs: Vec<&Tensor> = b.tensors.iter().collect();
        let done =
            oomguard_tch::train_step(engine, &card, &refs, &vs, &mut sgd, &mut loss).unwrap();
        (done.rows, done.report.retries())
    });
    assert!(values(&vs) != before, "the loop trained");
}

#[test]
fn the_train_finder_refuses_a_batch_of_the_wrong_rows() {
    let card = oomguard::Device::sim(ByteSize::mib(256));
    let vs = nn::VarStore::new(Device::Cpu);
    let model = nn::linear(vs.root() / "fc", 4, 1, Default::default());
    let mut sgd = nn::Sgd::default().build(&vs, 0.01).unwrap();
    let err = oomguard_tch::find_max_batch_train(
        &card,
        FinderOptions::default(),
        &vs,
        &mut sgd,
        |rows| {
            Ok(vec![Tensor::ones(
                [rows as i64 + 1, 4],
                (Kind::Float, Device::Cpu),
            )])
        },
        |c, rows| {
            let _a = oomguard_tch::charge(&card, c.len() << 20)?;
            Ok(model.forward(&rows[0]).f_mean(Kind::Float)?)
        },
    )
    .unwrap_err();
    let text = err.to_string();
    assert!(text.contains("gave a batch of 2 rows"), "{text}");
}
