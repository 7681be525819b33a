//! The finder's batch in the loop, on a GPU (needs a CUDA device; feature `cuda`): under a
//! 2 GiB budget on the driver's pool (candle's allocator), an MLP's largest batch found by
//! `find_max_batch_train` (train_step's own attempt) runs 20 `train_step`s with no retry from a
//! fresh engine, and 20 more at 4 × that batch from an engine seeded with `start_from_finder`
//! (each loop from an emptied cache, as the finder leaves it).

use candle_core::{DType, Device, Tensor};
use candle_nn::{AdamW, Module, Optimizer, ParamsAdamW, VarBuilder, VarMap};
use oomguard::retry::{Chunk, FinderOptions, RetryEngine};
use oomguard::source::MemorySource;
use oomguard_candle::{find_max_batch_train, memory_source, train_step};

const WIDTH: usize = 1024;

fn batch(rows: usize, dev: &Device) -> candle_core::Result<Vec<Tensor>> {
    let x = Tensor::randn(0f32, 1., (rows, WIDTH), dev)?;
    let y = Tensor::randn(0f32, 1., (rows, 1), dev)?;
    Ok(vec![x, y])
}

#[test]
#[ignore = "needs a CUDA device"]
fn the_train_finders_batch_runs_twenty_steps_without_a_retry_under_a_2_gib_budget() {
    let dev = Device::new_cuda(0).unwrap();
    let source = memory_source(&dev).unwrap();
    let _budget = source.budget(2 << 30).unwrap();
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F32, &dev);
    let l1 = candle_nn::linear(WIDTH, 4 * WIDTH, vb.pp("l1")).unwrap();
    let l2 = candle_nn::linear(4 * WIDTH, 4 * WIDTH, vb.pp("l2")).unwrap();
    let l3 = candle_nn::linear(4 * WIDTH, 1, vb.pp("l3")).unwrap();
    let forward = |x: &Tensor| -> candle_core::Result<Tensor> {
        let h = l1.forward(x)?.gelu()?;
        let h = l2.forward(&h)?.gelu()?;
        l3.forward(&h)
    };
    let loss = |_c: &Chunk, r: &[Tensor]| -> candle_core::Result<Tensor> {
        (forward(&r[0])? - &r[1])?.sqr()?.mean_all()
    };
    let params = vm.all_vars();
    // candle-nn's AdamW makes its moments when it is built: the finder measures them.
    let mut opt = AdamW::new(params.clone(), ParamsAdamW::default()).unwrap();
    let opts = FinderOptions {
        max: 1 << 20,
        ..Default::default()
    };
    let found =
        find_max_batch_train(&*source, opts, &params, |rows| batch(rows, &dev), loss).unwrap();
    let run = |engine: &RetryEngine, rows: usize, opt: &mut AdamW| {
        source.empty_cache().unwrap();
        let mut retries = 0;
        for step in 0..20 {
            let b = batch(rows, &dev).unwrap();
            let done = train_step(engine, &source, &[&b[0], &b[1]], &params, opt, loss).unwrap();
            assert_eq!(done.rows, rows);
            if done.report.retries() > 0 {
                println!("RETRIED step {step}: {}", done.report);
            }
            retries += done.report.retries();
        }
        retries
    };
    let fresh = run(&RetryEngine::new(), found.max_batch, &mut opt);
    let seeded = run(
        &RetryEngine::new().start_from_finder(&found),
        4 * found.max_batch,
        &mut opt,
    );
    println!(
        "RESULT route=find_max_batch_train max_batch={} batch_bytes_per_row={:?} accumulation_bytes={:?} seed_4x={} retries_fresh_20={fresh} retries_seeded_4x_20={seeded}",
        found.max_batch,
        found.batch_bytes_per_row,
        found.accumulation_bytes,
        found.micro_batch_for(4 * found.max_batch)
    );
    assert_eq!(fresh, 0, "{found}");
    // Seeded at 4 x, with room for the batch's tensors and one set of accumulated gradients,
    // then LARGER_BATCH_SHARE: on an H100 (2026-11-27, docs/GPU.md runs 49 and 51) the share
    // of 0.9 gave 5 micro-batches of 3,052 rows, which retried twice in 20 steps.
    assert_eq!(
        seeded,
        0,
        "seeded at 4 x {} rows: micro-batches of at most {}",
        found.max_batch,
        found.micro_batch_for(4 * found.max_batch)
    );
}
