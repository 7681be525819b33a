//! A candle training loop kept alive through out-of-memory, to copy: a small MLP trained with
//! AdamW by `oomguard_candle::train_step` under a memory budget, with a leak check per step, and
//! `find_max_batch` for the largest batch the budget holds.
//!
//! - On CPU (any machine; CI runs it): `cargo run -p oomguard-candle --example candle_quickstart`.
//!   A CPU never runs out of memory, so a simulated card stands for the GPU: it is the memory
//!   source, and each chunk charges it for the bytes its tensors would take on a GPU.
//! - On a GPU: `cargo run --release -p oomguard-candle --features allocator-hook --example
//!   candle_quickstart`. oomguard's allocator then serves candle's CUDA tensors (the hook), so
//!   the budget, the leak check and the finder see the real tensors, and nothing is charged.
//!
//! Exits non-zero unless the loss fell by half and every parameter changed.

use std::error::Error;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{linear, AdamW, Linear, Optimizer, ParamsAdamW, VarBuilder, VarMap};
use oomguard::retry::{find_max_batch, FinderOptions};
use oomguard::{ByteSize, RetryEngine};
use oomguard_candle::{charge, train_step};

/// Where the tensors live, and sizes that make the whole batch exceed the budget there.
struct Setup {
    dev: Device,
    /// What train_step, the budget, the leak check and the finder measure.
    memory: oomguard::Device,
    /// CPU tensors: the step charges `memory` for what they would take on a GPU.
    simulated: bool,
    batch: usize,
    inputs: usize,
    hidden: usize,
    budget: ByteSize,
}

fn setup() -> Result<Setup, Box<dyn Error>> {
    #[cfg(feature = "allocator-hook")]
    if let Ok(dev) = Device::new_cuda(0) {
        // Before the model is made, so that every candle CUDA tensor is an oomguard block.
        let memory = oomguard_candle::alloc_hook::install(&dev)?;
        // About 2.2 GiB of activations for the whole batch: 1 GiB needs micro-batches.
        return Ok(Setup {
            dev,
            memory,
            simulated: false,
            batch: 1 << 16,
            inputs: 256,
            hidden: 2048,
            budget: ByteSize::gib(1),
        });
    }
    // About 560 KiB of activations for the whole batch: 256 KiB needs micro-batches.
    Ok(Setup {
        dev: Device::Cpu,
        memory: oomguard::Device::sim(ByteSize::gib(1)),
        simulated: true,
        batch: 512,
        inputs: 16,
        hidden: 64,
        budget: ByteSize::kib(256),
    })
}

/// Differentiable ops only (linear, relu): every parameter gets a gradient.
struct Mlp {
    l1: Linear,
    l2: Linear,
}

impl Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.l2.forward(&self.l1.forward(x)?.relu()?)
    }
    /// The mean squared error of some rows: a per-row mean, as train_step requires.
    fn loss(&self, x: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
        (self.forward(x)? - y)?.sqr()?.mean_all()
    }
}

fn main() -> Result<(), Box<dyn Error>> {
    let s = setup()?;
    println!("device: {:?}, simulated card: {}", s.dev, s.simulated);
    // Bytes a row's tensors would take on a GPU (input, hidden pre/post relu and their
    // gradients, output), charged to the simulated card.
    let row_bytes = (s.inputs + 4 * s.hidden + 2) * 4;
    let charge_rows = |rows: usize| -> candle_core::Result<_> {
        match s.simulated {
            true => charge(&s.memory, rows * row_bytes).map(Some),
            false => Ok(None),
        }
    };

    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &s.dev);
    let model = Mlp {
        l1: linear(s.inputs, s.hidden, vb.pp("l1"))?,
        l2: linear(s.hidden, 1, vb.pp("l2"))?,
    };
    // AdamW makes its moments here, before any leak check: they live as long as it does.
    let mut opt = AdamW::new(
        varmap.all_vars(),
        ParamsAdamW {
            lr: 1e-2,
            ..Default::default()
        },
    )?;
    // A target the MLP can learn: relu of a fixed projection.
    let x = Tensor::randn(0f32, 1., (s.batch, s.inputs), &s.dev)?;
    let w_true = Tensor::randn(0f32, 1., (s.inputs, 1), &s.dev)?;
    let y = x.matmul(&w_true)?.relu()?;
    let before: Vec<(String, Tensor)> = named_vars(&varmap)?;

    // The finder, under the same budget: forward and backward without the update, so that it
    // does not train the model it measures.
    {
        let _budget = s.memory.thread_budget(s.budget);
        let opts = FinderOptions {
            max: s.batch,
            ..Default::default()
        };
        let found = find_max_batch(&s.memory, opts, |rows| {
            let _acts = charge_rows(rows)?;
            let loss = model.loss(&x.narrow(0, 0, rows)?, &y.narrow(0, 0, rows)?)?;
            let _grads = loss.backward()?;
            loss.to_scalar::<f32>() // a read: the step's errors surface here
        })?;
        println!(
            "find_max_batch: {} rows fit in {}",
            found.max_batch, s.budget
        );
    }

    let engine = RetryEngine::new();
    let mut losses = Vec::new();
    for step in 0..60 {
        // Per step: the budget caps what the step may hold; the leak check fails the run if the
        // step keeps a tensor alive (AdamW updates the parameters in place: nothing is kept).
        let _budget = s.memory.thread_budget(s.budget);
        let check = s.memory.leak_check();
        let done = train_step(
            &engine,
            &s.memory,
            &[&x, &y],
            &varmap,
            &mut opt,
            |chunk, rows| {
                let _acts = charge_rows(chunk.len())?;
                model.loss(&rows[0], &rows[1])
            },
        )?;
        check.finish()?;
        if step == 0 || done.report.retries() > 0 {
            println!("step {step}: {}", done.report);
        }
        losses.push(done.loss);
    }
    let (first, last) = (losses[0], losses[losses.len() - 1]);
    println!("loss: {first:.4} -> {last:.4}");
    if !(last.is_finite() && last < first / 2.0) {
        return Err(format!("the loss did not fall by half: {first} -> {last}").into());
    }
    for ((name, old), (_, new)) in before.iter().zip(named_vars(&varmap)?) {
        let moved = (old - &new)?.abs()?.max_all()?.to_scalar::<f32>()?;
        if !moved.is_finite() || moved <= 0.0 {
            return Err(format!("parameter {name} did not change").into());
        }
    }
    println!("the loss fell and all {} parameters changed", before.len());
    Ok(())
}

/// Copies of the parameters, by name, in name order.
fn named_vars(varmap: &VarMap) -> candle_core::Result<Vec<(String, Tensor)>> {
    let data = varmap.data().lock().expect("the VarMap's lock");
    let mut v = data
        .iter()
        .map(|(name, var)| Ok((name.clone(), var.as_tensor().copy()?)))
        .collect::<candle_core::Result<Vec<_>>>()?;
    v.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(v)
}
