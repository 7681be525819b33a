use oomguard::retry::RetryEngine;
use oomguard::MemorySource;
use oomguard_tch::{train_step, LibtorchCudaSource};
use std::sync::Arc;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dev = Device::cuda_if_available();
    // The memory the step runs in: libtorch's CUDA caching allocator on a GPU; a CPU has none,
    // so this example watches a simulated 1 GiB card instead.
    let source: Arc<dyn MemorySource> = match dev {
        Device::Cuda(i) => LibtorchCudaSource::new(i)?.register(),
        _ => Arc::new(oomguard::Device::sim(oomguard::ByteSize::gib(1))),
    };

    let vs = nn::VarStore::new(dev);
    let model = nn::linear(vs.root() / "fc", 4, 1, Default::default());
    let mut sgd = nn::Sgd::default().build(&vs, 0.05)?;
    let x = Tensor::f_randn([64, 4], (Kind::Float, dev))?;
    let w_true = Tensor::from_slice(&[1f32, 2., 3., 4.]).view([4, 1]).to(dev);
    let y = x.f_matmul(&w_true)?;
    let engine = RetryEngine::new();
    for _ in 0..200 {
        // The batch is its tensors' rows (64). On OOM the step reruns as more, smaller
        // micro-batches, each weighted by its share of the batch (libtorch sums the gradients);
        // the optimizer steps once, after every micro-batch succeeded.
        let step = train_step(&engine, &source, &[&x, &y], &vs, &mut sgd, |_chunk, rows| {
            let pred = model.forward(&rows[0]);
            // the chunk's per-row MEAN loss, one value
            Ok(pred.f_mse_loss(&rows[1], tch::Reduction::Mean)?)
        })?;
        assert_eq!(step.rows, 64); // every row is trained on, however the batch was split
    }
    let w = Vec::<f32>::try_from(model.ws.flatten(0, -1).to(Device::Cpu))?;
    assert!((w[3] - 4.0).abs() < 0.05, "{w:?}");
    println!("{}", source.memory_summary());
    Ok(())
}
