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
    let g = acc
        .into_grads()
        .unwrap()
        .get(w.as_tensor())
        .unwrap()
        .clone();
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
                &[&x, &y],
                std::slice::from_ref(&w),
                &mut opt,
                |chunk, rows| {
                    // 1 MiB of activations per row, on the simulated card; its OOM reaches the
                    // engine as a classified candle error, as candle's own CUDA errors do.
                    let _acts = oomguard_candle::charge(&sim, chunk.len() << 20)?;
                    loss_of(&w, &rows[0], &rows[1])
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
        &[&x, &y],
        std::slice::from_ref(&w),
        &mut opt,
        |_, rows| loss_of(&w, &rows[0], &rows[1]),
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

/// 100 rows, 1 MiB of "activations" per row charged to `sim`: `(w_after, optimizer steps, result)`.
fn hundred_rows(
    engine: &RetryEngine,
    sim: &oomguard::Device,
) -> (
    Tensor,
    usize,
    Result<oomguard_candle::TrainedStep, TrainStepError>,
) {
    let x = Tensor::ones((100, 4), DType::F32, &Device::Cpu).unwrap();
    let y = Tensor::ones((100, 1), DType::F32, &Device::Cpu).unwrap();
    let w = Var::zeros((4, 1), DType::F32, &Device::Cpu).unwrap();
    let mut opt = Counting::new(vec![w.clone()], 0.05).unwrap();
    let r = train_step(engine, sim, &[&x, &y], &w, &mut opt, |c, rows| {
        let _acts = oomguard_candle::charge(sim, c.len() << 20)?;
        loss_of(&w, &rows[0], &rows[1])
    });
    (w.as_tensor().copy().unwrap(), opt.1, r)
}

#[test]
fn an_engine_whose_policy_drops_rows_is_refused_before_anything_runs() {
    // On the old code this step returned Ok with 50 of 100 rows trained.
    let engine = RetryEngine::new().with_policy(oomguard::retry::inference_policy());
    let sim = oomguard::Device::sim(ByteSize::mib(40));
    let (w, steps, r) = hundred_rows(&engine, &sim);
    let err = r.unwrap_err();
    assert!(
        matches!(err, TrainStepError::PolicyDropsRows { batch: 100, proposed, .. } if proposed.batch() < 100),
        "{err}"
    );
    assert!(err.to_string().contains("never drops rows"), "{err}");
    assert!(!err.is_oom(), "not retryable by an outer layer");
    assert_eq!(steps, 0);
    assert_eq!(max_abs(&w), 0.0, "nothing was updated");
    // With ample memory too: the policy is refused, not the OOM.
    let (_, _, r) = hundred_rows(&engine, &oomguard::Device::sim(ByteSize::gib(1)));
    assert!(matches!(r, Err(TrainStepError::PolicyDropsRows { .. })));
}

#[test]
fn a_policy_that_drops_rows_only_when_it_runs_is_refused_when_it_proposes() {
    use oomguard::retry::{Accumulate, FnPolicy, RetryPolicy};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    // Keeps rows while train_step looks at it, drops half of them once the step has started.
    let armed = Arc::new(AtomicBool::new(false));
    let a = armed.clone();
    let policy = FnPolicy(move |ctx: &oomguard::retry::RetryContext| {
        if a.load(Ordering::SeqCst) {
            BatchPlan::with_micro_batch(ctx.plan.batch() / 2, ctx.plan.micro_batch()).ok()
        } else {
            Accumulate::halving().next_plan(ctx)
        }
    });
    let engine = RetryEngine::new().with_policy(policy);
    let sim = oomguard::Device::sim(ByteSize::mib(40));
    let x = Tensor::ones((100, 4), DType::F32, &Device::Cpu).unwrap();
    let y = Tensor::ones((100, 1), DType::F32, &Device::Cpu).unwrap();
    let w = Var::zeros((4, 1), DType::F32, &Device::Cpu).unwrap();
    let mut opt = Counting::new(vec![w.clone()], 0.05).unwrap();
    let err = train_step(&engine, &sim, &[&x, &y], &w, &mut opt, |c, rows| {
        armed.store(true, Ordering::SeqCst);
        let _acts = oomguard_candle::charge(&sim, c.len() << 20)?;
        loss_of(&w, &rows[0], &rows[1])
    })
    .unwrap_err();
    let TrainStepError::Retry(oomguard::retry::RetryError::GaveUp { report, .. }) = &err else {
        panic!("expected GaveUp, got {err}");
    };
    assert!(
        report.attempts.iter().all(|a| a.plan.batch() == 100),
        "no attempt ran fewer rows: {report}"
    );
    assert_eq!(opt.1, 0, "no update");
}

#[test]
fn the_batch_is_the_rows_of_its_tensors() {
    let sim = oomguard::Device::sim(ByteSize::mib(40));
    let w = Var::zeros((4, 1), DType::F32, &Device::Cpu).unwrap();
    let mut opt = Counting::new(vec![w.clone()], 0.05).unwrap();
    let x = Tensor::ones((100, 4), DType::F32, &Device::Cpu).unwrap();
    // Targets for only 10 rows: refused, not trained on 10 rows.
    let y10 = Tensor::ones((10, 1), DType::F32, &Device::Cpu).unwrap();
    let err = train_step(
        &RetryEngine::new(),
        &sim,
        &[&x, &y10],
        &w,
        &mut opt,
        |_, rows| loss_of(&w, &rows[0], &rows[1]),
    )
    .unwrap_err();
    assert!(matches!(err, TrainStepError::InvalidBatch(_)), "{err}");
    assert!(err.to_string().contains("[10, 1]"), "{err}");
    let err = train_step(&RetryEngine::new(), &sim, &[], &w, &mut opt, |_, _| {
        w.as_tensor().sum_all()
    })
    .unwrap_err();
    assert!(matches!(err, TrainStepError::InvalidBatch(_)), "{err}");
    assert_eq!(opt.1, 0);
    // 100 rows in 40 MiB: split, and every row trained on.
    let (_, steps, r) = hundred_rows(&RetryEngine::new(), &sim);
    let done = r.unwrap();
    assert_eq!((done.rows, steps), (100, 1));
    assert!(done.report.final_plan.num_chunks() > 1);
}

#[test]
fn a_variable_the_optimizer_updates_but_the_step_does_not_list_is_an_error() {
    let (x, y) = data();
    let sim = oomguard::Device::sim(ByteSize::gib(1));
    let w = Var::zeros((4, 1), DType::F32, &Device::Cpu).unwrap();
    let b = Var::zeros(1, DType::F32, &Device::Cpu).unwrap();
    let mut opt = Counting::new(vec![w.clone(), b.clone()], 0.05).unwrap();
    let model = |rows: &[Tensor]| -> candle_core::Result<Tensor> {
        let pred = rows[0]
            .matmul(w.as_tensor())?
            .broadcast_add(b.as_tensor())?;
        (pred - &rows[1])?.sqr()?.mean_all()
    };
    // On the old code `b` got no update, silently.
    let err = train_step(
        &RetryEngine::new(),
        &sim,
        &[&x, &y],
        &w,
        &mut opt,
        |_, r| model(r),
    )
    .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("not among the step's parameters") && msg.contains("[1] F32"),
        "{msg}"
    );
    assert_eq!(opt.1, 0);
    // Listed, or frozen on purpose: fine.
    let done = train_step(
        &RetryEngine::new(),
        &sim,
        &[&x, &y],
        &[w.clone(), b.clone()],
        &mut opt,
        |_, r| model(r),
    )
    .unwrap();
    assert_eq!(done.rows, 64);
    let params =
        oomguard_candle::Params::new(std::slice::from_ref(&w)).freeze(std::slice::from_ref(&b));
    train_step(
        &RetryEngine::new(),
        &sim,
        &[&x, &y],
        &params,
        &mut opt,
        |_, r| model(r),
    )
    .unwrap();
}

