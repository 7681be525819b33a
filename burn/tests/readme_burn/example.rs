use burn::backend::{Autodiff, NdArray};
use burn::nn::{Linear, LinearConfig};
use burn::optim::SgdConfig;
use burn::tensor::{Distribution, Tensor};
use oomguard::retry::RetryEngine;
use oomguard_burn::{chunk_rows, memory_source, train_step};
use std::sync::Arc;

type B = Autodiff<NdArray>; // on a GPU: Autodiff<burn::backend::Cuda> (feature `cuda`)

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dev = Default::default();
    // The memory the step runs in: a CUDA device's cubecl pools; ndarray has none, so this
    // example watches a simulated 1 GiB card instead.
    let source: Arc<dyn oomguard::MemorySource> = memory_source::<B>(&dev)
        .unwrap_or_else(|_| Arc::new(oomguard::Device::sim(oomguard::ByteSize::gib(1))));

    let mut model: Linear<B> = LinearConfig::new(4, 1).init(&dev);
    let mut sgd = SgdConfig::new().init();
    let x = Tensor::<B, 2>::random([64, 4], Distribution::Normal(0., 1.), &dev);
    let y = x.clone().matmul(Tensor::from_floats([[1.0], [2.0], [3.0], [4.0]], &dev));
    let engine = RetryEngine::new();
    for _ in 0..200 {
        // On OOM the step reruns as more, smaller micro-batches (each chunk's mean loss weighted
        // by its share of the batch); the optimizer steps once, after every micro-batch succeeded.
        let step = train_step(&engine, &source, 64, &mut model, &mut sgd, 0.05, |m, chunk| {
            let pred = m.forward(chunk_rows(&x, chunk)?);
            Ok((pred - chunk_rows(&y, chunk)?).powi_scalar(2).mean()) // the chunk's mean loss
        })?;
        assert_eq!(step.rows, 64); // every row is trained on, however the batch was split
    }
    let w: Vec<f32> = model.weight.val().into_data().to_vec()?;
    assert!((w[3] - 4.0).abs() < 0.05, "{w:?}");
    println!("{}", source.memory_summary());
    Ok(())
}
