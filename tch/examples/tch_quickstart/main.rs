//! A tch training loop kept alive through out-of-memory, to copy: a small MLP trained with AdamW
//! by `oomguard_tch::train_step` under a memory budget, with a leak check per step, and
//! `find_max_batch` for the largest batch the budget holds.
//!
//! - On CPU (any machine; CI runs it): `cargo run --example tch_quickstart` in `tch/`. A CPU
//!   never runs out of memory here, so a simulated card stands for the GPU: it is the memory
//!   source, and each chunk charges it for the bytes its tensors would take on a GPU.
//! - On a GPU: the same command (`--release`). libtorch's own CUDA caching allocator is the
//!   memory source (`LibtorchCudaSource`): the budget is libtorch's per-process memory fraction,
//!   and the leak check and the finder read libtorch's statistics; nothing is charged.
//!
//! Exits non-zero unless the loss fell by half and every parameter changed.

use std::error::Error;
use std::sync::Arc;

use oomguard::retry::FinderOptions;
use oomguard::source::guards::UsageLeakCheck;
use oomguard::source::MemorySource;
use oomguard::{ByteSize, RetryEngine};
use oomguard_tch::{find_max_batch, train_step, LibtorchCudaSource};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

/// Where the tensors live, and sizes that make the whole batch exceed the budget there.
struct Setup {
    dev: Device,
    /// What train_step, the budget, the leak check and the finder measure: libtorch's CUDA
    /// allocator on a GPU, the simulated card on the CPU.
    source: Arc<dyn MemorySource>,
    /// The simulated card (CPU only): each chunk charges it for its tensors' bytes on a GPU.
    card: Option<oomguard::Device>,
    batch: i64,
    inputs: i64,
    hidden: i64,
    budget: ByteSize,
}

impl Setup {
    /// On the simulated card, charges `bytes` for as long as the guard lives (the tensors a
    /// micro-batch would hold on a GPU); on a GPU the real tensors are what libtorch counts.
    fn charge(&self, bytes: usize) -> Result<Option<oomguard::DeviceBuffer<u8>>, oomguard::Error> {
        self.card.as_ref().map(|c| c.alloc::<u8>(bytes)).transpose()
    }
}

fn setup() -> Result<Setup, Box<dyn Error>> {
    if tch::Cuda::is_available() {
        // About 2.2 GiB of activations for the whole batch (plus libtorch's CUDA context and
        // cuBLAS workspace): under a 1 GiB budget the step needs micro-batches.
        return Ok(Setup {
            dev: Device::Cuda(0),
            source: LibtorchCudaSource::new(0)?.register(),
            card: None,
            batch: 1 << 16,
            inputs: 256,
            hidden: 2048,
            budget: ByteSize::gib(1),
        });
    }
    // About 560 KiB of activations for the whole batch: 256 KiB needs micro-batches.
    let card = oomguard::Device::sim(ByteSize::gib(1));
    Ok(Setup {
        dev: Device::Cpu,
        source: Arc::new(card.clone()),
        card: Some(card),
        batch: 512,
        inputs: 16,
        hidden: 64,
        budget: ByteSize::kib(256),
    })
}

/// Differentiable ops only (linear, relu): every parameter gets a gradient.
#[derive(Debug)]
struct Mlp {
    l1: nn::Linear,
    l2: nn::Linear,
}

impl Mlp {
    fn new(vs: &nn::Path<'_>, inputs: i64, hidden: i64) -> Self {
        Self {
            l1: nn::linear(vs / "l1", inputs, hidden, Default::default()),
            l2: nn::linear(vs / "l2", hidden, 1, Default::default()),
        }
    }
    /// The mean squared error of some rows: a per-row mean, as train_step requires.
    fn loss(&self, x: &Tensor, y: &Tensor) -> Result<Tensor, tch::TchError> {
        let pred = self.l2.forward(&self.l1.forward(x).f_relu()?);
        pred.f_mse_loss(y, tch::Reduction::Mean)
    }
}

