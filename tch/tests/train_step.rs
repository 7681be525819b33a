//! `train_step` on CPU tensors in `f64`. Out-of-memory comes from a simulated card that the
//! loss closure charges for each micro-batch's "activations" (1 MiB per row), as a GPU would,
//! or from libtorch's own CPU allocator: the engine must split the batch, accumulate exactly,
//! and step the optimizer once.

use std::sync::atomic::{AtomicUsize, Ordering};

use oomguard::retry::{inference_policy, BatchPlan, RetryEngine, RetryError, RetryReport};
use oomguard::{ByteSize, IsOom};
use oomguard_tch::{train_step, Error, TrainStepError, TrainedStep};
use tch::nn::{self, OptimizerConfig};
use tch::{Device, Kind, Tensor};

const OPTS: (Kind, Device) = (Kind::Double, Device::Cpu);

/// Relative tolerance of the equivalence checks, in `f64`. The goal is 1e-5; summation
/// order differs by ~1e-16 here, so 1e-12 still leaves room and catches any real difference.
const REL: f64 = 1e-12;

/// 64 rows of 4 features and their targets (`x · [1, -2, 3, 0.5]`).
fn data() -> (Tensor, Tensor) {
    let x: Vec<f64> = (0..256)
        .map(|i| ((i * 37 % 101) as f64) / 50.0 - 1.0)
        .collect();
    let x = Tensor::from_slice(&x).view([64, 4]);
    let w = Tensor::from_slice(&[1.0f64, -2.0, 3.0, 0.5]).view([4, 1]);
    let y = x.matmul(&w);
    (x, y)
}

/// A two-layer perceptron (bias, ReLU: gradients that are not linear in the rows), with fixed
/// weights: the same model for every run.
struct Mlp {
    w1: Tensor,
    b1: Tensor,
    w2: Tensor,
    b2: Tensor,
}

impl Mlp {
    fn new(vs: &nn::VarStore) -> Self {
        let root = vs.root();
        let fixed = |name: &str, n: usize, f: &dyn Fn(usize) -> f64, shape: &[i64]| {
            let v: Vec<f64> = (0..n).map(f).collect();
            root.var_copy(name, &Tensor::from_slice(&v).view(shape))
        };
        Self {
            w1: fixed("w1", 32, &|i| ((i * 7 % 13) as f64 - 6.0) / 10.0, &[4, 8]),
            b1: fixed("b1", 8, &|i| (i as f64 - 3.5) / 10.0, &[8]),
            w2: fixed("w2", 8, &|i| ((i * 5 % 9) as f64 - 4.0) / 5.0, &[8, 1]),
            b2: fixed("b2", 1, &|_| 0.1, &[1]),
        }
    }

    fn mse(&self, x: &Tensor, y: &Tensor) -> Result<Tensor, tch::TchError> {
        let h = x.f_matmul(&self.w1)?.f_add(&self.b1)?.f_relu()?;
        let pred = h.f_matmul(&self.w2)?.f_add(&self.b2)?;
        pred.f_sub(y)?.f_square()?.f_mean(Kind::Double)
    }
}

