//! The finder's batch in the loop, on a GPU (needs a CUDA device): under a 2 GiB budget on
//! libtorch's own allocator (its memory fraction), an MLP's largest batch found by
//! `find_max_batch_train` (train_step's own attempt) runs 20 `train_step`s with no retry from a
//! fresh engine, and 20 more at 4 × that batch from an engine seeded with `start_from_finder`
//! (each loop from an emptied cache, as the finder leaves it).
//! The older route (`find_max_batch` over a hand-written step on a copy of the model) is run
//! beside it and its retries printed: a tch user's crate found 24,700 that way and its loop
//! retried.

use oomguard::retry::{Chunk, FinderOptions, FinderReport, RetryEngine};
use oomguard::source::MemorySource;
use oomguard_tch::{find_max_batch, find_max_batch_train, train_step, Error, LibtorchCudaSource};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

const WIDTH: i64 = 1024;

fn mlp(vs: &nn::VarStore) -> nn::Sequential {
    let r = vs.root();
    nn::seq()
        .add(nn::linear(&r / "l1", WIDTH, 4 * WIDTH, Default::default()))
        .add_fn(|x| x.gelu("none"))
        .add(nn::linear(
            &r / "l2",
            4 * WIDTH,
            4 * WIDTH,
            Default::default(),
        ))
        .add_fn(|x| x.gelu("none"))
        .add(nn::linear(&r / "l3", 4 * WIDTH, 1, Default::default()))
}

fn batch(rows: usize, dev: Device) -> Result<Vec<Tensor>, Error> {
    let x = Tensor::f_randn([rows as i64, WIDTH], (Kind::Float, dev))?;
    let y = Tensor::f_randn([rows as i64, 1], (Kind::Float, dev))?;
    Ok(vec![x, y])
}

/// Retries of `steps` train_steps of `rows` rows on `engine`.
fn loop_retries(
    engine: &RetryEngine,
    source: &LibtorchCudaSource,
    rows: usize,
    steps: usize,
    vs: &nn::VarStore,
    opt: &mut nn::Optimizer,
    model: &nn::Sequential,
) -> usize {
    let dev = vs.device();
    let mut retries = 0;
    for _ in 0..steps {
        let b = batch(rows, dev).unwrap();
        let done = train_step(engine, source, &[&b[0], &b[1]], vs, opt, |_c: &Chunk, r| {
            Ok(model
                .forward(&r[0])
                .f_mse_loss(&r[1], tch::Reduction::Mean)?)
        })
        .unwrap();
        assert_eq!(done.rows, rows);
        if done.report.retries() > 0 {
            println!("RETRIED {}", done.report);
        }
        retries += done.report.retries();
    }
    retries
}

#[test]
#[ignore = "needs a CUDA device"]
fn the_train_finders_batch_runs_twenty_steps_without_a_retry_under_a_2_gib_budget() {
    let dev = Device::Cuda(0);
    let source = LibtorchCudaSource::new(0).unwrap();
    let _budget = source.budget(2 << 30).unwrap();
    tch::manual_seed(1);
    let vs = nn::VarStore::new(dev);
    let model = mlp(&vs);
    let mut opt = nn::AdamW::default().build(&vs, 1e-4).unwrap();
    let opts = FinderOptions {
        max: 1 << 20,
        ..Default::default()
    };

    // The older route: the user's own step on a copy of the model.
    let old: FinderReport = {
        let copy = nn::VarStore::new(dev);
        let m = mlp(&copy);
        let mut o = nn::AdamW::default().build(&copy, 1e-4).unwrap();
        find_max_batch(&source, opts, |rows| {
            let b = batch(rows, dev)?;
            let l = m.forward(&b[0]).f_mse_loss(&b[1], tch::Reduction::Mean)?;
            o.zero_grad();
            l.f_backward()?;
            o.step();
            Ok(l.f_double_value(&[])?)
        })
        .unwrap()
    };
    source.empty_cache().unwrap();
    let old_retries = loop_retries(
        &RetryEngine::new(),
        &source,
        old.max_batch,
        20,
        &vs,
        &mut opt,
        &model,
    );
    println!(
        "RESULT route=find_max_batch max_batch={} retries_in_20_steps={old_retries}",
        old.max_batch
    );
    source.empty_cache().unwrap();

    // train_step's own attempt (AdamW's state exists now: the loop above made it).
    let found = find_max_batch_train(
        &source,
        opts,
        &vs,
        &mut opt,
        |rows| batch(rows, dev),
        |_c: &Chunk, r: &[Tensor]| {
            Ok(model
                .forward(&r[0])
                .f_mse_loss(&r[1], tch::Reduction::Mean)?)
        },
    )
    .unwrap();
    source.empty_cache().unwrap();
    let fresh = loop_retries(
        &RetryEngine::new(),
        &source,
        found.max_batch,
        20,
        &vs,
        &mut opt,
        &model,
    );
    // A loop that starts where the finder left the cache (emptied), as a loop started after
    // it does: the 20 steps above left libtorch's cache split for their own sizes.
    source.empty_cache().unwrap();
    let seeded_engine = RetryEngine::new().start_from_finder(&found);
    let seeded = loop_retries(
        &seeded_engine,
        &source,
        4 * found.max_batch,
        20,
        &vs,
        &mut opt,
        &model,
    );
    println!(
        "RESULT route=find_max_batch_train max_batch={} accumulation_bytes={:?} seed_4x={} retries_fresh_20={fresh} retries_seeded_4x_20={seeded}",
        found.max_batch,
        found.accumulation_bytes,
        found.micro_batch_for(4 * found.max_batch)
    );
    assert_eq!((fresh, seeded), (0, 0), "{found}");
}