fn main() -> Result<(), Box<dyn Error>> {
    let s = setup()?;
    let source = &s.source;
    println!("device: {:?}, memory source: {:?}", s.dev, source.info());
    tch::manual_seed(0);
    // Bytes a row's tensors would take on a GPU (input, hidden pre/post relu and their
    // gradients, output), charged to the simulated card.
    let row_bytes = ((s.inputs + 4 * s.hidden + 2) * 4) as usize;

    let vs = nn::VarStore::new(s.dev);
    let model = Mlp::new(&vs.root(), s.inputs, s.hidden);
    let mut opt = nn::AdamW::default().build(&vs, 1e-2)?;
    // A target the MLP can learn: relu of a fixed projection.
    let x = Tensor::f_randn([s.batch, s.inputs], (Kind::Float, s.dev))?;
    let w_true = Tensor::f_randn([s.inputs, 1], (Kind::Float, s.dev))?;
    let y = x.f_matmul(&w_true)?.f_relu()?;
    let before = named_copies(&vs);

    // The finder, under the same budget, on a copy of the model: each trial is a real step.
    {
        let _budget = source.budget(s.budget.bytes())?;
        let mut probe_vs = nn::VarStore::new(s.dev);
        let probe = Mlp::new(&probe_vs.root(), s.inputs, s.hidden);
        probe_vs.copy(&vs)?;
        let mut probe_opt = nn::AdamW::default().build(&probe_vs, 1e-2)?;
        let opts = FinderOptions {
            max: s.batch as usize,
            ..Default::default()
        };
        let found = find_max_batch(&**source, opts, |rows| {
            let _acts = s.charge(rows * row_bytes)?;
            let rows = rows as i64;
            let loss = probe.loss(&x.f_narrow(0, 0, rows)?, &y.f_narrow(0, 0, rows)?)?;
            probe_opt.zero_grad();
            loss.f_backward()?;
            probe_opt.step();
            Ok(loss.f_double_value(&[])?) // a read: the step's errors surface here
        })?;
        println!(
            "find_max_batch: {} rows fit in {}",
            found.max_batch, s.budget
        );
    }
    source.empty_cache()?;

    let engine = RetryEngine::new();
    let mut losses = Vec::new();
    for step in 0..60 {
        // Per step: the budget caps what the step may hold; the leak check fails the run if
        // the step keeps a tensor alive. Not on step 0: libtorch makes AdamW's moments at its
        // first update (and, on a GPU, cuBLAS's workspace at the first matmul), memory that
        // lives as long as the optimizer (the process), not a leak of the step.
        let _budget = source.budget(s.budget.bytes())?;
        let check = (step > 0)
            .then(|| UsageLeakCheck::new(&**source))
            .transpose()?;
        let done = train_step(&engine, source, &[&x, &y], &vs, &mut opt, |chunk, rows| {
            let _acts = s.charge(chunk.len() * row_bytes)?;
            Ok(model.loss(&rows[0], &rows[1])?)
        })?;
        if let Some(check) = check {
            let leak = check.finish()?;
            if leak.exceeds_allowance() {
                return Err(format!("step {step} kept memory alive: {leak}").into());
            }
        }
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
    for ((name, old), (_, new)) in before.iter().zip(named_copies(&vs)) {
        let moved = (old - new).abs().max().double_value(&[]);
        if !moved.is_finite() || moved <= 0.0 {
            return Err(format!("parameter {name} did not change").into());
        }
    }
    println!("the loss fell and all {} parameters changed", before.len());
    println!("{}", source.memory_summary());
    Ok(())
}

/// Copies of the variables, by name, in name order.
fn named_copies(vs: &nn::VarStore) -> Vec<(String, Tensor)> {
    let mut v: Vec<_> = vs
        .variables()
        .into_iter()
        .map(|(name, t)| (name, t.detach().copy()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}
