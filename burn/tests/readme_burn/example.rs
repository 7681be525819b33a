use burn::backend::{Autodiff, NdArray};
use burn::nn::{Linear, LinearConfig};
use burn::optim::SgdConfig;
use burn::tensor::{Distribution, Tensor};
use oomguard::retry::{Chunk, FinderOptions, RetryEngine};
use oomguard::MemorySource;
use oomguard_burn::{chunk_rows, find_max_batch_train, memory_source, train_step, Error};
use std::sync::Arc;

type B = Autodiff<NdArray>; // on a GPU: Autodiff<burn::backend::Cuda> (feature `cuda`)

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dev = Default::default();
    // The memory the step runs in: a CUDA device's cubecl pools. ndarray has none, so a
    // simulated 256 MiB card stands for the GPU, charged 4 MiB per row of a micro-batch.
    let card = oomguard::Device::sim(oomguard::ByteSize::mib(256));
    let (source, row_bytes): (Arc<dyn MemorySource>, usize) = match memory_source::<B>(&dev) {
        Ok(pools) => (pools, 0),
        Err(_) => (Arc::new(card.clone()), 4 << 20),
    };

    let mut model: Linear<B> = LinearConfig::new(4, 1).init(&dev);
    let mut sgd = SgdConfig::new().init();
    let w_true = Tensor::<B, 2>::from_floats([[1.0], [2.0], [3.0], [4.0]], &dev);
    let batch = |rows: usize| -> Result<[Tensor<B, 2>; 2], Error> {
        let x = Tensor::<B, 2>::random([rows, 4], Distribution::Normal(0., 1.), &dev);
        let y = x.clone().matmul(w_true.clone());
        Ok([x, y])
    };
    // The loss of one micro-batch of the batch `b`: its mean loss.
    let loss = |m: &Linear<B>, chunk: &Chunk, b: &[Tensor<B, 2>; 2]| {
        let _activations = card.alloc::<u8>(chunk.len() * row_bytes)?; // what a GPU would hold
        let pred = m.forward(chunk_rows(&b[0], chunk)?);
        Ok((pred - chunk_rows(&b[1], chunk)?).powi_scalar(2).mean())
    };
    // The largest batch train_step's own attempt runs with (about 60 rows here); it trains
    // nothing. Steps then start from micro-batches of that size instead of failing down to it.
    let opts = FinderOptions { max: 4096, ..Default::default() };
    let found = find_max_batch_train(&*source, opts, &model, batch, loss)?;
    let engine = RetryEngine::new().start_from_finder(&found);
    for _ in 0..100 {
        let b = batch(256)?;
        // On OOM the step reruns as more, smaller micro-batches (each chunk's mean loss weighted
        // by its share of the batch); the optimizer steps once, after every micro-batch succeeded.
        let step = train_step(&engine, &source, 256, &mut model, &mut sgd, 0.05, |m, chunk| {
            loss(m, chunk, &b)
        })?;
        assert_eq!((step.rows, step.report.retries()), (256, 0)); // every row, no retry
    }
    let w: Vec<f32> = model.weight.val().into_data().to_vec()?;
    assert!((w[3] - 4.0).abs() < 0.05, "{w:?}");
    println!("{} rows fit; {}", found.max_batch, source.memory_summary());
    Ok(())
}
