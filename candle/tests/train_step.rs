//! `train_step`, `GradAccumulator` and the batch splitting on CPU tensors. Out-of-memory comes
//! from a simulated device that the loss closure charges for its "activations" (bytes per row),
//! as a GPU would: the engine must split the batch, accumulate exactly, and step once.

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Optimizer, SGD};
use oomguard::retry::{BatchPlan, RetryEngine};
use oomguard::{ByteSize, IsOom};
use oomguard_candle::{chunk_rows, split_rows, train_step, GradAccumulator, TrainStepError};

/// A linear regression batch: 64 rows of 4 features.
fn data() -> (Tensor, Tensor) {
    let x: Vec<f32> = (0..256)
        .map(|i| ((i * 37 % 101) as f32) / 50.0 - 1.0)
        .collect();
    let x = Tensor::from_vec(x, (64, 4), &Device::Cpu).unwrap();
    let w = Tensor::new(&[[1f32], [-2.], [3.], [0.5]], &Device::Cpu).unwrap();
    let y = x.matmul(&w).unwrap();
    (x, y)
}

/// The largest absolute element.
fn max_abs(t: &Tensor) -> f32 {
    t.abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

fn loss_of(w: &Var, x: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
    (x.matmul(w.as_tensor())? - y)?.sqr()?.mean_all()
}

/// Counts optimizer steps.
struct Counting(SGD, usize);
impl Optimizer for Counting {
    type Config = f64;
    fn new(vars: Vec<Var>, lr: f64) -> candle_core::Result<Self> {
        Ok(Self(SGD::new(vars, lr)?, 0))
    }
    fn step(&mut self, g: &candle_core::backprop::GradStore) -> candle_core::Result<()> {
        self.1 += 1;
        self.0.step(g)
    }
    fn learning_rate(&self) -> f64 {
        self.0.learning_rate()
    }
    fn set_learning_rate(&mut self, lr: f64) {
        self.0.set_learning_rate(lr)
    }
}

#[test]
fn accumulated_gradient_equals_the_whole_batch() {
    let (x, y) = data();
    let w = Var::from_tensor(&Tensor::new(&[[0.1f32], [0.2], [0.3], [0.4]], &Device::Cpu).unwrap())
        .unwrap();
    let whole = loss_of(&w, &x, &y).unwrap();
    let g_whole = whole
        .backward()
        .unwrap()
        .get(w.as_tensor())
        .unwrap()
        .clone();
    // 64 rows as chunks of 10, 10, ..., 4: unequal weights.
    let plan = BatchPlan::with_micro_batch(64, 10).unwrap();
    let mut acc = GradAccumulator::new(std::slice::from_ref(&w));
    for c in plan.chunks() {
        let l = loss_of(
            &w,
            &chunk_rows(&x, &c).unwrap(),
            &chunk_rows(&y, &c).unwrap(),
        )
        .unwrap();
        acc.backward(&l, &c).unwrap();
    }
    assert_eq!(acc.rows(), 64);
    let loss_whole = whole.to_scalar::<f32>().unwrap() as f64;
    assert!(
        (acc.loss() - loss_whole).abs() <= 1e-5 * loss_whole,
        "{} vs {loss_whole}",
        acc.loss()
    );
    let g = acc.into_grads().get(w.as_tensor()).unwrap().clone();
    let diff = max_abs(&(g - &g_whole).unwrap());
    let scale = max_abs(&g_whole);
    assert!(diff <= 1e-5 * scale, "max diff {diff} of {scale}");
}

#[test]
fn train_step_splits_on_oom_steps_once_and_matches_the_unsplit_run() {
    let (x, y) = data();
    let run = |capacity: ByteSize| {
        let sim = oomguard::Device::sim(capacity);
        let w = Var::zeros((4, 1), DType::F32, &Device::Cpu).unwrap();
        let mut opt = Counting::new(vec![w.clone()], 0.05).unwrap();
        let engine = RetryEngine::new();
        let mut reports = Vec::new();
        for _ in 0..5 {
            let done = train_step(
                &engine,
                &sim,
                64,
                std::slice::from_ref(&w),
                &mut opt,
                |chunk| {
                    // 1 MiB of activations per row, on the simulated card; its OOM reaches the
                    // engine boxed in `Error::Cuda`, as candle's own CUDA errors do.
                    let _acts = sim
                        .alloc::<u8>(chunk.len() << 20)
                        .map_err(|e| candle_core::Error::Cuda(Box::new(e)))?;
                    loss_of(&w, &chunk_rows(&x, chunk)?, &chunk_rows(&y, chunk)?)
                },
            )
            .unwrap();
            assert_eq!(done.rows, 64, "every row is trained on");
            reports.push(done.report);
        }
        (w.as_tensor().copy().unwrap(), opt.1, reports)
    };
    let (w_ample, steps_ample, r_ample) = run(ByteSize::gib(1));
    let (w_tight, steps_tight, r_tight) = run(ByteSize::mib(40));
    assert_eq!(steps_ample, 5);
    assert_eq!(
        steps_tight, 5,
        "the optimizer stepped once per call, retries or not"
    );
    assert!(r_ample.iter().all(|r| r.retries() == 0));
    assert!(
        r_tight[0].retries() >= 1,
        "40 MiB cannot hold 64 MiB of activations"
    );
    assert!(r_tight[0].final_plan.micro_batch() <= 40);
    assert!(r_tight[1..]
        .iter()
        .all(|r| r.retries() == 0 && r.from_memory));
    let diff = max_abs(&(&w_tight - &w_ample).unwrap());
    assert!(diff < 1e-5, "{w_tight} vs {w_ample}");
}

#[test]
fn a_wrapped_oom_is_classified_but_a_shape_error_is_not_retried() {
    let sim = oomguard::Device::sim(ByteSize::mib(1));
    let oom = candle_core::Error::wrap(sim.alloc::<u8>(2 << 20).unwrap_err());
    // `Error::wrap` keeps only Display: not classifiable, so not an OOM (no string matching).
    assert!(!oom.is_oom());
    let boxed = candle_core::Error::Cuda(Box::new(sim.alloc::<u8>(2 << 20).unwrap_err()));
    assert!(boxed.is_oom());

    let (x, y) = data();
    let w = Var::zeros((3, 1), DType::F32, &Device::Cpu).unwrap();
    let mut opt = Counting::new(vec![w.clone()], 0.05).unwrap();
    let err = train_step(
        &RetryEngine::new(),
        &sim,
        64,
        std::slice::from_ref(&w),
        &mut opt,
        |c| loss_of(&w, &chunk_rows(&x, c)?, &chunk_rows(&y, c)?),
    )
    .unwrap_err();
    assert!(matches!(err, TrainStepError::Retry(_)), "{err}");
    assert_eq!(opt.1, 0, "no update after a failed step");
}

#[test]
fn split_rows_checks_shapes() {
    let (x, y) = data();
    let plan = BatchPlan::with_micro_batch(64, 30).unwrap();
    let parts = split_rows(&[&x, &y], &plan).unwrap();
    assert_eq!(parts.len(), 3);
    let sizes: Vec<usize> = parts.iter().map(|p| p[0].dims()[0]).collect();
    assert_eq!(sizes.iter().sum::<usize>(), 64);
    assert!(sizes.iter().all(|&n| n <= 30), "{sizes:?}");
    assert!(parts
        .iter()
        .all(|p| p[0].dims()[1] == 4 && p[1].dims()[1] == 1));
    // the chunks are consecutive rows of the batch
    let back = Tensor::cat(&parts.iter().map(|p| p[0].clone()).collect::<Vec<_>>(), 0).unwrap();
    assert_eq!(back.to_vec2::<f32>().unwrap(), x.to_vec2::<f32>().unwrap());
    let short = x.narrow(0, 0, 10).unwrap();
    let e = split_rows(&[&short], &plan).unwrap_err();
    assert!(e.to_string().contains("10 rows"), "{e}");
    let c = plan.chunks().last().unwrap();
    assert!(chunk_rows(&short, &c).is_err());
    assert!(oomguard_candle::memory_source(&Device::Cpu).is_err());
}