/// A step with no variable to train (none given, or every one frozen) is refused before its
/// first chunk: it returned `Ok` with its loss while the optimizer changed nothing.
#[test]
fn a_step_with_nothing_to_train_is_refused() {
    let (x, y) = data();
    let sim = oomguard::Device::sim(ByteSize::gib(1));
    let w = Var::zeros((4, 1), DType::F32, &Device::Cpu).unwrap();
    let mut opt = Counting::new(vec![w.clone()], 0.05).unwrap();
    let frozen =
        oomguard_candle::Params::new(std::slice::from_ref(&w)).freeze(std::slice::from_ref(&w));
    for (params, said) in [
        (oomguard_candle::Params::default(), "are empty"),
        (frozen, "are all frozen"),
    ] {
        let mut chunks = 0;
        let err = train_step(
            &RetryEngine::new(),
            &sim,
            &[&x, &y],
            params,
            &mut opt,
            |_, r| {
                chunks += 1;
                (r[0].matmul(w.as_tensor())? - &r[1])?.sqr()?.mean_all()
            },
        )
        .unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("no variable to train") && msg.contains(said),
            "{msg}"
        );
        assert!(!err.is_oom(), "{msg}");
        assert_eq!((chunks, opt.1), (0, 0));
    }
}

#[test]
fn train_step_errors_are_classified_budget_kind_included() {
    let (x, y) = data();
    let w = Var::zeros((4, 1), DType::F32, &Device::Cpu).unwrap();
    let run = |sim: &oomguard::Device| {
        let mut opt = Counting::new(vec![w.clone()], 0.05).unwrap();
        let r = train_step(
            &RetryEngine::new(),
            sim,
            &[&x, &y],
            &w,
            &mut opt,
            |c, rows| {
                let _acts = oomguard_candle::charge(sim, c.len() << 20)?;
                loss_of(&w, &rows[0], &rows[1])
            },
        );
        (r, opt.1)
    };
    // Not even one row (1 MiB) fits a card of 512 KiB: an OOM, not a budget's.
    let (r, steps) = run(&oomguard::Device::sim(ByteSize::kib(512)));
    let err = r.unwrap_err();
    assert!(err.is_oom() && !err.is_budget_exceeded(), "{err}");
    assert_eq!(steps, 0);
    // A budget of 512 KiB on a large card: an OOM of the budget kind, and the engine skipped
    // the same-plan retry that cannot help a budget.
    let sim = oomguard::Device::sim(ByteSize::gib(1));
    let _budget = sim.thread_budget(ByteSize::kib(512));
    let (r, _) = run(&sim);
    let err = r.unwrap_err();
    assert!(err.is_oom() && err.is_budget_exceeded(), "{err}");
    let report = err_report(&err);
    assert!(
        report.attempts[0].next.unwrap().micro_batch() < 64,
        "no same-plan retry after a budget: {report}"
    );
    // A shape error is neither.
    let w3 = Var::zeros((3, 1), DType::F32, &Device::Cpu).unwrap();
    let mut opt = Counting::new(vec![w3.clone()], 0.05).unwrap();
    let err = train_step(
        &RetryEngine::new(),
        &sim,
        &[&x, &y],
        &w3,
        &mut opt,
        |_, rows| loss_of(&w3, &rows[0], &rows[1]),
    )
    .unwrap_err();
    assert!(!err.is_oom() && !err.is_budget_exceeded(), "{err}");
}

