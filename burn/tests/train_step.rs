//! `train_step`, `GradAccumulator` and the batch splitting on burn's ndarray backend under
//! `Autodiff`. Out-of-memory comes from a simulated oomguard device that the loss closure
//! charges for each micro-batch's "activations" (1 MiB per row), as a GPU would: the engine must
//! split the batch, accumulate exactly, and step the optimizer once.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use burn::backend::{Autodiff, NdArray};
use burn::module::{AutodiffModule, Module, Param, ParamId};
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{GradientsParams, MultiGradientsParams, Optimizer, SgdConfig};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};
use oomguard::retry::{BatchPlan, RetryEngine, RetryError, Shrink};
use oomguard::{ByteSize, IsOom};
use oomguard_burn::{chunk_rows, split_rows, train_step, Error, GradAccumulator, TrainStepError};

type B = Autodiff<NdArray>;

/// A two-layer perceptron (bias, ReLU: gradients that are not linear in the rows).
#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    fc1: Linear<B>,
    act: Relu,
    fc2: Linear<B>,
}

impl<B: Backend> Mlp<B> {
    fn new(device: &B::Device) -> Self {
        // Deterministic weights: the same initial model for every run.
        let mut m = Self {
            fc1: LinearConfig::new(4, 8).init(device),
            act: Relu::new(),
            fc2: LinearConfig::new(8, 1).init(device),
        };
        let w1: Vec<f32> = (0..32)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) / 10.0)
            .collect();
        let w2: Vec<f32> = (0..8).map(|i| ((i * 5 % 9) as f32 - 4.0) / 5.0).collect();
        m.fc1.weight = m
            .fc1
            .weight
            .map(|_| Tensor::from_data(TensorData::new(w1, [4, 8]), device).require_grad());
        m.fc2.weight = m
            .fc2
            .weight
            .map(|_| Tensor::from_data(TensorData::new(w2, [8, 1]), device).require_grad());
        // Biases too (LinearConfig draws them at random).
        let b1: Vec<f32> = (0..8).map(|i| (i as f32 - 3.5) / 10.0).collect();
        m.fc1.bias = m
            .fc1
            .bias
            .map(|b| b.map(|_| Tensor::from_data(TensorData::new(b1, [8]), device).require_grad()));
        m.fc2.bias = m.fc2.bias.map(|b| {
            b.map(|_| Tensor::from_data(TensorData::new(vec![0.1f32], [1]), device).require_grad())
        });
        m
    }
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.fc2.forward(self.act.forward(self.fc1.forward(x)))
    }
}

/// 8 rows of 4 features and their targets.
fn data(dev: &burn::tensor::Device<B>) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let x: Vec<f32> = (0..32)
        .map(|i| ((i * 37 % 101) as f32) / 50.0 - 1.0)
        .collect();
    let x = Tensor::<B, 2>::from_data(TensorData::new(x, [8, 4]), dev);
    let w = Tensor::<B, 2>::from_data(TensorData::new(vec![1f32, -2., 3., 0.5], [4, 1]), dev);
    let y = x.clone().matmul(w).detach();
    (x, y)
}

fn mse(m: &Mlp<B>, x: Tensor<B, 2>, y: Tensor<B, 2>) -> Tensor<B, 1> {
    (m.forward(x) - y).powi_scalar(2).mean()
}