/// The store's variables, by name, as plain numbers (bit-exact comparisons).
fn params(vs: &nn::VarStore) -> Vec<(String, Vec<f64>)> {
    let mut v: Vec<(String, Vec<f64>)> = vs
        .variables()
        .into_iter()
        .map(|(n, t)| (n, Vec::<f64>::try_from(t.flatten(0, -1)).unwrap()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// The largest difference between two sets of parameters, relative to the largest parameter.
fn rel_diff(a: &[(String, Vec<f64>)], b: &[(String, Vec<f64>)]) -> f64 {
    let mut diff = 0f64;
    let mut scale = 0f64;
    for ((na, va), (nb, vb)) in a.iter().zip(b) {
        assert_eq!(na, nb);
        for (x, y) in va.iter().zip(vb) {
            diff = diff.max((x - y).abs());
            scale = scale.max(x.abs());
        }
    }
    diff / scale
}

/// An empty store whose variables are `f64`.
fn store() -> nn::VarStore {
    let mut vs = nn::VarStore::new(Device::Cpu);
    vs.set_kind(Kind::Double);
    vs
}

/// A fresh model, its store and an SGD optimizer (lr 0.05, no momentum).
fn model() -> (nn::VarStore, Mlp, nn::Optimizer) {
    let vs = store();
    let m = Mlp::new(&vs);
    let opt = nn::Sgd::default().build(&vs, 0.05).unwrap();
    (vs, m, opt)
}

/// Three steps of plain tch on the whole batch: zero_grad, backward, step.
fn plain_three_steps() -> Vec<(String, Vec<f64>)> {
    let (x, y) = data();
    let (vs, m, mut opt) = model();
    for _ in 0..3 {
        opt.zero_grad();
        m.mse(&x, &y).unwrap().backward();
        opt.step();
    }
    params(&vs)
}

/// Three `train_step`s on a simulated card of `capacity`, charged 1 MiB per row of a chunk.
/// Checks that the chunks of each step's last attempt covered every row once.
fn guarded_three_steps(capacity: ByteSize) -> (Vec<(String, Vec<f64>)>, Vec<RetryReport>) {
    let (x, y) = data();
    let (vs, m, mut opt) = model();
    let card = oomguard::Device::sim(capacity);
    let engine = RetryEngine::new();
    let mut reports = Vec::new();
    for _ in 0..3 {
        let mut seen = vec![0u32; 64];
        let done = train_step(&engine, &card, &[&x, &y], &vs, &mut opt, |c, rows| {
            if c.index() == 0 {
                seen = vec![0; 64]; // a new attempt
            }
            let _acts = card.alloc::<u8>(c.len() << 20)?;
            for r in c.rows() {
                seen[r] += 1;
            }
            assert_eq!(rows[0].size()[0], c.len() as i64);
            Ok(m.mse(&rows[0], &rows[1])?)
        })
        .unwrap();
        assert_eq!(done.rows, 64);
        assert!(seen.iter().all(|&n| n == 1), "every row once: {seen:?}");
        assert!(done.loss > 0.0 && done.loss.is_finite());
        reports.push(done.report);
    }
    (params(&vs), reports)
}

#[test]
fn an_oom_at_the_full_batch_is_survived_and_matches_one_full_batch_step() {
    let plain = plain_three_steps();
    let start = {
        let (vs, _m, _opt) = model();
        params(&vs)
    };
    let moved = rel_diff(&plain, &start);
    assert!(moved > 1e-2, "the steps changed the model: {moved}");
    let (ample, r_ample) = guarded_three_steps(ByteSize::gib(1));
    let (tight, r_tight) = guarded_three_steps(ByteSize::mib(40));
    assert!(r_ample.iter().all(|r| r.retries() == 0));
    assert!(
        r_tight[0].retries() >= 1,
        "40 MiB cannot hold 64 rows of 1 MiB"
    );
    assert!(r_tight[0].final_plan.micro_batch() <= 40, "{}", r_tight[0]);
    assert!(
        r_tight[1..]
            .iter()
            .all(|r| r.retries() == 0 && r.from_memory),
        "later steps start from the remembered plan"
    );
    let d = rel_diff(&ample, &plain);
    eprintln!("train_step 1x64 vs plain tch: rel diff {d:e}");
    assert!(d <= REL, "unsplit train_step vs plain tch: {d:e}");
    let d = rel_diff(&tight, &plain);
    eprintln!(
        "train_step {} vs plain tch 1x64 after 3 SGD steps (f64): rel diff {d:e}",
        r_tight[0].final_plan
    );
    assert!(d <= REL, "split train_step vs plain tch: {d:e}");
}

#[test]
fn uneven_chunks_match_the_whole_batch() {
    // 64 rows as 10 + 10 + ... + 4 (unequal weights), started there by the engine.
    let (x, y) = data();
    let (vs, m, mut opt) = model();
    let engine = RetryEngine::new().start_from(BatchPlan::with_micro_batch(64, 10).unwrap());
    let card = oomguard::Device::sim(ByteSize::gib(1));
    let done = train_step(&engine, &card, &[&x, &y], &vs, &mut opt, |_, rows| {
        Ok(m.mse(&rows[0], &rows[1])?)
    })
    .unwrap();
    assert_eq!(done.report.final_plan.num_chunks(), 7, "{}", done.report);
    let (vs1, m1, mut opt1) = model();
    opt1.zero_grad();
    let whole = m1.mse(&x, &y).unwrap();
    whole.backward();
    opt1.step();
    let d = rel_diff(&params(&vs), &params(&vs1));
    assert!(d <= REL, "7 uneven chunks vs whole: {d:e}");
    let loss = whole.double_value(&[]);
    assert!(
        (done.loss - loss).abs() <= REL * loss,
        "{} vs {loss}",
        done.loss
    );
}

#[test]
fn a_failed_attempts_gradients_never_reach_the_next_one() {
    // The first 2-chunk attempt runs out of memory in its second chunk, after the first chunk
    // put its gradients in `.grad`: the next attempt must start from zero.
    let (x, y) = data();
    let (vs, m, mut opt) = model();
    let engine = RetryEngine::new().start_from(BatchPlan::new(64, 2).unwrap());
    let card = oomguard::Device::sim(ByteSize::mib(1));
    let mut injected = false;
    let done = train_step(&engine, &card, &[&x, &y], &vs, &mut opt, |c, rows| {
        let loss = m.mse(&rows[0], &rows[1])?;
        if c.index() == 1 && !injected {
            injected = true;
            card.alloc::<u8>(2 << 20)?; // more than the card: an out-of-memory
        }
        Ok(loss)
    })
    .unwrap();
    assert!(injected);
    assert_eq!(done.report.retries(), 1, "{}", done.report);
    let (vs1, m1, mut opt1) = model();
    m1.mse(&x, &y).unwrap().backward();
    opt1.step();
    let d = rel_diff(&params(&vs), &params(&vs1));
    assert!(d <= REL, "a leaked half-gradient would show here: {d:e}");
}

#[test]
fn a_real_libtorch_oom_in_a_plain_method_splits_the_batch() {
    // A plain tch method panics with libtorch's ENOMEM above 16 rows: caught, an out-of-memory.
    let (x, y) = data();
    let (vs, m, mut opt) = model();
    let card = oomguard::Device::sim(ByteSize::gib(1));
    let done = train_step(
        &RetryEngine::new(),
        &card,
        &[&x, &y],
        &vs,
        &mut opt,
        |c, rows| {
            if c.len() > 16 {
                let _huge = Tensor::empty([1i64 << 50], (Kind::Float, Device::Cpu));
                // 4 PiB
            }
            Ok(m.mse(&rows[0], &rows[1])?)
        },
    )
    .unwrap();
    assert_eq!(done.report.final_plan.micro_batch(), 16, "{}", done.report);
    assert!(done.report.attempts.iter().all(|a| a
        .error
        .as_deref()
        .is_some_and(|e| e.contains("DefaultCPUAllocator"))));
    let (vs1, m1, mut opt1) = model();
    m1.mse(&x, &y).unwrap().backward();
    opt1.step();
    assert!(rel_diff(&params(&vs), &params(&vs1)) <= REL);
}

/// The step error's report.
fn report_of(e: &TrainStepError) -> &RetryReport {
    match e {
        TrainStepError::Retry(r) => r.report().expect("a report"),
        TrainStepError::Update { report, .. } => report,
        other => panic!("no report in {other}"),
    }
}

fn step_error(e: TrainStepError) -> Error {
    match e {
        TrainStepError::Retry(RetryError::Step { error, .. }) => error,
        other => panic!("expected a step error, got {other}"),
    }
}

#[test]
fn nothing_is_updated_when_every_plan_runs_out_of_memory() {
    let (x, y) = data();
    let (vs, m, mut opt) = model();
    let before = params(&vs);
    // Not even one row (1 MiB) fits a card of 512 KiB.
    let card = oomguard::Device::sim(ByteSize::kib(512));
    let err = train_step(
        &RetryEngine::new(),
        &card,
        &[&x, &y],
        &vs,
        &mut opt,
        |c, rows| {
            let loss = m.mse(&rows[0], &rows[1])?;
            loss.f_backward()?; // gradients in .grad before the out-of-memory: must not survive
            let _acts = card.alloc::<u8>(c.len() << 20)?;
            Ok(loss)
        },
    )
    .unwrap_err();
    assert!(
        matches!(err, TrainStepError::Retry(RetryError::GaveUp { .. })),
        "{err}"
    );
    assert!(err.is_oom() && !err.is_budget_exceeded(), "{err}");
    assert_eq!(params(&vs), before, "bit-identical parameters");
    assert!(
        vs.trainable_variables().iter().all(|t| !t.grad().defined()),
        "no partial gradients left for a later optimizer.step()"
    );
    // A budget's out-of-memory stays a budget's.
    let card = oomguard::Device::sim(ByteSize::gib(1));
    let _budget = card.thread_budget(ByteSize::kib(512));
    let err = train_step(
        &RetryEngine::new(),
        &card,
        &[&x, &y],
        &vs,
        &mut opt,
        |c, rows| {
            let _acts = card.alloc::<u8>(c.len() << 20)?;
            Ok(m.mse(&rows[0], &rows[1])?)
        },
    )
    .unwrap_err();
    assert!(err.is_oom() && err.is_budget_exceeded(), "{err}");
    assert!(report_of(&err).attempts[0].next.unwrap().micro_batch() < 64);
    assert_eq!(params(&vs), before);
}

#[test]
fn an_error_after_retries_updates_nothing() {
    let (x, y) = data();
    let (vs, m, mut opt) = model();
    let before = params(&vs);
    let card = oomguard::Device::sim(ByteSize::mib(40));
    let err = train_step(
        &RetryEngine::new(),
        &card,
        &[&x, &y],
        &vs,
        &mut opt,
        |c, rows| {
            let _acts = card.alloc::<u8>(c.len() << 20)?;
            if c.is_last() && c.count() > 1 {
                // a shape error in the last chunk, after the others backpropagated
                return Ok(rows[0].f_matmul(&Tensor::zeros([3, 1], OPTS))?);
            }
            Ok(m.mse(&rows[0], &rows[1])?)
        },
    )
    .unwrap_err();
    let e = step_error(err);
    assert!(matches!(e, Error::Torch(_)) && !e.is_oom(), "{e}");
    assert_eq!(params(&vs), before, "bit-identical parameters");
    assert!(vs.trainable_variables().iter().all(|t| !t.grad().defined()));
}

#[test]
fn a_variable_without_gradient_is_named_and_frozen_ones_are_not() {
    let (x, y) = data();
    let (vs, m, mut opt) = model();
    let unused = (vs.root() / "head").var_copy("unused", &Tensor::ones([2], OPTS));
    let before = params(&vs);
    let card = oomguard::Device::sim(ByteSize::gib(1));
    let step = |vs: &nn::VarStore, opt: &mut nn::Optimizer| {
        train_step(&RetryEngine::new(), &card, &[&x, &y], vs, opt, |_, rows| {
            Ok(m.mse(&rows[0], &rows[1])?)
        })
    };
    let e = step_error(step(&vs, &mut opt).unwrap_err());
    match &e {
        Error::NoGradient { params, trained } => {
            assert_eq!(params, &["head.unused"]);
            assert_eq!(*trained, 5);
        }
        other => panic!("expected NoGradient, got {other}"),
    }
    let text = e.to_string();
    assert!(
        text.contains("no gradient reached 1 of the 5 trained variables in this step: head.unused")
            && text.contains("set_requires_grad(false)"),
        "{text}"
    );
    assert!(!e.is_oom());
    assert_eq!(params(&vs), before, "the optimizer did not step");
    // Frozen on purpose: no longer asked for, and the others train.
    let _ = unused.set_requires_grad(false);
    let done = step(&vs, &mut opt).unwrap();
    assert_eq!(done.rows, 64);
    assert_ne!(params(&vs), before);
}

/// A detached loss (or one that requires no gradient) names every trained variable, and a
/// store with nothing to train is refused before its first chunk: both were libtorch's
/// "element 0 of tensors does not require grad" with its C++ stack (37 lines).
#[test]
fn a_detached_loss_and_a_store_with_nothing_to_train_are_refused_in_words() {
    let (x, y) = data();
    let (mut vs, m, mut opt) = model();
    let before = params(&vs);
    let card = oomguard::Device::sim(ByteSize::gib(1));
    let refusal = |vs: &nn::VarStore, opt: &mut nn::Optimizer, detach: bool, chunks: &mut u32| {
        let e = train_step(&RetryEngine::new(), &card, &[&x, &y], vs, opt, |_, rows| {
            *chunks += 1;
            let loss = m.mse(&rows[0], &rows[1])?;
            Ok(if detach { loss.detach() } else { loss })
        })
        .unwrap_err();
        step_error(e)
    };
    let mut chunks = 0;
    let e = refusal(&vs, &mut opt, true, &mut chunks);
    match &e {
        Error::NoGradient { params, trained } => {
            assert_eq!(params, &["b1", "b2", "w1", "w2"]);
            assert_eq!(*trained, 4);
        }
        other => panic!("expected NoGradient, got {other}"),
    }
    assert!(!e.to_string().contains("frame #"), "{e}");
    assert_eq!(params(&vs), before);

    vs.freeze();
    let mut chunks = 0;
    let e = refusal(&vs, &mut opt, false, &mut chunks);
    assert!(matches!(e, Error::NothingToTrain { variables: 4 }), "{e}");
    assert!(
        e.to_string()
            .contains("no variable of the VarStore requires a gradient"),
        "{e}"
    );
    assert!(!e.is_oom());
    assert_eq!(chunks, 0);
    assert_eq!(params(&vs), before);
}

#[test]
fn variables_the_optimizer_does_not_update_are_refused() {
    let (x, y) = data();
    let (vs, m, _) = model();
    let other = store();
    let _ = other.root().var_copy("w", &Tensor::ones([4, 1], OPTS));
    let mut opt = nn::Sgd::default().build(&other, 0.05).unwrap();
    let before = params(&vs);
    let err = train_step(
        &RetryEngine::new(),
        &oomguard::Device::sim(ByteSize::gib(1)),
        &[&x, &y],
        &vs,
        &mut opt,
        |_, rows| Ok(m.mse(&rows[0], &rows[1])?),
    )
    .unwrap_err();
    let e = step_error(err);
    assert!(
        matches!(&e, Error::NotOptimized { params } if params == &["b1", "b2", "w1", "w2"]),
        "{e}"
    );
    assert_eq!(params(&vs), before);
}

/// A `train_step` whose chunk loss is `loss(squared errors per row)`, which must be refused
/// with no update: the error.
fn refused_loss(loss: impl Fn(Tensor) -> Result<Tensor, tch::TchError>) -> Error {
    let (x, y) = data();
    let (vs, m, mut opt) = model();
    let before = params(&vs);
    let err = train_step(
        &RetryEngine::new(),
        &oomguard::Device::sim(ByteSize::gib(1)),
        &[&x, &y],
        &vs,
        &mut opt,
        |_, rows| {
            let h = rows[0].f_matmul(&m.w1)?.f_relu()?.f_matmul(&m.w2)?;
            Ok(loss(h.f_sub(&rows[1])?.f_square()?)?)
        },
    )
    .unwrap_err();
    assert_eq!(params(&vs), before);
    step_error(err)
}

#[test]
fn a_loss_that_is_not_one_value_is_refused() {
    // per-row losses, not their mean
    let e = refused_loss(Ok);
    assert!(matches!(e, Error::Loss(_)) && !e.is_oom(), "{e}");
    assert!(e.to_string().contains("shape [64, 1]"), "{e}");
}

/// A NaN loss was trained on: `Ok`, and every parameter NaN (found by a hostile pass of the
/// candle and burn glue; the same shared check here). Refused before the update.
#[test]
fn a_loss_that_is_not_finite_is_refused() {
    let e = refused_loss(|squares| Ok(squares.f_mean(tch::Kind::Float)? * f64::NAN));
    assert!(matches!(e, Error::Loss(_)) && !e.is_oom(), "{e}");
    assert!(e.to_string().contains("is NaN: not trained on"), "{e}");
}

#[test]
fn an_engine_whose_policy_drops_rows_is_refused_before_anything_runs() {
    let (x, y) = data();
    let (vs, m, mut opt) = model();
    let before = params(&vs);
    let calls = AtomicUsize::new(0);
    let engine = RetryEngine::new().with_policy(inference_policy());
    let err = train_step(
        &engine,
        &oomguard::Device::sim(ByteSize::mib(40)),
        &[&x, &y],
        &vs,
        &mut opt,
        |_, rows| {
            calls.fetch_add(1, Ordering::SeqCst);
            Ok(m.mse(&rows[0], &rows[1])?)
        },
    )
    .unwrap_err();
    assert!(
        matches!(&err, TrainStepError::PolicyDropsRows { batch: 64, proposed, .. } if proposed.batch() < 64),
        "{err}"
    );
    assert!(err.to_string().contains("never drops rows"), "{err}");
    assert!(!err.is_oom());
    assert_eq!(calls.load(Ordering::SeqCst), 0, "nothing ran");
    assert_eq!(params(&vs), before);
}

#[test]
fn the_batch_is_the_rows_of_its_tensors() {
    let (x, _) = data();
    let (vs, m, mut opt) = model();
    let y10 = Tensor::ones([10, 1], OPTS);
    let card = oomguard::Device::sim(ByteSize::gib(1));
    let err = train_step(
        &RetryEngine::new(),
        &card,
        &[&x, &y10],
        &vs,
        &mut opt,
        |_, r| Ok(m.mse(&r[0], &r[1])?),
    )
    .unwrap_err();
    assert!(matches!(err, TrainStepError::InvalidBatch(_)), "{err}");
    assert!(err.to_string().contains("[10, 1]"), "{err}");
    let err = train_step(&RetryEngine::new(), &card, &[], &vs, &mut opt, |_, _| {
        Ok(Tensor::zeros([], OPTS))
    })
    .unwrap_err();
    assert!(matches!(err, TrainStepError::InvalidBatch(_)), "{err}");
    let scalar = Tensor::from(1.0f64);
    let err = train_step(
        &RetryEngine::new(),
        &card,
        &[&scalar],
        &vs,
        &mut opt,
        |_, _| Ok(Tensor::zeros([], OPTS)),
    )
    .unwrap_err();
    assert!(err.to_string().contains("scalar"), "{err}");
}

#[test]
fn an_update_error_is_not_retried() {
    // SGD with momentum keeps a buffer of each variable's shape from the first step. The
    // variable `b2` then changes shape (`set_data`): the next update fails in libtorch (tch's
    // `step` unwraps it: a panic, caught), after every micro-batch succeeded.
    let (x, y) = data();
    let vs = store();
    let m = Mlp::new(&vs);
    let mut opt = nn::Sgd {
        momentum: 0.9,
        ..Default::default()
    }
    .build(&vs, 0.05)
    .unwrap();
    let card = oomguard::Device::sim(ByteSize::gib(1));
    let calls = AtomicUsize::new(0);
    let step = |opt: &mut nn::Optimizer| -> Result<TrainedStep, TrainStepError> {
        train_step(
            &RetryEngine::new(),
            &card,
            &[&x, &y],
            &vs,
            opt,
            |_, rows| {
                calls.fetch_add(1, Ordering::SeqCst);
                let h = rows[0].f_matmul(&m.w1)?.f_add(&m.b1)?.f_relu()?;
                let pred = h.f_matmul(&m.w2)?.f_add(&m.b2.f_sum(Kind::Double)?)?;
                Ok(pred.f_sub(&rows[1])?.f_square()?.f_mean(Kind::Double)?)
            },
        )
    };
    step(&mut opt).unwrap();
    let mut b2 = m.b2.shallow_clone();
    tch::no_grad(|| b2.set_data(&Tensor::zeros([2], OPTS)));
    calls.store(0, Ordering::SeqCst);
    let err = step(&mut opt).unwrap_err();
    let TrainStepError::Update { error, report } = &err else {
        panic!("expected the update's failure, got {err}");
    };
    assert!(matches!(error, Error::Torch(_)), "{error}");
    assert_eq!(report.retries(), 0, "the update is not retried");
    assert_eq!(calls.load(Ordering::SeqCst), 1, "one micro-batch, run once");
    assert!(!err.is_oom() && !err.is_budget_exceeded());
    assert!(err.to_string().contains("not retried"), "{err}");
    // Even an out-of-memory of the update is not retryable by an outer layer.
    let oom_update = TrainStepError::Update {
        error: Error::OomPanic {
            message: "CUDA out of memory. Tried to allocate 2.00 GiB".into(),
        },
        report: report.clone(),
    };
    assert!(!oom_update.is_oom());
}

#[test]
fn a_user_assertion_worded_as_an_oom_fails_the_step_at_once() {
    // libtorch's `_assert_async` puts the user's message first: it must not be retried as an
    // out-of-memory (five retries, then "gave up (out of memory)").
    let (x, y) = data();
    let (vs, m, mut opt) = model();
    let before = params(&vs);
    let card = oomguard::Device::sim(ByteSize::gib(1));
    let err = train_step(
        &RetryEngine::new(),
        &card,
        &[&x, &y],
        &vs,
        &mut opt,
        |_, rows| {
            let ok = Tensor::zeros([], (Kind::Bool, Device::Cpu));
            let token = Tensor::empty([0], OPTS);
            // the plain method: it panics with libtorch's text
            let _token = ok.internal_functional_assert_async(
                "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity",
                &token,
            );
            Ok(m.mse(&rows[0], &rows[1])?)
        },
    )
    .unwrap_err();
    let report = report_of(&err);
    assert_eq!(report.retries(), 0, "{report}");
    assert!(!report.to_string().contains("gave up"), "{report}");
    assert!(!err.is_oom(), "{err}");
    let e = step_error(err);
    assert!(matches!(&e, Error::Torch(_)) && !e.is_oom(), "{e}");
    assert_eq!(params(&vs), before);
}

#[test]
fn a_budget_refusal_of_oomguards_allocator_skips_the_same_plan_retry() {
    // Under oomguard_tch::allocator, a budget's refusal reaches the step as libtorch's text
    // (tch keeps only that): the text the allocator throws, with its request and the budget.
    let refusal = |rows: usize| {
        let req = oomguard::retry::OomRequest {
            requested: (rows as u64) << 20,
            capacity: 16 << 20,
            budget: true,
        };
        format!(
            "CUDA out of memory. Tried to allocate {rows}.00 MiB. {}: memory budget exceeded",
            oomguard::retry::oomguard_allocator_refusal(0, &req)
        )
    };
    let (x, y) = data();
    let (vs, m, mut opt) = model();
    let card = oomguard::Device::sim(ByteSize::gib(1));
    let done = train_step(
        &RetryEngine::new(),
        &card,
        &[&x, &y],
        &vs,
        &mut opt,
        |c, rows| {
            if c.len() > 16 {
                return Err(tch::TchError::Torch(refusal(c.len())).into());
            }
            Ok(m.mse(&rows[0], &rows[1])?)
        },
    )
    .unwrap();
    let first = &done.report.attempts[0];
    assert!(
        first.next.unwrap().micro_batch() < 64,
        "a budget's refusal shrinks the plan at once: {}",
        done.report
    );
    assert_eq!(done.report.final_plan.micro_batch(), 16, "{}", done.report);
}

/// One step of the perceptron over `x` (which may require a gradient) on a card of
/// `card_mib` MiB, rows 32.. charging 4 MiB each and rows ..32 1 MiB: on 80 MiB the whole batch
/// fails, then the 2 × 32 attempt fails in its second chunk after the first chunk's backward,
/// then 4 × 16 runs.
fn uneven_step(x: &Tensor, card_mib: u64) -> (nn::VarStore, TrainedStep) {
    let (_, y) = data();
    let (vs, m, mut opt) = model();
    let card = oomguard::Device::sim(ByteSize::mib(card_mib));
    let done = train_step(
        &RetryEngine::new(),
        &card,
        &[x, &y],
        &vs,
        &mut opt,
        |c, r| {
            let bytes: usize = c
                .rows()
                .map(|i| if i < 32 { 1 << 20 } else { 4 << 20 })
                .sum();
            let _acts = oomguard_tch::charge(&card, bytes)?;
            Ok(m.mse(&r[0], &r[1])?)
        },
    )
    .unwrap();
    (vs, done)
}

/// A batch tensor that requires a gradient (an input gradient, adversarial training) gets the
/// batch's gradient whatever the split: its `.grad()` is reset with the variables' at each
/// attempt (it kept the first chunk of a failed attempt: 1.5 × the gradient of those rows).
#[test]
fn an_input_gradient_is_the_batchs_whatever_the_split() {
    let grad = |card_mib| {
        let (x, _) = data();
        let x = x.set_requires_grad(true);
        let (_vs, done) = uneven_step(&x, card_mib);
        (x.grad().copy(), done.report.retries())
    };
    let (full, r0) = grad(4096);
    let (split, r1) = grad(80);
    assert_eq!(r0, 0);
    assert_eq!(r1, 2, "the whole batch, then 2 × 32 failed");
    let diff = (&full - &split).abs().max().double_value(&[]);
    let norm = full.abs().max().double_value(&[]);
    assert!(
        diff <= REL * norm,
        "input gradients differ by {diff} (of {norm})"
    );
}

/// A batch tensor with autograd history (computed from the model outside the loss) is refused
/// before anything runs, whatever the card: it trained in one pass and failed with libtorch's
/// "backward through the graph a second time" only once an out-of-memory split the batch.
#[test]
fn a_batch_tensor_with_autograd_history_is_refused() {
    let (x, y) = data();
    let (vs, m, mut opt) = model();
    let features = x.matmul(&m.w1); // requires a gradient, not a leaf
    let card = oomguard::Device::sim(ByteSize::gib(4));
    let calls = AtomicUsize::new(0);
    let err = train_step(
        &RetryEngine::new(),
        &card,
        &[&features, &y],
        &vs,
        &mut opt,
        |_, r| {
            calls.fetch_add(1, Ordering::Relaxed);
            Ok(r[0]
                .f_sum(Kind::Double)?
                .f_sub(&r[1].f_sum(Kind::Double)?)?
                .f_square()?)
        },
    )
    .unwrap_err();
    assert!(matches!(err, TrainStepError::InvalidBatch(_)), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("batch tensor 0 carries autograd history"),
        "{text}"
    );
    assert!(text.contains(".detach()"), "{text}");
    assert_eq!(calls.load(Ordering::Relaxed), 0, "nothing ran");
}

/// A panic in the loss that is not an out-of-memory, after a chunk's backward: the gradients
/// are reset when it unwinds, as after any failure (they stayed, and a loop that caught the
/// panic could step on half a batch).
#[test]
fn a_panic_in_the_loss_leaves_no_gradient() {
    let (x, y) = data();
    let (vs, m, mut opt) = model();
    let card = oomguard::Device::sim(ByteSize::mib(40));
    let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        train_step(
            &RetryEngine::new(),
            &card,
            &[&x, &y],
            &vs,
            &mut opt,
            |c, r| {
                let _acts = oomguard_tch::charge(&card, c.len() << 20)?;
                assert!(
                    c.index() == 0,
                    "a user's check that fails on the second chunk"
                );
                Ok(m.mse(&r[0], &r[1])?)
            },
        )
    }));
    assert!(out.is_err(), "the panic goes on");
    for (name, t) in vs.variables() {
        let g = t.grad();
        assert!(
            !g.defined() || g.abs().sum(Kind::Double).double_value(&[]) == 0.0,
            "{name} kept a gradient"
        );
    }
}
