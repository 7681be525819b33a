//! A candle training loop that survives out-of-memory, to copy: an MLP trained with AdamW by
//! `train_step` under a memory budget, with a leak check per step, its retry engine seeded by
//! `find_max_batch_train`, so that a batch too large for the budget starts as micro-batches.
//! Exits non-zero unless the loss fell by half and every parameter changed.
//!
//! CPU (CI runs it): `cargo run -p oomguard-candle --example candle_quickstart`; a simulated card
//! stands for the GPU, charged for what each micro-batch's tensors would take there. GPU: add
//! `--release --features allocator-hook`; oomguard's allocator then serves candle's CUDA tensors.

use std::error::Error;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{linear, Activation, AdamW, VarBuilder, VarMap};
use oomguard::retry::{Chunk, FinderOptions, RetryEngine};
use oomguard::train::LossCurve;
use oomguard::ByteSize;
use oomguard_candle::{charge, find_max_batch_train, train_step};

/// The tensors' device, the memory the step is measured on, and sizes whose whole batch
/// exceeds the budget there: [rows, inputs, hidden, budget in KiB].
fn setup() -> Result<(Device, oomguard::Device, [usize; 4]), Box<dyn Error>> {
    #[cfg(feature = "allocator-hook")]
    if let Ok(dev) = Device::new_cuda(0) {
        // Before the model is made, so that every candle CUDA tensor is an oomguard block.
        let memory = oomguard_candle::alloc_hook::install(&dev)?;
        return Ok((dev, memory, [1 << 16, 256, 2048, 1 << 20])); // 2.2 GiB a batch
    }
    let card = oomguard::Device::sim(ByteSize::gib(1));
    Ok((Device::Cpu, card, [512, 16, 64, 256])) // 560 KiB a batch
}

fn main() -> Result<(), Box<dyn Error>> {
    let (dev, memory, [batch, inputs, hidden, budget_kib]) = setup()?;
    println!("device: {dev:?}, simulated card: {}", dev.is_cpu());
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
    // An MLP of candle-nn's layers: differentiable ops only, so every parameter gets a gradient.
    let model = candle_nn::seq()
        .add(linear(inputs, hidden, vb.pp("l1"))?)
        .add(Activation::Relu)
        .add(linear(hidden, 1, vb.pp("l2"))?);
    // AdamW makes its moments when built, so the finder below measures them.
    let mut opt = AdamW::new_lr(varmap.all_vars(), 1e-2)?;
    // A target the MLP can learn: relu of a fixed projection.
    let x = Tensor::randn(0f32, 1., (batch, inputs), &dev)?;
    let y = x.matmul(&Tensor::randn(0f32, 1., (inputs, 1), &dev)?)?;
    let y = y.relu()?;
    // What a GPU holds per row (input, hidden layer before and after relu, their gradients,
    // output), charged to the simulated card; on a GPU the real tensors count (0 charged).
    let row_bytes = (inputs + 4 * hidden + 2) * 4 * usize::from(dev.is_cpu());
    // The micro-batch's mean squared error: a per-row mean, as train_step requires.
    let loss = |chunk: &Chunk, rows: &[Tensor]| {
        let _activations = charge(&memory, chunk.len() * row_bytes)?;
        (model.forward(&rows[0])? - &rows[1])?.sqr()?.mean_all()
    };
    let before = copies(&varmap)?;

    let _budget = memory.thread_budget(ByteSize::kib(budget_kib as u64));
    // The largest batch train_step's own attempt runs in, within the budget; it trains nothing.
    let opts = FinderOptions {
        max: batch,
        ..Default::default()
    };
    let rows_of = |n| Ok([x.narrow(0, 0, n)?, y.narrow(0, 0, n)?]);
    let found = find_max_batch_train(&memory, opts, &varmap, rows_of, &loss)?;
    println!("find_max_batch_train: {} rows fit", found.max_batch);
    // Seeded: a step of the whole batch starts as micro-batches that fit, with no failed attempt.
    let engine = RetryEngine::new().start_from_finder(&found);
    let mut curve = LossCurve::new();
    for step in 0..60 {
        let check = memory.leak_check(); // an error if the step keeps a tensor alive
        let done = train_step(&engine, &memory, &[&x, &y], &varmap, &mut opt, &loss)?;
        check.finish()?;
        if step == 0 {
            println!("step 0: {}", done.report);
        }
        curve.push(&done);
    }
    println!("{curve}");
    curve.check_fell_by(2.0)?; // the job is real: the loss fell by half
    for ((name, old), (_, new)) in before.iter().zip(copies(&varmap)?) {
        let moved = (old - &new)?.abs()?.max_all()?.to_scalar::<f32>()?;
        if !moved.is_finite() || moved <= 0.0 {
            return Err(format!("parameter {name} did not change").into());
        }
    }
    println!("the loss fell and all {} parameters changed", before.len());
    Ok(())
}

/// Copies of the parameters, by name (the same order each time: the map is not changed).
fn copies(varmap: &VarMap) -> candle_core::Result<Vec<(String, Tensor)>> {
    let vars = varmap.data().lock().expect("the VarMap's lock");
    vars.iter()
        .map(|(n, v)| Ok((n.clone(), v.as_tensor().copy()?)))
        .collect()
}
