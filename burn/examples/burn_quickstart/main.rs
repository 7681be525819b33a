//! A burn training loop that survives out-of-memory, to copy: an MLP trained with AdamW by
//! `train_step` under a memory budget, its retry engine seeded by `find_max_batch_train`.
//! Exits non-zero unless the loss fell by half and every parameter changed. CPU (CI runs it):
//! `cargo run -p oomguard-burn --example burn_quickstart` (burn's ndarray; a simulated card
//! stands for the GPU). GPU: add `--release --features cuda` (cubecl's pools are measured).

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{activation::relu, backend::Backend, Distribution, Tensor, TensorData};
use oomguard::retry::{Chunk, FinderOptions, RetryEngine};
use oomguard::train::LossCurve;
use oomguard::{ByteSize, MemorySource};
use oomguard_burn::{chunk_rows, find_max_batch_train, memory_source, train_step, Error};
use std::sync::Arc;

#[cfg(not(feature = "cuda"))]
type B = burn::backend::Autodiff<burn::backend::NdArray>;
#[cfg(feature = "cuda")]
type B = burn::backend::Autodiff<burn::backend::Cuda>;

/// Linear, relu, linear: differentiable ops only, so every parameter gets a gradient.
#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    l1: Linear<B>,
    l2: Linear<B>,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dev = Default::default();
    // The memory the step runs in: cubecl's pools on a GPU; ndarray has none, so a simulated card
    // stands for the GPU. Sizes whose whole batch exceeds the budget there (2.2 GiB; 560 KiB).
    let gpu = cfg!(feature = "cuda");
    let card = oomguard::Device::sim(ByteSize::gib(1));
    let (source, [batch, inputs, hidden, budget_kib]): (Arc<dyn MemorySource>, _) = match gpu {
        true => (memory_source::<B>(&dev)?, [1 << 16, 256, 2048, 1 << 20]),
        false => (Arc::new(card.clone()), [512, 16, 64, 256]),
    };
    // Charged per row: what a GPU holds (input, hidden before and after relu, gradients, output).
    let row_bytes = (inputs + 4 * hidden + 2) * 4 * usize::from(!gpu);
    let l1 = LinearConfig::new(inputs, hidden).init(&dev);
    let l2 = LinearConfig::new(hidden, 1).init(&dev);
    let mut model: Mlp<B> = Mlp { l1, l2 };
    let mut opt = burn::optim::AdamWConfig::new().init();
    // Rows of a target the MLP can learn: relu of a fixed projection.
    let w = Tensor::<B, 2>::random([inputs, 1], Distribution::Normal(0., 1.), &dev);
    let rows_of = |n| -> Result<[Tensor<B, 2>; 2], Error> {
        let x = Tensor::random([n, inputs], Distribution::Normal(0., 1.), &dev);
        Ok([x.clone(), relu(x.matmul(w.clone()))])
    };
    // The micro-batch's mean squared error: a per-row mean, as train_step requires.
    let loss = |m: &Mlp<B>, chunk: &Chunk, b: &[Tensor<B, 2>; 2]| {
        let _activations = card.alloc::<u8>(chunk.len() * row_bytes)?;
        let h = relu(m.l1.forward(chunk_rows(&b[0], chunk)?));
        let e = m.l2.forward(h) - chunk_rows(&b[1], chunk)?;
        Ok(e.powi_scalar(2).mean())
    };
    let data = rows_of(batch)?;
    let on_data = |m: &Mlp<B>, chunk: &Chunk| loss(m, chunk, &data);
    let before = values(&model);
    let _budget = source.budget(budget_kib as u64 * 1024)?;
    let (mut engine, mut curve) = (RetryEngine::new(), LossCurve::new());
    for step in 0..60 {
        let done = train_step(&engine, &source, batch, &mut model, &mut opt, 1e-2, on_data)?;
        if step == 0 {
            println!("step 0: {}", done.report);
            // burn's AdamW made its moments in that step, so the finder now measures them: the
            // largest batch train_step's own attempt runs in (it trains nothing). Seeded with it,
            // the next steps start as micro-batches that fit, with no failed attempt.
            let found =
                find_max_batch_train(&*source, FinderOptions::default(), &model, rows_of, &loss)?;
            println!("find_max_batch_train: {} rows fit", found.max_batch);
            engine = RetryEngine::new().start_from_finder(&found);
        }
        curve.push(&done);
    }
    println!("{curve}");
    curve.check_fell_by(2.0)?; // the job is real: the loss fell by half
    let after = values(&model);
    if let Some(i) = (0..before.len()).find(|&i| before[i] == after[i]) {
        return Err(format!("parameter {i} (in the model's order) did not change").into());
    }
    println!("the loss fell and all {} parameters changed", before.len());
    Ok(())
}

/// The values of every float parameter of `model`, in the model's order.
fn values(model: &Mlp<B>) -> Vec<TensorData> {
    struct Values(Vec<TensorData>);
    impl ModuleVisitor<B> for Values {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            self.0.push(p.val().into_data());
        }
    }
    let mut v = Values(Vec::new());
    model.visit(&mut v);
    v.0
}
