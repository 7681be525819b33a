use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Optimizer, SGD};
use oomguard::{ByteSize, IsOom, RetryEngine};
use oomguard_candle::{charge, train_step};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // A simulated 48 MiB card stands for the GPU: it is the step's memory source, and the loss
    // charges it 1 MiB per row for the activations the chunk would hold on a GPU.
    let card = oomguard::Device::sim(ByteSize::mib(48));
    let dev = Device::Cpu;
    let w = Var::zeros((4, 1), DType::F32, &dev)?;
    let mut opt = SGD::new(vec![w.clone()], 0.05)?;
    let x = Tensor::randn(0f32, 1., (100, 4), &dev)?;
    let y = x.matmul(&Tensor::new(&[[1f32], [2.], [3.], [4.]], &dev)?)?;
    let engine = RetryEngine::new();
    let step = |opt: &mut SGD| {
        train_step(&engine, &card, &[&x, &y], &w, opt, |chunk, rows| {
            // An OOM of the card comes back as a candle error that stays classified.
            let _activations = charge(&card, chunk.len() << 20)?;
            (rows[0].matmul(w.as_tensor())? - &rows[1])?.sqr()?.mean_all()
        })
    };
    let done = step(&mut opt)?;
    assert_eq!(done.rows, 100);
    assert!(done.report.retries() >= 1); // 100 MiB did not fit: split into micro-batches
    println!("{}", done.report);

    // A budget on the card gives a budget's OOM; under 1 MiB not even one row fits.
    let _budget = card.thread_budget(ByteSize::kib(512));
    let err = step(&mut opt).unwrap_err();
    assert!(err.is_oom() && err.is_budget_exceeded());
    Ok(())
}