fn err_report(e: &TrainStepError) -> &oomguard::retry::RetryReport {
    match e {
        TrainStepError::Retry(r) => r.report().expect("a report"),
        TrainStepError::Update { report, .. } => report,
        other => panic!("no report in {other}"),
    }
}

/// An optimizer whose update runs out of memory.
struct OomOnStep(oomguard::Device);
impl Optimizer for OomOnStep {
    type Config = ();
    fn new(_: Vec<Var>, _: ()) -> candle_core::Result<Self> {
        Ok(Self(oomguard::Device::sim(ByteSize::kib(1))))
    }
    fn step(&mut self, _: &candle_core::backprop::GradStore) -> candle_core::Result<()> {
        oomguard_candle::charge(&self.0, 1 << 20).map(drop)
    }
    fn learning_rate(&self) -> f64 {
        0.0
    }
    fn set_learning_rate(&mut self, _: f64) {}
}

#[test]
fn an_update_that_ran_out_of_memory_is_not_retryable() {
    let (x, y) = data();
    let w = Var::zeros((4, 1), DType::F32, &Device::Cpu).unwrap();
    let mut opt = OomOnStep::new(vec![], ()).unwrap();
    let err = train_step(
        &RetryEngine::new(),
        &oomguard::Device::sim(ByteSize::gib(1)),
        &[&x, &y],
        &w,
        &mut opt,
        |_, rows| loss_of(&w, &rows[0], &rows[1]),
    )
    .unwrap_err();
    let TrainStepError::Update { error, .. } = &err else {
        panic!("{err}")
    };
    assert!(error.is_oom(), "the optimizer's own error is an OOM");
    assert!(
        !err.is_oom(),
        "but the step must not be rerun: it may be partly applied"
    );
    // nor by a walk of its chain, boxed or not (before: the walk found the optimizer's OOM)
    assert!(!oomguard::retry::chain_is_oom(&err), "{err}");
    let boxed: Box<dyn std::error::Error + Send + Sync> = Box::new(err);
    assert!(!boxed.is_oom() && !boxed.is_budget_exceeded(), "{boxed}");
}
