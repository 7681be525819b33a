use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Optimizer, SGD};
use oomguard::retry::RetryEngine;
use oomguard_candle::{memory_source, train_step};
use std::sync::Arc;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dev = Device::Cpu; // on a GPU: Device::new_cuda(0)?
    // The memory the step runs in: a CUDA device's driver pool; a CPU device has none, so
    // this example watches a simulated 1 GiB card instead.
    let source: Arc<dyn oomguard::MemorySource> = memory_source(&dev)
        .unwrap_or_else(|_| Arc::new(oomguard::Device::sim(oomguard::ByteSize::gib(1))));

    let w = Var::zeros((4, 1), DType::F32, &dev)?;
    let mut opt = SGD::new(vec![w.clone()], 0.05)?;
    let x = Tensor::randn(0f32, 1., (64, 4), &dev)?;
    let y = x.matmul(&Tensor::new(&[[1f32], [2.], [3.], [4.]], &dev)?)?;
    let engine = RetryEngine::new();
    for _ in 0..200 {
        // The batch is its tensors' rows (64). On OOM the step reruns as more, smaller
        // micro-batches, each weighted by its share of the batch; the optimizer steps once,
        // after every micro-batch succeeded. `rows` are the chunk's rows of `x` and `y`.
        let step = train_step(&engine, &source, &[&x, &y], &w, &mut opt, |_chunk, rows| {
            let pred = rows[0].matmul(w.as_tensor())?;
            (pred - &rows[1])?.sqr()?.mean_all() // the chunk's per-row MEAN loss, a scalar
        })?;
        assert_eq!(step.rows, 64); // every row is trained on, however the batch was split
    }
    let w = w.as_tensor().flatten_all()?.to_vec1::<f32>()?;
    assert!((w[3] - 4.0).abs() < 0.05, "{w:?}");
    println!("{}", source.memory_summary());
    Ok(())
}
