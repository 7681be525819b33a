use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Optimizer, SGD};
use oomguard::retry::{Chunk, FinderOptions, RetryEngine};
use oomguard::MemorySource;
use oomguard_candle::{charge, find_max_batch_train, memory_source, train_step};
use std::sync::Arc;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dev = Device::Cpu; // on a GPU: Device::new_cuda(0)?
    // The memory the step runs in: a CUDA device's driver pool. A CPU device has none, so a
    // simulated 256 MiB card stands for the GPU, charged 4 MiB per row of a micro-batch.
    let card = oomguard::Device::sim(oomguard::ByteSize::mib(256));
    let (source, row_bytes): (Arc<dyn MemorySource>, usize) = match memory_source(&dev) {
        Ok(pool) => (pool, 0),
        Err(_) => (Arc::new(card.clone()), 4 << 20),
    };

    let w = Var::zeros((4, 1), DType::F32, &dev)?;
    let mut opt = SGD::new(vec![w.clone()], 0.05)?;
    let w_true = Tensor::new(&[[1f32], [2.], [3.], [4.]], &dev)?;
    let batch = |rows: usize| -> candle_core::Result<Vec<Tensor>> {
        let x = Tensor::randn(0f32, 1., (rows, 4), &dev)?;
        let y = x.matmul(&w_true)?;
        Ok(vec![x, y])
    };
    // The loss of one micro-batch, given its rows of the batch's tensors.
    let loss = |chunk: &Chunk, rows: &[Tensor]| {
        let _activations = charge(&card, chunk.len() * row_bytes)?; // what a GPU would hold
        let pred = rows[0].matmul(w.as_tensor())?;
        (pred - &rows[1])?.sqr()?.mean_all() // the chunk's per-row MEAN loss, a scalar
    };
    // The largest batch train_step's own attempt runs with (about 60 rows here); it trains
    // nothing. Steps then start from micro-batches of that size instead of failing down to it.
    let opts = FinderOptions { max: 4096, ..Default::default() };
    let found = find_max_batch_train(&*source, opts, &w, batch, loss)?;
    let engine = RetryEngine::new().start_from_finder(&found);
    for _ in 0..100 {
        let b = batch(256)?;
        // The batch is its tensors' rows (256). On OOM the step reruns as more, smaller
        // micro-batches, each weighted by its share of the batch; the optimizer steps once,
        // after every micro-batch succeeded.
        let step = train_step(&engine, &source, &[&b[0], &b[1]], &w, &mut opt, loss)?;
        assert_eq!((step.rows, step.report.retries()), (256, 0)); // every row, no retry
    }
    let w = w.as_tensor().flatten_all()?.to_vec1::<f32>()?;
    assert!((w[3] - 4.0).abs() < 0.05, "{w:?}");
    println!("{} rows fit; {}", found.max_batch, source.memory_summary());
    Ok(())
}