/// All parameters, flattened, in order.
fn params(m: &Mlp<B>) -> Vec<f32> {
    let mut v = Vec::new();
    for t in [
        m.fc1.weight.val().flatten::<1>(0, 1),
        m.fc1.bias.as_ref().unwrap().val(),
        m.fc2.weight.val().flatten::<1>(0, 1),
        m.fc2.bias.as_ref().unwrap().val(),
    ] {
        v.extend(t.into_data().iter::<f32>());
    }
    v
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Counts optimizer steps.
#[derive(Clone)]
struct Counting<O> {
    inner: O,
    steps: Arc<AtomicUsize>,
}

impl<M: AutodiffModule<Bk>, Bk: AutodiffBackend, O: Optimizer<M, Bk>> Optimizer<M, Bk>
    for Counting<O>
{
    type Record = O::Record;
    fn step(&mut self, lr: f64, module: M, grads: GradientsParams) -> M {
        self.steps.fetch_add(1, Ordering::SeqCst);
        self.inner.step(lr, module, grads)
    }
    fn step_multi(&mut self, lr: f64, module: M, grads: MultiGradientsParams) -> M {
        self.steps.fetch_add(1, Ordering::SeqCst);
        self.inner.step_multi(lr, module, grads)
    }
    fn to_record(&self) -> Self::Record {
        self.inner.to_record()
    }
    fn load_record(self, record: Self::Record) -> Self {
        Self {
            inner: self.inner.load_record(record),
            steps: self.steps,
        }
    }
}

fn sgd() -> Counting<impl Optimizer<Mlp<B>, B>> {
    Counting {
        inner: SgdConfig::new().init::<B, Mlp<B>>(),
        steps: Arc::new(AtomicUsize::new(0)),
    }
}

/// Three SGD steps over the 8 rows with `plan`'s micro-batches, accumulated by hand.
fn three_steps_with(plan: &BatchPlan) -> Vec<f32> {
    let dev = Default::default();
    let (x, y) = data(&dev);
    let mut model = Mlp::<B>::new(&dev);
    let mut opt = sgd();
    for _ in 0..3 {
        let mut acc = GradAccumulator::<B, Mlp<B>>::new();
        for c in plan.chunks() {
            let loss = mse(
                &model,
                chunk_rows(&x, &c).unwrap(),
                chunk_rows(&y, &c).unwrap(),
            );
            acc.backward(&model, loss, &c).unwrap();
        }
        assert_eq!(acc.rows(), 8);
        let grads = acc.into_grads(&model).unwrap();
        model = opt.step(0.05, model, grads);
    }
    params(&model)
}

/// Tolerance of the equivalence checks: 1e-6 absolute on parameters of order 1 (f32
/// summation-order differences are ~1e-7 here).
const TOL: f32 = 1e-6;

#[test]
fn one_by_eight_equals_four_by_two_after_three_sgd_steps() {
    let whole = three_steps_with(&BatchPlan::whole(8).unwrap());
    let split = three_steps_with(&BatchPlan::new(8, 4).unwrap());
    let uneven = three_steps_with(&BatchPlan::with_micro_batch(8, 3).unwrap()); // 3 + 3 + 2
    let start = params(&Mlp::<B>::new(&Default::default()));
    let moved = max_diff(&whole, &start);
    assert!(moved > 1e-2, "the steps changed the model: {moved}");
    let d = max_diff(&whole, &split);
    eprintln!("1x8 vs 4x2 after 3 SGD steps: max abs diff {d:e} (params moved {moved})");
    assert!(d <= TOL, "1x8 vs 4x2: max diff {d}");
    let d = max_diff(&whole, &uneven);
    assert!(d <= TOL, "1x8 vs 3+3+2: max diff {d}");
}

/// `train_step` on a simulated card of `capacity`, 3 calls; returns the parameters, optimizer
/// steps and reports.
fn run(capacity: ByteSize) -> (Vec<f32>, usize, Vec<oomguard::retry::RetryReport>) {
    let dev = Default::default();
    let (x, y) = data(&dev);
    let sim = oomguard::Device::sim(capacity);
    let mut model = Mlp::<B>::new(&dev);
    let mut opt = sgd();
    let engine = RetryEngine::new();
    let mut reports = Vec::new();
    for _ in 0..3 {
        let done = train_step(&engine, &sim, 8, &mut model, &mut opt, 0.05, |m, chunk| {
            // 1 MiB of activations per row, on the simulated card: its OOM is a real
            // oomguard out-of-memory error, as the device's would be.
            let _acts = sim.alloc::<u8>(chunk.len() << 20)?;
            Ok(mse(m, chunk_rows(&x, chunk)?, chunk_rows(&y, chunk)?))
        })
        .unwrap();
        assert_eq!(done.rows, 8, "every row is trained on");
        assert!(done.loss > 0.0);
        reports.push(done.report);
    }
    let p = params(&model);
    let moved = max_diff(&p, &params(&Mlp::<B>::new(&dev)));
    assert!(moved > 1e-2, "the steps changed the model: {moved}");
    (p, opt.steps.load(Ordering::SeqCst), reports)
}

#[test]
fn injected_oom_splits_steps_once_and_matches_the_unsplit_run() {
    let (p_ample, steps_ample, r_ample) = run(ByteSize::gib(1));
    let (p_tight, steps_tight, r_tight) = run(ByteSize::mib(3));
    assert_eq!(steps_ample, 3);
    assert_eq!(
        steps_tight, 3,
        "one optimizer step per call, retries or not"
    );
    assert!(r_ample.iter().all(|r| r.retries() == 0));
    assert!(
        r_tight[0].retries() >= 1,
        "3 MiB cannot hold 8 rows of 1 MiB"
    );
    assert!(r_tight[0].final_plan.micro_batch() <= 3, "{}", r_tight[0]);
    assert!(
        r_tight[1..]
            .iter()
            .all(|r| r.retries() == 0 && r.from_memory),
        "later steps start from the remembered plan"
    );
    let d = max_diff(&p_tight, &p_ample);
    assert!(d <= TOL, "split vs whole after 3 steps: max diff {d}");
}

#[test]
fn a_failing_micro_batch_commits_nothing() {
    let dev = Default::default();
    let (x, y) = data(&dev);
    let sim = oomguard::Device::sim(ByteSize::mib(3));
    let mut model = Mlp::<B>::new(&dev);
    let before = params(&model);
    let mut opt = sgd();
    // OOM until the plan is 2 rows, then a non-OOM error in the last chunk.
    let err = train_step(
        &RetryEngine::new(),
        &sim,
        8,
        &mut model,
        &mut opt,
        0.05,
        |m, chunk| {
            let _acts = sim.alloc::<u8>(chunk.len() << 20)?;
            if chunk.is_last() && chunk.len() <= 3 {
                return Err(Error::Rows("a data error in the last chunk".into()));
            }
            Ok(mse(m, chunk_rows(&x, chunk)?, chunk_rows(&y, chunk)?))
        },
    )
    .unwrap_err();
    assert!(matches!(err, TrainStepError::Retry(_)), "{err}");
    assert_eq!(
        opt.steps.load(Ordering::SeqCst),
        0,
        "no update after a failed step"
    );
    assert_eq!(params(&model), before, "the model is unchanged");
}

fn step_error(err: TrainStepError) -> Error {
    match err {
        TrainStepError::Retry(RetryError::Step { error, .. }) => error,
        other => panic!("unexpected: {other}"),
    }
}

#[test]
fn a_policy_that_drops_rows_is_refused() {
    let dev = Default::default();
    let (x, y) = data(&dev);
    let sim = oomguard::Device::sim(ByteSize::mib(3));
    let mut model = Mlp::<B>::new(&dev);
    let mut opt = sgd();
    let engine = RetryEngine::new().with_policy(Shrink::halving());
    let err = train_step(&engine, &sim, 8, &mut model, &mut opt, 0.05, |m, chunk| {
        let _acts = sim.alloc::<u8>(chunk.len() << 20)?;
        Ok(mse(m, chunk_rows(&x, chunk)?, chunk_rows(&y, chunk)?))
    })
    .unwrap_err();
    assert!(
        matches!(
            &err,
            TrainStepError::PolicyDropsRows { batch: 8, proposed, .. } if proposed.batch() == 4
        ),
        "{err}"
    );
    assert!(!err.is_oom());
    assert_eq!(opt.steps.load(Ordering::SeqCst), 0);
}

#[test]
fn a_batch_that_does_not_match_the_tensors_is_refused() {
    let dev = Default::default();
    let (x, y) = data(&dev);
    let sim = oomguard::Device::sim(ByteSize::gib(1));
    let mut model = Mlp::<B>::new(&dev);
    let mut opt = sgd();
    // batch 4 over tensors of 8 rows would train on half the data: refused.
    for batch in [4, 9] {
        let err = train_step(
            &RetryEngine::new(),
            &sim,
            batch,
            &mut model,
            &mut opt,
            0.05,
            |m, c| Ok(mse(m, chunk_rows(&x, c)?, chunk_rows(&y, c)?)),
        )
        .unwrap_err();
        let e = step_error(err);
        assert!(matches!(e, Error::Rows(_)), "{e}");
        assert!(e.to_string().contains("8 rows"), "{e}");
    }
    // A loss that is not the chunk's mean (one value) is refused too.
    let err = train_step(
        &RetryEngine::new(),
        &sim,
        8,
        &mut model,
        &mut opt,
        0.05,
        |m, c| Ok((m.forward(chunk_rows(&x, c)?) - chunk_rows(&y, c)?).flatten::<1>(0, 1)),
    )
    .unwrap_err();
    assert!(matches!(step_error(err), Error::Loss(_)));
    assert_eq!(opt.steps.load(Ordering::SeqCst), 0);
}

#[test]
fn split_rows_is_consecutive_and_checked() {
    let dev = Default::default();
    let (x, _) = data(&dev);
    let plan = BatchPlan::with_micro_batch(8, 3).unwrap();
    let parts = split_rows(&x, &plan).unwrap();
    assert_eq!(
        parts.iter().map(|p| p.dims()).collect::<Vec<_>>(),
        vec![[3, 4], [3, 4], [2, 4]]
    );
    let back = Tensor::cat(parts, 0);
    assert_eq!(back.into_data(), x.clone().into_data());
    let short = x.clone().narrow(0, 0, 5);
    let e = split_rows(&short, &plan).unwrap_err();
    assert!(
        matches!(e, Error::Rows(_)) && e.to_string().contains("5 rows"),
        "{e}"
    );
    let long = Tensor::cat(vec![x.clone(), x], 0);
    assert!(split_rows(&long, &plan).is_err(), "16 rows in a batch of 8");
    assert!(
        oomguard_burn::memory_source::<B>(&dev).is_err(),
        "ndarray has no source"
    );
}

/// A model with a parameter the loss does not use.
#[derive(Module, Debug)]
struct WithUnused<B: Backend> {
    used: Linear<B>,
    unused: Linear<B>,
}

fn with_unused(dev: &burn::tensor::Device<B>) -> WithUnused<B> {
    WithUnused {
        used: LinearConfig::new(4, 1).init(dev),
        unused: LinearConfig::new(4, 1).init(dev),
    }
}

/// SGD counting its steps.
fn counting_sgd() -> (Counting<impl Optimizer<WithUnused<B>, B>>, Arc<AtomicUsize>) {
    let steps = Arc::new(AtomicUsize::new(0));
    let opt = Counting {
        inner: SgdConfig::new().init::<B, WithUnused<B>>(),
        steps: steps.clone(),
    };
    (opt, steps)
}

#[test]
fn a_parameter_without_gradient_is_reported() {
    let dev = Default::default();
    let (x, y) = data(&dev);
    let sim = oomguard::Device::sim(ByteSize::gib(1));
    let mut model = with_unused(&dev);
    let (mut opt, steps) = counting_sgd();
    let mut step = |model: &mut WithUnused<B>| {
        train_step(
            &RetryEngine::new(),
            &sim,
            8,
            model,
            &mut opt,
            0.05,
            |m, c| {
                let pred = m.used.forward(chunk_rows(&x, c)?);
                Ok((pred - chunk_rows(&y, c)?).powi_scalar(2).mean())
            },
        )
    };
    let e = step_error(step(&mut model).unwrap_err());
    match &e {
        Error::NoGradient { params } => {
            assert_eq!(params, &["unused.weight", "unused.bias"], "{e}")
        }
        other => panic!("expected NoGradient, got {other}"),
    }
    assert_eq!(steps.load(Ordering::SeqCst), 0);
    // Frozen on purpose: no longer reported.
    model.unused = model.unused.no_grad();
    step(&mut model).unwrap();
    assert_eq!(steps.load(Ordering::SeqCst), 1);
}

/// An optimizer whose update runs out of memory the way cubecl reports it on the device thread
/// (a panic with its message), after taking nothing: `train_step` reports the update's failure,
/// does not retry it, leaves the model unchanged and says what may have happened to the
/// optimizer's state.
#[derive(Clone)]
struct UpdateRunsOutOfMemory;

impl<M: AutodiffModule<Bk>, Bk: AutodiffBackend> Optimizer<M, Bk> for UpdateRunsOutOfMemory {
    type Record = ();
    fn step(&mut self, _: f64, _: M, _: GradientsParams) -> M {
        panic!("called `Result::unwrap()` on an `Err` value: can't allocate buffer of size: 1328398336")
    }
    fn step_multi(&mut self, _: f64, _: M, _: MultiGradientsParams) -> M {
        panic!("called `Result::unwrap()` on an `Err` value: can't allocate buffer of size: 1328398336")
    }
    fn to_record(&self) -> Self::Record {}
    fn load_record(self, _: Self::Record) -> Self {
        self
    }
}

#[test]
fn an_update_that_runs_out_of_memory_is_reported_not_retried() {
    let dev = Default::default();
    let (x, y) = data(&dev);
    let sim = oomguard::Device::sim(ByteSize::mib(64));
    let mut model = Mlp::<B>::new(&dev);
    let before = params(&model);
    let calls = AtomicUsize::new(0);
    let err = train_step(
        &RetryEngine::new(),
        &sim,
        8,
        &mut model,
        &mut UpdateRunsOutOfMemory,
        0.05,
        |m, chunk| {
            calls.fetch_add(1, Ordering::SeqCst);
            Ok(mse(m, chunk_rows(&x, chunk)?, chunk_rows(&y, chunk)?))
        },
    )
    .unwrap_err();
    let TrainStepError::Update { error, report } = &err else {
        panic!("expected the update's failure, got {err}");
    };
    assert!(error.is_oom(), "{error}");
    assert_eq!(report.retries(), 0, "the update is not retried");
    assert_eq!(calls.load(Ordering::SeqCst), 1, "one micro-batch, run once");
    assert_eq!(params(&model), before, "the model is unchanged");
    let text = err.to_string();
    assert!(
        text.contains("the model is unchanged")
            && text.contains("optimizer's state may be partly advanced or lost"),
        "{text}"
    );
}

/// A module whose weight burn creates on its first use (a lazy `Param`, as burn-nn's modules
/// make them). Its initialiser takes the weight's 1 MiB from a simulated card first and, when the
/// card cannot hold it, panics with cubecl's out-of-memory, as a failed reservation does on a GPU.
#[derive(Module, Debug)]
struct LazyLinear<B: Backend> {
    weight: Param<Tensor<B, 2>>,
}

fn lazy_linear(card: &oomguard::Device) -> LazyLinear<B> {
    let card = card.clone();
    let weight = Param::uninitialized(
        ParamId::new(),
        move |device: &burn::tensor::Device<B>, require_grad| {
            if card.alloc::<u8>(1 << 20).is_err() {
                panic!(
                    "called `Result::unwrap()` on an `Err` value: can't allocate buffer of size: {}",
                    1 << 20
                );
            }
            let w = Tensor::from_data(TensorData::new(vec![0.5f32; 4], [4, 1]), device);
            if require_grad {
                w.require_grad()
            } else {
                w
            }
        },
        Default::default(),
        true,
        [4, 1].into(),
    );
    LazyLinear { weight }
}

fn lazy_step(
    card: &oomguard::Device,
    model: &mut LazyLinear<B>,
) -> Result<oomguard_burn::TrainedStep, TrainStepError> {
    let (x, y) = data(&Default::default());
    let mut opt = SgdConfig::new().init::<B, LazyLinear<B>>();
    train_step(
        &RetryEngine::new(),
        card,
        8,
        model,
        &mut opt,
        0.05,
        |m, c| {
            let pred = chunk_rows(&x, c)?.matmul(m.weight.val());
            Ok((pred - chunk_rows(&y, c)?).powi_scalar(2).mean())
        },
    )
}

#[test]
fn a_parameter_that_runs_out_of_memory_leaves_the_model_as_it_was() {
    // On the old code the second step panicked: burn's Param::val had taken the initialiser out
    // and poisoned the parameter's lock during the failed initialisation.
    let card = oomguard::Device::sim(ByteSize::mib(4));
    let full = card.alloc::<u8>(4 << 20).unwrap();
    let mut model = lazy_linear(&card);
    let err = lazy_step(&card, &mut model).unwrap_err();
    let TrainStepError::Parameters(e) = &err else {
        panic!("expected TrainStepError::Parameters, got {err}");
    };
    assert!(e.is_oom(), "{e}");
    assert!(err.to_string().contains("the model is unchanged"), "{err}");
    assert!(
        !model.weight.is_initialized(),
        "the weight is still lazy, as before the step"
    );
    drop(full);
    let done = lazy_step(&card, &mut model).expect("with memory freed the same model trains");
    assert!(done.loss.is_finite() && done.loss > 0.0, "{}", done.loss);
    let w: Vec<f32> = model.weight.val().into_data().iter::<f32>().collect();
    assert!(w.iter().all(|v| (v - 0.5).abs() > 1e-4), "trained: {w:?}");
}

#[test]
fn a_parameter_broken_outside_the_step_is_named_not_a_panic() {
    // On the old code this step panicked with burn's PoisonError (uncaught by catch_oom).
    let card = oomguard::Device::sim(ByteSize::mib(4));
    let full = card.alloc::<u8>(4 << 20).unwrap();
    let model_ = lazy_linear(&card);
    // The weight's first use, outside train_step (a forward inside find_max_batch, say).
    let e = oomguard_burn::catch_oom(|| Ok::<_, Error>(model_.weight.val())).unwrap_err();
    assert!(e.is_oom(), "{e}");
    drop(full);
    let mut model = model_;
    let err = lazy_step(&card, &mut model).unwrap_err();
    let TrainStepError::Parameters(Error::BrokenParameters { params }) = &err else {
        panic!("expected BrokenParameters, got {err}");
    };
    assert_eq!(params, &["weight".to_string()]);
    let TrainStepError::Parameters(inner) = &err else {
        unreachable!()
    };
    assert!(!inner.is_oom(), "not retried: no memory can mend it");
    assert!(err.to_string().contains("build the model again"), "{err}");
}

/// The chunks must cover the batch row by row: a chunk left out is refused by `into_grads`, a
/// chunk backpropagated twice by `backward`. Before: `into_grads` checked no rows, and the same
/// chunk twice was summed twice.
#[test]
fn the_accumulated_chunks_must_cover_the_batch_exactly_once() {
    let dev = Default::default();
    let (x, y) = data(&dev);
    let model = Mlp::<B>::new(&dev);
    let plan = BatchPlan::new(8, 2).unwrap();
    let first = plan.chunk(0).unwrap();
    let loss = || {
        mse(
            &model,
            chunk_rows(&x, &first).unwrap(),
            chunk_rows(&y, &first).unwrap(),
        )
    };
    let mut acc = GradAccumulator::<B, Mlp<B>>::new();
    acc.backward(&model, loss(), &first).unwrap();
    let e = acc.into_grads(&model).unwrap_err();
    assert!(
        matches!(&e, Error::Rows(m) if m.contains("rows 4..8 never ran")),
        "{e}"
    );
    let mut acc = GradAccumulator::<B, Mlp<B>>::new();
    acc.backward(&model, loss(), &first).unwrap();
    let e = acc.backward(&model, loss(), &first).unwrap_err();
    assert!(matches!(&e, Error::Rows(m) if m.contains("0..4")), "{e}");
    assert_eq!(acc.rows(), 4, "the repeated chunk added nothing");
}

/// An update that ran out of memory on an oomguard device is not an out-of-memory by any route:
/// its source is the after-update mark, not the update's error. Before: a boxed `dyn Error`
/// (and `chain_is_oom`) found the update's out-of-memory and called the step retryable.
#[test]
fn an_update_error_is_not_an_oom_boxed_either() {
    let sim = oomguard::Device::sim(ByteSize::mib(1));
    let report = RetryEngine::new()
        .run(&sim, 1, |_| Ok::<_, oomguard::Error>(()), |()| ())
        .unwrap()
        .report;
    let err = TrainStepError::Update {
        error: Error::Oomguard(sim.alloc::<u8>(2 << 20).unwrap_err()),
        report: Box::new(report),
    };
    assert!(!err.is_oom());
    assert!(!oomguard::retry::chain_is_oom(&err), "{err}");
    let boxed: Box<dyn std::error::Error> = Box::new(err);
    assert!(!boxed.is_oom() && !boxed.is_budget_exceeded(), "{boxed}");
}

/// One `train_step` of `model`'s `used` head on the test batch, its loss times `scale`, that
/// must be refused with nothing stepped or changed: the error and the chunks that ran.
fn refused_step(mut model: WithUnused<B>, scale: f64) -> (Error, usize) {
    let dev = Default::default();
    let (x, y) = data(&dev);
    let sim = oomguard::Device::sim(ByteSize::gib(1));
    let before = model.used.weight.val().into_data();
    let (mut opt, steps) = counting_sgd();
    let chunks = AtomicUsize::new(0);
    let r = train_step(
        &RetryEngine::new(),
        &sim,
        8,
        &mut model,
        &mut opt,
        0.05,
        |m, c| {
            chunks.fetch_add(1, Ordering::SeqCst);
            let pred = m.used.forward(chunk_rows(&x, c)?);
            let loss = (pred - chunk_rows(&y, c)?).powi_scalar(2).mean();
            Ok(loss.mul_scalar(scale))
        },
    );
    let e = step_error(r.unwrap_err());
    assert_eq!(steps.load(Ordering::SeqCst), 0, "the optimizer stepped");
    assert_eq!(
        model.used.weight.val().into_data(),
        before,
        "the model changed"
    );
    (e, chunks.load(Ordering::SeqCst))
}

/// A model whose every parameter is frozen (or that has none) trained nothing and `train_step`
/// returned `Ok`: now refused before the first chunk, naming the count, and nothing steps.
#[test]
fn a_model_with_nothing_to_train_is_refused() {
    let (e, chunks) = refused_step(with_unused(&Default::default()).no_grad(), 1.0);
    assert!(matches!(e, Error::NothingToTrain { params: 4 }), "{e}");
    assert!(e.to_string().contains("set_require_grad(true)"), "{e}");
    assert!(!e.is_oom());
    assert_eq!(chunks, 0);
}

/// A NaN or infinite loss was trained on: `Ok`, and every parameter NaN (found by a hostile
/// pass of the glue). Refused before the update, naming the rows.
#[test]
fn a_loss_that_is_not_finite_is_refused() {
    for bad in [f64::NAN, f64::INFINITY] {
        let mut model = with_unused(&Default::default());
        model.unused = model.unused.no_grad();
        let (e, _) = refused_step(model, bad);
        assert!(matches!(e, Error::Loss(_)) && !e.is_oom(), "{e}");
        assert!(e.to_string().contains("not trained on"), "{e}");
    }
}

/// A chunk whose loss came from another model (equal values, other parameters) gave `model` no
/// gradient and was dropped from the sum: `Ok`, and a gradient of the first chunk alone (found
/// by a hostile pass of the glue). Refused now.
#[test]
fn a_chunk_whose_loss_is_of_another_model_is_refused() {
    let dev = Default::default();
    let (x, y) = data(&dev);
    let model = Mlp::<B>::new(&dev);
    let other = Mlp::<B>::new(&dev);
    let plan = BatchPlan::new(8, 2).unwrap();
    let (c0, c1) = (plan.chunk(0).unwrap(), plan.chunk(1).unwrap());
    let loss = |m: &Mlp<B>, c: &oomguard::retry::Chunk| {
        mse(m, chunk_rows(&x, c).unwrap(), chunk_rows(&y, c).unwrap())
    };
    let mut acc = GradAccumulator::<B, Mlp<B>>::new();
    acc.backward(&model, loss(&model, &c0), &c0).unwrap();
    let e = acc.backward(&model, loss(&other, &c1), &c1).unwrap_err();
    assert!(matches!(e, Error::Loss(_)), "{e}");
    assert!(
        e.to_string()
            .contains("reached none of the model's trained parameters"),
        "{e}"
    );
    // the same chunk of the right model is then taken
    acc.backward(&model, loss(&model, &c1), &c1).unwrap();
    acc.into_grads(&model).unwrap();
}
