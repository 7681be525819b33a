use oomguard::retry::{Chunk, FinderOptions, RetryEngine};
use oomguard::source::{guards::UsageLeakCheck, MemorySource};
use oomguard_tch::{charge, find_max_batch_train, train_step, LibtorchCudaSource};
use std::sync::Arc;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dev = Device::cuda_if_available();
    // The memory the step runs in: libtorch's CUDA caching allocator on a GPU. A CPU has none,
    // so a simulated 1 GiB card stands for the GPU, charged 4 MiB per row of a micro-batch.
    let card = oomguard::Device::sim(oomguard::ByteSize::gib(1));
    let (source, row_bytes): (Arc<dyn MemorySource>, usize) = match dev {
        Device::Cuda(i) => (LibtorchCudaSource::new(i)?.register(), 0),
        _ => (Arc::new(card.clone()), 4 << 20),
    };
    let vs = nn::VarStore::new(dev);
    let model = nn::linear(vs.root() / "fc", 4, 1, Default::default());
    let mut sgd = nn::Sgd::default().build(&vs, 0.05)?;
    let w_true = Tensor::from_slice(&[1f32, 2., 3., 4.]).view([4, 1]).to(dev);
    let batch = |rows: usize| -> Result<Vec<Tensor>, oomguard_tch::Error> {
        let x = Tensor::f_randn([rows as i64, 4], (Kind::Float, dev))?;
        let y = x.f_matmul(&w_true)?;
        Ok(vec![x, y])
    };
    // The loss of one micro-batch: its per-row MEAN loss, one value.
    let loss = |chunk: &Chunk, rows: &[Tensor]| {
        let _activations = charge(&card, chunk.len() * row_bytes)?; // what a GPU would hold
        Ok(model.forward(&rows[0]).f_mse_loss(&rows[1], tch::Reduction::Mean)?)
    };
    // The step may hold 256 MiB (libtorch's memory fraction on a GPU): 256 rows do not fit.
    let _budget = source.budget(256 << 20)?;
    // The largest batch train_step's own attempt runs with; it trains nothing.
    let opts = FinderOptions { max: 4096, ..Default::default() };
    let found = find_max_batch_train(&*source, opts, &vs, &mut sgd, batch, loss)?;
    // Steps start from micro-batches of that size instead of failing their way down to it.
    let engine = RetryEngine::new().start_from_finder(&found);
    for step in 0..100 {
        let b = batch(256)?;
        // From step 1 on: the step must give back all it took (step 0 makes the gradients).
        let check = (step > 0).then(|| UsageLeakCheck::new(&*source)).transpose()?;
        let done = train_step(&engine, &source, &[&b[0], &b[1]], &vs, &mut sgd, loss)?;
        assert_eq!((done.rows, done.report.retries()), (256, 0)); // every row, no retry
        drop(b);
        if let Some(check) = check {
            check.finish_strict()?; // an error if the step kept memory alive
        }
    }
    let w = Vec::<f32>::try_from(model.ws.flatten(0, -1).to(Device::Cpu))?;
    assert!((w[3] - 4.0).abs() < 0.05, "{w:?}");
    println!("{} rows fit; {}", found.max_batch, source.memory_summary());
    Ok(())
}
