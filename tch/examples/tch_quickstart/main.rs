//! A tch training loop that survives out-of-memory, to copy: an MLP trained with AdamW by
//! `train_step` under a memory budget, with a leak check per step, its retry engine seeded by
//! `find_max_batch_train`, so that a batch too large for the budget starts as micro-batches.
//! Exits non-zero unless the loss fell by half and every parameter changed.
//!
//! `cargo run --example tch_quickstart` in `tch/` (CI runs it on CPU, where a simulated card
//! stands for the GPU). On a GPU, libtorch's CUDA caching allocator is the memory source.

use oomguard::retry::{Chunk, FinderOptions, RetryEngine};
use oomguard::source::{guards::UsageLeakCheck, MemorySource};
use oomguard::train::LossCurve;
use oomguard::ByteSize;
use oomguard_tch::{charge, find_max_batch_train, train_step, LibtorchCudaSource};
use std::collections::HashMap;
use std::sync::Arc;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    tch::manual_seed(0);
    let dev = Device::cuda_if_available();
    // The memory the step runs in: libtorch's caching allocator on a GPU; a simulated card on a
    // CPU. Sizes whose whole batch exceeds the budget there (2.2 GiB; 560 KiB).
    let card = oomguard::Device::sim(ByteSize::gib(1));
    let (source, [batch, inputs, hidden, budget_kib]): (Arc<dyn MemorySource>, _) = match dev {
        Device::Cuda(i) => (
            LibtorchCudaSource::new(i)?.register(),
            [1 << 16, 256, 2048, 1 << 20],
        ),
        _ => (Arc::new(card.clone()), [512, 16, 64, 256]),
    };
    println!("device: {dev:?}, memory: {}", source.info().device_name);
    // Charged per row: what a GPU holds (input, hidden before and after relu, gradients, output).
    let row_bytes = (inputs + 4 * hidden + 2) as usize * 4 * usize::from(!dev.is_cuda());
    let vs = nn::VarStore::new(dev);
    // An MLP of tch's layers: differentiable ops only, so every parameter gets a gradient.
    let p = vs.root();
    let model = nn::seq()
        .add(nn::linear(&p / "l1", inputs, hidden, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(&p / "l2", hidden, 1, Default::default()));
    let mut opt = nn::AdamW::default().build(&vs, 1e-2)?;
    // Rows of a target the MLP can learn: relu of a fixed projection.
    let w = Tensor::f_randn([inputs, 1], (Kind::Float, dev))?;
    let rows_of = |n: usize| -> Result<Vec<Tensor>, oomguard_tch::Error> {
        let x = Tensor::f_randn([n as i64, inputs], (Kind::Float, dev))?;
        let y = x.f_matmul(&w)?.f_relu()?;
        Ok(vec![x, y])
    };
    // The micro-batch's mean squared error: a per-row mean, as train_step requires.
    let loss = |chunk: &Chunk, rows: &[Tensor]| {
        let _activations = charge(&card, chunk.len() * row_bytes)?;
        let pred = model.forward(&rows[0]);
        Ok(pred.f_mse_loss(&rows[1], tch::Reduction::Mean)?)
    };
    let before = copies(&vs);

    let _budget = source.budget(budget_kib as u64 * 1024)?;
    // The largest batch train_step's own attempt runs in, within the budget; it trains nothing.
    let opts = FinderOptions::default();
    let found = find_max_batch_train(&*source, opts, &vs, &mut opt, rows_of, loss)?;
    println!("find_max_batch_train: {} rows fit", found.max_batch);
    // Seeded: a step of the whole batch starts as micro-batches that fit, with no failed attempt.
    let engine = RetryEngine::new().start_from_finder(&found);
    let data = rows_of(batch as usize)?;
    let mut curve = LossCurve::new();
    for step in 0..60 {
        // From step 1 on, an error if the step kept memory alive: step 0 makes AdamW's moments
        // (and, on a GPU, cuBLAS's workspace), which live as long as the optimizer.
        let check = UsageLeakCheck::new(&*source)?;
        let done = train_step(&engine, &source, &[&data[0], &data[1]], &vs, &mut opt, loss)?;
        if step == 0 {
            println!("step 0: {}", done.report);
        } else {
            check.finish_strict()?;
        }
        curve.push(&done);
    }
    println!("{curve}");
    curve.check_fell_by(2.0)?; // the job is real: the loss fell by half
    for (name, new) in copies(&vs) {
        let moved = (&before[&name] - new).abs().max().double_value(&[]);
        if !moved.is_finite() || moved <= 0.0 {
            return Err(format!("parameter {name} did not change").into());
        }
    }
    println!("the loss fell and all {} parameters changed", before.len());
    println!("{}", source.memory_summary());
    Ok(())
}

/// Copies of the variables' values, by name.
fn copies(vs: &nn::VarStore) -> HashMap<String, Tensor> {
    let vars = vs.variables().into_iter();
    vars.map(|(name, t)| (name, t.detach().copy())).collect()
}
