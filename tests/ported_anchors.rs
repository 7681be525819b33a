//! The OOM-recovery anchors' own test suites, ported in meaning onto oomguard's public API on the
//! simulated device:
//! - Accelerate `tests/test_memory_utils.py` (`find_executable_batch_size`): `acc_*`
//! - Lightning `tests/tests_pytorch/tuner/test_scale_batch_size.py` (the batch-size finder): `lit_*`
//! - Composer `tests/trainer/test_trainer.py` (auto micro-batching) and the trainer's
//!   auto-microbatching logic (`_adjust_device_train_microbatch_size`, thrashing, the OOM flag
//!   all-reduced across ranks, eval auto micro-batching): `comp_*`
//!
//! Every step's memory comes from the simulated allocator (`dev.alloc`), so out-of-memory is the
//! allocator's, never a faked error. On the simulator a device of N MiB (N even) holds exactly
//! N rows of 1 MiB (2 MiB pages); `max_rows` measures the true maximum where it matters.

use std::cell::RefCell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;

use oomguard::backend::sim::SimDevice;
use oomguard::retry::advanced::{
    AttemptOutcome, FnPolicy, LocalGroup, PolicyExt, RetryContext, Shrink, StepMode, StopReason,
};
use oomguard::retry::{
    find_max_batch, inference_policy, last_report, Accumulate, BatchPlan, Chunk, FinderError,
    FinderOptions, IsOom, RetryEngine, RetryError, Step,
};
use oomguard::{no_grad, oom_retry, AllocatorConfig, ByteSize, Device, Error};

const MIB: usize = 1 << 20;

/// Largest number of rows (each `row` bytes, beside `fixed` bytes) that one step can hold on a
/// fresh device of `cap`.
fn max_rows(cap: ByteSize, fixed: usize, row: usize) -> usize {
    let dev = Device::sim(cap);
    let mut n = 0;
    loop {
        let ok = (|| -> Result<(), Error> {
            let _a = if fixed > 0 {
                Some(dev.alloc::<u8>(fixed)?)
            } else {
                None
            };
            let _b = dev.alloc::<u8>((n + 1) * row)?;
            Ok(())
        })()
        .is_ok();
        dev.empty_cache().unwrap();
        if !ok {
            return n;
        }
        n += 1;
    }
}

fn allocated(dev: &Device) -> u64 {
    dev.stats().allocated_bytes.all.current
}

/// Accelerate's back-off: `int(bs * 0.9)` from `start` until `bs <= fits`.
fn accelerate_sequence(start: usize, fits: usize) -> Vec<usize> {
    let mut v = vec![start];
    let mut bs = start;
    while bs > fits {
        bs = (bs as f64 * 0.9) as usize;
        v.push(bs);
    }
    v
}

// ------------------------------------------------------------------------------------------
// Accelerate: find_executable_batch_size
// ------------------------------------------------------------------------------------------

const ACCELERATE_128_TO_8: [usize; 23] = [
    128, 115, 103, 92, 82, 73, 65, 58, 52, 46, 41, 36, 32, 28, 25, 22, 19, 17, 15, 13, 11, 9, 8,
];

/// test_memory_implicit, on the engine: the batch shrinks by 0.9 (Accelerate's default) until the
/// allocator serves it; the sizes tried are Accelerate's.
#[test]
fn acc_memory_implicit_engine() {
    assert_eq!(accelerate_sequence(128, 8), ACCELERATE_128_TO_8);
    let dev = Device::sim(ByteSize::mib(8)); // 8 rows of 1 MiB fit, 9 do not
    let engine = RetryEngine::new()
        .with_policy(Shrink::by(0.9).unwrap())
        .regrow_after(None);
    let mut tried = Vec::new();
    let out = no_grad_run(|| {
        engine.run(
            &dev,
            128,
            |plan| {
                tried.push(plan.batch());
                let a = dev.alloc::<u8>(plan.batch() * MIB)?;
                Ok::<_, Error>(a.len() / MIB)
            },
            |rows| rows,
        )
    })
    .unwrap();
    assert_eq!(tried, ACCELERATE_128_TO_8);
    assert_eq!(out.value, 8);
    assert_eq!(out.report.requested_batch, 128);
    assert_eq!(out.report.final_plan.batch(), 8);
    assert_eq!(out.report.retries(), 22);
}

fn no_grad_run<R>(f: impl FnOnce() -> R) -> R {
    let _g = oomguard::guard::no_grad();
    f()
}

thread_local! {
    static TRIED: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

#[oom_retry(batch = bs, policy = Shrink::by(0.9).unwrap(), max_retries = 40, remember = false)]
#[no_grad]
fn acc_loop(dev: &Device, bs: usize) -> Result<usize, Error> {
    TRIED.with(|t| t.borrow_mut().push(bs));
    let a = dev.alloc::<u8>(bs * MIB)?;
    Ok(a.len() / MIB)
}

/// test_memory_implicit, through `#[oom_retry(batch = ...)]` on an evaluation function.
#[test]
fn acc_memory_implicit_macro() {
    TRIED.with(|t| t.borrow_mut().clear());
    let dev = Device::sim(ByteSize::mib(8));
    assert_eq!(acc_loop(&dev, 128).unwrap(), 8);
    TRIED.with(|t| assert_eq!(*t.borrow(), ACCELERATE_128_TO_8));
    let r = last_report().unwrap();
    assert_eq!((r.requested_batch, r.final_plan.batch()), (128, 8));
}

#[oom_retry(batch = bs, policy = Shrink::by(0.9).unwrap(), max_retries = 40, remember = false)]
#[no_grad]
fn acc_loop_args(
    dev: &Device,
    bs: usize,
    arg1: &str,
    owned: String,
) -> Result<(usize, String), Error> {
    TRIED.with(|t| t.borrow_mut().push(bs));
    let _a = dev.alloc::<u8>(bs * MIB)?;
    Ok((bs, format!("{arg1}{owned}")))
}

/// test_memory_explicit: the function's other arguments reach every attempt unchanged, and the
/// value returned is the successful attempt's.
#[test]
fn acc_memory_explicit_args() {
    TRIED.with(|t| t.borrow_mut().clear());
    let dev = Device::sim(ByteSize::mib(8));
    let (bs, arg) = acc_loop_args(&dev, 128, "hello", " world".to_string()).unwrap();
    assert_eq!((bs, arg.as_str()), (8, "hello world"));
    TRIED.with(|t| assert_eq!(*t.borrow(), ACCELERATE_128_TO_8));
}

/// test_start_zero on the engine: a batch of 0 is refused before anything runs, with a text that
/// says what is wrong.
#[test]
fn acc_start_zero_engine() {
    let dev = Device::sim(ByteSize::mib(8));
    let mut ran = 0;
    let err = no_grad_run(|| {
        RetryEngine::new().with_policy(inference_policy()).run(
            &dev,
            0,
            |_plan| {
                ran += 1;
                Ok::<_, Error>(())
            },
            |()| (),
        )
    })
    .unwrap_err();
    assert_eq!(ran, 0);
    assert!(matches!(err, RetryError::InvalidArgument(_)), "{err}");
    assert!(err.to_string().contains("at least one row"), "{err}");
}

thread_local! {
    static CALLS: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

#[oom_retry(batch = bs)]
#[no_grad]
fn acc_zero(bs: usize) -> Result<usize, Error> {
    CALLS.with(|c| c.borrow_mut().push(bs));
    Ok(bs)
}

/// test_start_zero through the macro: Accelerate raises "No executable batch size found,
/// reached zero". oomguard runs the body once with the caller's 0 rows (nothing to plan).
#[test]
fn acc_start_zero_macro() {
    CALLS.with(|c| c.borrow_mut().clear());
    assert_eq!(acc_zero(0).unwrap(), 0);
    CALLS.with(|c| assert_eq!(*c.borrow(), [0]));
}

#[oom_retry(batch = bs, remember = false)]
#[no_grad]
fn acc_always_oom(dev: &Device, bs: usize, fixed: usize) -> Result<(), Error> {
    TRIED.with(|t| t.borrow_mut().push(bs));
    let _fixed = dev.alloc::<u8>(fixed)?;
    let _rows = dev.alloc::<u8>(bs * MIB)?;
    Ok(())
}

/// test_approach_zero: out of memory at every size down to 1 row is an error (an OOM, with the
/// sizes tried), never a call with 0 rows, and its text says what to do.
#[test]
fn acc_approach_zero() {
    TRIED.with(|t| t.borrow_mut().clear());
    let dev = Device::sim(ByteSize::mib(8));
    // 8 MiB fixed fills the device: no row ever fits
    let err = acc_always_oom(&dev, 16, 8 * MIB).unwrap_err();
    assert!(err.is_oom(), "{err}");
    let tried = TRIED.with(|t| t.borrow().clone());
    assert!(!tried.contains(&0), "{tried:?}");
    assert_eq!(*tried.last().unwrap(), 1, "{tried:?}");
    let Error::RetriesExhausted { report, .. } = &err else {
        panic!("{err:?}")
    };
    assert_eq!(report.final_plan.batch(), 1, "{report}");
    let text = err.to_string();
    assert!(text.contains("1 row") || text.contains("batch 1"), "{text}");
}

/// test_approach_zero with a request that no batch shrinks (larger than the device): oomguard
/// stops early (documented: `StopReason::TooLarge`) and says what to do.
#[test]
fn acc_approach_zero_request_too_large() {
    TRIED.with(|t| t.borrow_mut().clear());
    let dev = Device::sim(ByteSize::mib(8));
    let err = acc_always_oom(&dev, 16, 10 * MIB).unwrap_err();
    assert!(err.is_oom(), "{err}");
    let Error::RetriesExhausted { report, .. } = &err else {
        panic!("{err:?}")
    };
    assert!(
        matches!(report.stopped, Some(StopReason::TooLarge { .. })),
        "{report}"
    );
    let text = err.to_string();
    assert!(
        text.contains("larger") || text.contains("capacity"),
        "no advice: {text}"
    );
}

/// test_reduce_batch_size_fn_is_used_by_the_decorator: a custom back-off (halving) is used.
#[test]
fn acc_custom_reduce_fn() {
    let dev = Device::sim(ByteSize::mib(16));
    let halve = FnPolicy(|c: &RetryContext| {
        (c.plan.batch() > 1).then(|| BatchPlan::whole(c.plan.batch() / 2).unwrap())
    });
    let engine = RetryEngine::new().with_policy(halve).regrow_after(None);
    let mut tried = Vec::new();
    let out = no_grad_run(|| {
        engine.run(
            &dev,
            256,
            |plan| {
                tried.push(plan.batch());
                dev.alloc::<u8>(plan.batch() * MIB).map(|a| a.len() / MIB)
            },
            |rows| rows,
        )
    })
    .unwrap();
    assert_eq!(tried, [256, 128, 64, 32, 16]);
    assert_eq!(out.value, 16);
}

#[derive(Debug)]
enum StepErr {
    Device(Error),
    Oops(String),
}
impl std::fmt::Display for StepErr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StepErr::Device(e) => write!(f, "{e}"),
            StepErr::Oops(s) => write!(f, "{s}"),
        }
    }
}
impl IsOom for StepErr {
    fn is_oom(&self) -> bool {
        matches!(self, StepErr::Device(e) if e.is_oom())
    }
}
impl From<Error> for StepErr {
    fn from(e: Error) -> Self {
        StepErr::Device(e)
    }
}

/// test_any_other_error: an error that is not out-of-memory propagates unchanged, not retried.
#[test]
fn acc_any_other_error_engine() {
    let dev = Device::sim(ByteSize::mib(8));
    let mut calls = 0;
    let err = RetryEngine::new()
        .run(
            &dev,
            16,
            |_plan| {
                calls += 1;
                let _a = dev.alloc::<u8>(MIB)?;
                Err::<(), _>(StepErr::Oops("Oops, we had an error!".into()))
            },
            |()| (),
        )
        .unwrap_err();
    assert_eq!(calls, 1);
    match err {
        RetryError::Step {
            error: StepErr::Oops(s),
            report,
        } => {
            assert_eq!(s, "Oops, we had an error!");
            assert_eq!(report.retries(), 0);
        }
        other => panic!("{other}"),
    }
}

#[oom_retry(batch = bs)]
#[no_grad]
fn acc_oops(bs: usize) -> Result<(), StepErr> {
    CALLS.with(|c| c.borrow_mut().push(bs));
    Err(StepErr::Oops("Oops, we had an error!".into()))
}

#[test]
fn acc_any_other_error_macro() {
    CALLS.with(|c| c.borrow_mut().clear());
    match acc_oops(16) {
        Err(StepErr::Oops(s)) => assert_eq!(s, "Oops, we had an error!"),
        other => panic!("{other:?}"),
    }
    CALLS.with(|c| assert_eq!(*c.borrow(), [16]));
}

/// test_release_memory / "memory not freed between tries": every attempt starts with what was
/// allocated before the step, and the step leaves nothing behind.
#[test]
fn acc_memory_released_between_tries() {
    let dev = Device::sim(ByteSize::mib(64));
    let _model = dev.alloc::<u8>(8 * MIB).unwrap(); // lives across the step
    let base = allocated(&dev);
    let mut at_start = Vec::new();
    let out = no_grad_run(|| {
        RetryEngine::new().with_policy(inference_policy()).run(
            &dev,
            300,
            |plan| {
                at_start.push(allocated(&dev));
                let mut kept = Vec::new();
                for c in plan.chunks() {
                    kept.push(dev.alloc::<u8>(c.len() * MIB / 4)?); // every chunk's output kept
                }
                Ok::<_, Error>(kept.len())
            },
            |n| n,
        )
    })
    .unwrap();
    assert!(out.report.retries() > 0);
    assert!(
        at_start.iter().all(|&b| b == base),
        "{at_start:?} vs {base}"
    );
    assert_eq!(allocated(&dev), base);
}

/// The Step form: `begin` resets, `abort` frees a failed attempt's state, the commit runs once.
struct AccStep {
    dev: Device,
    acc: Option<oomguard::DeviceBuffer<u8>>,
    begins: usize,
    aborts: usize,
    commits: usize,
    rows: usize,
}
impl Step for AccStep {
    type Error = Error;
    type Output = usize;
    fn begin(&mut self, _plan: &BatchPlan) -> Result<(), Error> {
        self.begins += 1;
        self.rows = 0;
        assert!(
            self.acc.is_none(),
            "the previous attempt's state was not aborted"
        );
        self.acc = Some(self.dev.alloc::<u8>(MIB)?);
        Ok(())
    }
    fn micro_batch(&mut self, c: &Chunk) -> Result<(), Error> {
        let _acts = self.dev.alloc::<u8>(c.len() * MIB)?;
        self.rows += c.len();
        Ok(())
    }
    fn abort(&mut self) {
        self.aborts += 1;
        self.acc = None;
    }
    fn commit(&mut self) -> usize {
        self.commits += 1;
        self.acc = None;
        self.rows
    }
}

#[test]
fn acc_step_state_released_between_tries() {
    let dev = Device::sim(ByteSize::mib(32));
    let mut step = AccStep {
        dev: dev.clone(),
        acc: None,
        begins: 0,
        aborts: 0,
        commits: 0,
        rows: 0,
    };
    let out = RetryEngine::new().run_step(&dev, 100, &mut step).unwrap();
    assert_eq!(out.value, 100);
    assert_eq!(step.commits, 1);
    assert_eq!(step.aborts, step.begins - 1);
    assert_eq!(out.report.retries(), step.aborts);
    assert_eq!(allocated(&dev), 0);
}

/// Accelerate's complaint "an eval OOM shrinks the train batch": plans are remembered per mode,
/// so an evaluation that shrank does not make the training step at the same site smaller.
#[test]
fn acc_eval_oom_does_not_shrink_train() {
    let dev = Device::sim(ByteSize::mib(64));
    let engine = RetryEngine::new().with_policy(inference_policy());
    let step = |engine: &RetryEngine, per_row: usize| {
        let mut lp = engine.begin_at::<Error>("shared site", &dev, 32).unwrap();
        loop {
            let plan = lp.plan();
            let r = (|| {
                let mut rows = 0;
                for c in plan.chunks() {
                    rows += dev.alloc::<u8>(c.len() * per_row)?.len() / per_row;
                }
                Ok(rows)
            })();
            if let std::ops::ControlFlow::Break(done) = lp.next(r) {
                break done.unwrap();
            }
        }
    };
    // evaluation: 32 rows of 4 MiB on 64 MiB: split (or shrunk)
    let (_, eval) = no_grad_run(|| step(&engine, 4 * MIB));
    assert!(eval.retries() > 0);
    // training at the same site, rows of 1 MiB: fits whole, and must start whole
    let (rows, train) = step(&engine, MIB);
    assert_eq!(rows, 32);
    assert!(!train.from_memory, "{train}");
    assert_eq!(train.final_plan, BatchPlan::whole(32).unwrap(), "{train}");
}

#[oom_retry(batch = bs, remember = false)]
fn acc_train_batch(dev: &Device, bs: usize) -> Result<usize, Error> {
    TRIED.with(|t| t.borrow_mut().push(bs));
    Ok(dev.alloc::<u8>(bs * MIB)?.len() / MIB)
}

/// Accelerate's complaint "gradient accumulation not adjusted (the effective batch shrinks)": a
/// training step (grad on) is never shrunk by `batch =`; it fails, and the text says what to use.
#[test]
fn acc_training_batch_never_shrunk() {
    TRIED.with(|t| t.borrow_mut().clear());
    let dev = Device::sim(ByteSize::mib(8));
    let err = acc_train_batch(&dev, 64).unwrap_err();
    assert!(err.is_oom());
    TRIED.with(|t| assert!(t.borrow().iter().all(|&b| b == 64), "{:?}", t.borrow()));
    let text = err.to_string();
    assert!(
        text.contains("plan") || text.contains("no_grad"),
        "no advice: {text}"
    );
}

// ------------------------------------------------------------------------------------------
// Lightning: scale_batch_size / BatchSizeFinder
// ------------------------------------------------------------------------------------------

fn affine_step(
    dev: &Device,
    fixed: usize,
    row: usize,
) -> impl FnMut(usize) -> Result<(), Error> + '_ {
    move |rows| {
        let _ws = dev.alloc::<u8>(fixed)?;
        let _acts = dev.alloc::<u8>(rows * row)?;
        Ok(())
    }
}

/// test_call_to_trainer_method (power and binsearch): the batch found runs, is at most the true
/// maximum, and is within the documented 0.95 of it.
#[test]
fn lit_finder_finds_the_maximum() {
    for (cap, fixed, row) in [
        (256u64, 16 * MIB, MIB),
        (1024, 100 * MIB, 3 * MIB + 12345),
        (96, 0, 64 << 10),
    ] {
        let truth = max_rows(ByteSize::mib(cap), fixed, row);
        let dev = Device::sim(ByteSize::mib(cap));
        let r = find_max_batch(
            &dev,
            FinderOptions::default(),
            affine_step(&dev, fixed, row),
        )
        .unwrap();
        assert!(
            r.max_batch <= truth,
            "cap {cap}: found {} > true max {truth}: {r}",
            r.max_batch
        );
        assert!(
            r.max_batch as f64 >= 0.95 * truth as f64,
            "cap {cap}: found {} of {truth}: {r}",
            r.max_batch
        );
        affine_step(&dev, fixed, row)(r.max_batch).unwrap();
    }
}

/// test_dataloader_batch_size_updated_on_failure (binsearch → 100): init_val 500, OOM above 100
/// rows, steps_per_trial 1, max_trials 10.
#[test]
fn lit_init_val_above_the_limit() {
    let dev = Device::sim(ByteSize::mib(100));
    assert_eq!(max_rows(ByteSize::mib(100), 0, MIB), 100);
    let opts = FinderOptions {
        start: 500,
        max_trials: 10,
        steps_per_trial: 1,
        ..FinderOptions::default()
    };
    let r = find_max_batch(&dev, opts, affine_step(&dev, 0, MIB)).unwrap();
    assert_eq!(r.trials[0].rows, 500, "init_val is the first trial");
    assert!(r.trials.len() <= 10, "{r}");
    assert!((95..=100).contains(&r.max_batch), "{r}");
}

/// init_val is the first size tried.
#[test]
fn lit_init_val_is_first_trial() {
    let dev = Device::sim(ByteSize::mib(256));
    let opts = FinderOptions {
        start: 17,
        ..FinderOptions::default()
    };
    let r = find_max_batch(&dev, opts, affine_step(&dev, 0, MIB)).unwrap();
    assert_eq!(r.trials[0].rows, 17);
    assert!(r.max_batch <= 256 && r.max_batch >= 243, "{r}");
}

/// max_trials bounds the search; when it stops the search the report says so, and what it
/// returns still ran.
#[test]
fn lit_max_trials() {
    // memory that jumps at 150 rows: the linear prediction fails, the search needs more trials
    let dev = Device::sim(ByteSize::mib(256));
    let step = |rows: usize| -> Result<(), Error> {
        let _a = dev.alloc::<u8>(rows * MIB)?;
        let _b = if rows >= 150 {
            Some(dev.alloc::<u8>(100 * MIB)?)
        } else {
            None
        };
        Ok(())
    };
    let truth = 156; // 156 + 100 = 256
    for max_trials in [2u32, 3, 4, 16] {
        let opts = FinderOptions {
            max_trials,
            ..FinderOptions::default()
        };
        let r = find_max_batch(&dev, opts, step).unwrap();
        assert!(r.trials.len() <= max_trials as usize, "{max_trials}: {r}");
        assert!(r.max_batch <= truth, "{max_trials}: {r}");
        step(r.max_batch).unwrap();
        if r.stopped_by_max_trials {
            assert_eq!(r.trials.len(), max_trials as usize, "{r}");
        }
    }
}

/// test_scale_batch_size_no_trials (max_trials=0 returns init_val in Lightning): oomguard refuses
/// fewer than 2 trials, with a text that says why.
#[test]
fn lit_max_trials_zero_is_refused() {
    let dev = Device::sim(ByteSize::mib(64));
    for t in [0u32, 1] {
        let opts = FinderOptions {
            max_trials: t,
            ..FinderOptions::default()
        };
        let err = find_max_batch(&dev, opts, affine_step(&dev, 0, MIB)).unwrap_err();
        assert!(matches!(err, FinderError::InvalidArgument(_)), "{err}");
        assert!(err.to_string().contains("max_trials"), "{err}");
    }
}

/// steps_per_trial: each trial runs the step that many times; the report counts the runs.
#[test]
fn lit_steps_per_trial() {
    for spt in [1u32, 2, 3] {
        let dev = Device::sim(ByteSize::mib(128));
        let calls = AtomicUsize::new(0);
        let opts = FinderOptions {
            steps_per_trial: spt,
            verify_steps: 4,
            ..FinderOptions::default()
        };
        let r = find_max_batch(&dev, opts, |rows| {
            calls.fetch_add(1, Ordering::Relaxed);
            affine_step(&dev, 0, MIB)(rows)
        })
        .unwrap();
        assert_eq!(r.step_runs(), calls.load(Ordering::Relaxed), "{r}");
        for t in r.trials.iter().filter(|t| t.peak_bytes.is_some()) {
            assert_eq!(t.steps, spt, "{r}");
        }
        assert_eq!(r.steps_per_trial, spt);
    }
}

/// The size found never passes `max` (Lightning: "greater or equal than the length of the
/// dataset"): everything fits, the result is `max`.
#[test]
fn lit_max_caps_the_result() {
    let dev = Device::sim(ByteSize::mib(256));
    let opts = FinderOptions {
        start: 2,
        max: 64,
        ..FinderOptions::default()
    };
    let r = find_max_batch(&dev, opts, affine_step(&dev, 0, MIB)).unwrap();
    assert_eq!(r.max_batch, 64, "{r}");
    assert!(r.trials.iter().all(|t| t.rows <= 64), "{r}");
}

/// margin: values outside [0, 1) are refused; with a margin the result still runs and stays
/// at most the true maximum.
#[test]
fn lit_margin() {
    let dev = Device::sim(ByteSize::mib(256));
    for m in [1.0, -0.1, f64::NAN, 2.0] {
        let opts = FinderOptions {
            margin: m,
            ..FinderOptions::default()
        };
        let err = find_max_batch(&dev, opts, affine_step(&dev, 0, MIB)).unwrap_err();
        assert!(err.to_string().contains("margin"), "{m}: {err}");
    }
    for m in [0.0, 0.05, 0.5] {
        let opts = FinderOptions {
            margin: m,
            ..FinderOptions::default()
        };
        let r = find_max_batch(&dev, opts, affine_step(&dev, 16 * MIB, MIB)).unwrap();
        assert!(r.max_batch <= 240, "{m}: {r}");
        affine_step(&dev, 16 * MIB, MIB)(r.max_batch).unwrap();
    }
}

/// Bad arguments are refused with a text naming the option.
#[test]
fn lit_bad_arguments() {
    let dev = Device::sim(ByteSize::mib(64));
    let cases = [
        (
            FinderOptions {
                start: 0,
                ..FinderOptions::default()
            },
            "start",
        ),
        (
            FinderOptions {
                start: 10,
                max: 5,
                ..FinderOptions::default()
            },
            "max",
        ),
        (
            FinderOptions {
                steps_per_trial: 0,
                ..FinderOptions::default()
            },
            "steps_per_trial",
        ),
    ];
    for (opts, word) in cases {
        let calls = AtomicUsize::new(0);
        let err = find_max_batch(&dev, opts, |rows| {
            calls.fetch_add(1, Ordering::Relaxed);
            affine_step(&dev, 0, MIB)(rows)
        })
        .unwrap_err();
        assert!(matches!(err, FinderError::InvalidArgument(_)), "{err}");
        assert!(err.to_string().contains(word), "{err}");
        assert_eq!(calls.load(Ordering::Relaxed), 0);
    }
}

/// A step error that is not an OOM stops the search and comes back unchanged.
#[test]
fn lit_other_error_propagates() {
    let dev = Device::sim(ByteSize::mib(64));
    let err = find_max_batch(&dev, FinderOptions::default(), |rows| {
        if rows > 4 {
            return Err(StepErr::Oops(format!("bad row at {rows}")));
        }
        let _a = dev.alloc::<u8>(rows * MIB)?;
        Ok(())
    })
    .unwrap_err();
    match err {
        FinderError::Step(StepErr::Oops(s)) => assert_eq!(s, "bad row at 8"),
        other => panic!("{other}"),
    }
}

/// Not even one row fits: an error that says what to change.
#[test]
fn lit_nothing_fits() {
    let dev = Device::sim(ByteSize::mib(64));
    let err = find_max_batch(
        &dev,
        FinderOptions::default(),
        affine_step(&dev, 80 * MIB, MIB),
    )
    .unwrap_err();
    assert!(matches!(err, FinderError::NothingFits(_)), "{err}");
    let text = err.to_string();
    assert!(text.contains("larger device"), "{text}");
}

/// test_trainer_reset_correctly (the parts that apply): the finder leaves the device as it found
/// it (nothing allocated by it, its cache emptied).
#[test]
fn lit_device_left_as_found() {
    let dev = Device::sim(ByteSize::mib(256));
    let _model = dev.alloc::<u8>(32 * MIB).unwrap();
    let before = dev.stats();
    let r = find_max_batch(
        &dev,
        FinderOptions::default(),
        affine_step(&dev, 8 * MIB, MIB),
    )
    .unwrap();
    let after = dev.stats();
    assert_eq!(
        after.allocated_bytes.all.current,
        before.allocated_bytes.all.current
    );
    assert_eq!(
        after.reserved_bytes.all.current,
        before.reserved_bytes.all.current
    );
    // room left: 224 MiB; 8 MiB fixed: 216 rows
    assert!(r.max_batch <= 216 && r.max_batch >= 205, "{r}");
}

/// A step that retries OOM itself is refused (its success says nothing about the rows asked).
#[test]
fn lit_refuses_a_step_that_retries_inside() {
    let dev = Device::sim(ByteSize::mib(64));
    let engine = RetryEngine::new();
    // the first trial (100 rows of 1 MiB on 64 MiB) makes the inner engine split the batch
    let opts = FinderOptions {
        start: 100,
        ..FinderOptions::default()
    };
    let err = find_max_batch(&dev, opts, |rows| {
        engine
            .run(
                &dev,
                rows,
                |plan| {
                    for c in plan.chunks() {
                        dev.alloc::<u8>(c.len() * MIB)?;
                    }
                    Ok::<_, Error>(())
                },
                |()| (),
            )
            .map(|_| ())
            .map_err(|e| e.into_error().unwrap())
    })
    .unwrap_err();
    assert!(
        matches!(
            err,
            FinderError::RetriesInside { .. } | FinderError::SplitInside { .. }
        ),
        "{err}"
    );
}

/// The found size is kept for training: an engine seeded from the report runs a step of that
/// batch without a retry.
#[test]
fn lit_found_size_seeds_training() {
    let dev = Device::sim(ByteSize::mib(128));
    let r = find_max_batch(&dev, FinderOptions::default(), affine_step(&dev, 0, MIB)).unwrap();
    let engine = RetryEngine::new().start_from_finder(&r);
    let out = engine
        .run(
            &dev,
            4 * r.max_batch,
            |plan| {
                let mut rows = 0;
                for c in plan.chunks() {
                    rows += dev.alloc::<u8>(c.len() * MIB)?.len() / MIB;
                }
                Ok::<_, Error>(rows)
            },
            |rows| rows,
        )
        .unwrap();
    assert_eq!(out.value, 4 * r.max_batch);
    assert_eq!(out.report.retries(), 0, "{}", out.report);
}

// ------------------------------------------------------------------------------------------
// Composer: device_train_microbatch_size='auto'
// ------------------------------------------------------------------------------------------

const D: usize = 4;

/// Linear regression data: `n` rows of `D` features, targets.
fn data(n: usize, seed: u32) -> (Vec<f32>, Vec<f32>) {
    let mut s = seed.wrapping_mul(2654435761).wrapping_add(12345);
    let mut rnd = || {
        s ^= s << 13;
        s ^= s >> 17;
        s ^= s << 5;
        (s % 2000) as f32 / 1000.0 - 1.0
    };
    let x: Vec<f32> = (0..n * D).map(|_| rnd()).collect();
    let y: Vec<f32> = (0..n)
        .map(|i| x[i * D] * 2.0 - x[i * D + 1] + 0.5 * x[i * D + 3] + rnd() * 0.1)
        .collect();
    (x, y)
}

/// One micro-batch's gradient of the mean squared error, weighted by its share of the batch. The
/// chunk's rows go to the device, with `act` bytes of activations per row.
fn chunk_grad(
    dev: &Device,
    x: &[f32],
    y: &[f32],
    w: &[f32; D],
    c: &Chunk,
    act: usize,
) -> Result<[f32; D], Error> {
    let xs = dev.from_slice(&x[c.start() * D..c.end() * D])?.to_vec()?;
    let ys = dev.from_slice(&y[c.rows()])?.to_vec()?;
    let _acts = dev.alloc::<u8>(c.len() * act)?;
    let mut g = [0f32; D];
    for r in 0..c.len() {
        let row = &xs[r * D..(r + 1) * D];
        let err: f32 = row.iter().zip(w).map(|(a, b)| a * b).sum::<f32>() - ys[r];
        for k in 0..D {
            g[k] += 2.0 * err * row[k] / c.len() as f32;
        }
    }
    let wt = c.weight_f32();
    Ok(g.map(|v| v * wt))
}

fn train(
    dev: &Device,
    engine: &RetryEngine,
    steps: usize,
    batch: usize,
    act: usize,
) -> ([f32; D], usize, Vec<oomguard::retry::RetryReport>) {
    let mut w = [0f32; D];
    let mut commits = 0;
    let mut reports = Vec::new();
    for s in 0..steps {
        let (x, y) = data(batch, s as u32);
        let w0 = w;
        let out = engine
            .run(
                dev,
                batch,
                |plan| {
                    let mut g = [0f32; D];
                    for c in plan.chunks() {
                        let cg = chunk_grad(dev, &x, &y, &w0, &c, act)?;
                        for k in 0..D {
                            g[k] += cg[k];
                        }
                    }
                    Ok::<_, Error>(g)
                },
                |g| {
                    commits += 1;
                    for k in 0..D {
                        w[k] -= 0.1 * g[k];
                    }
                },
            )
            .unwrap();
        reports.push(out.report);
    }
    (w, commits, reports)
}

/// test_auto_microbatch: training with auto micro-batching gives the same model as training
/// without a split (Composer: assert_state_equivalent), one optimizer step per batch.
#[test]
fn comp_auto_microbatch_equals_unsplit() {
    let big = Device::sim(ByteSize::gib(1));
    let small = Device::sim(ByteSize::mib(32));
    let (w_ref, c_ref, r_ref) = train(&big, &RetryEngine::new(), 6, 256, MIB);
    let (w, c, r) = train(&small, &RetryEngine::new(), 6, 256, MIB);
    assert!(r_ref.iter().all(|r| r.final_plan.num_chunks() == 1));
    assert!(r[0].final_plan.num_chunks() > 1, "{}", r[0]);
    assert!(r.iter().all(|r| r.final_plan.batch() == 256));
    assert_eq!((c_ref, c), (6, 6));
    for k in 0..D {
        let tol = 1e-5 * w_ref[k].abs().max(1.0);
        assert!(
            (w[k] - w_ref[k]).abs() <= tol,
            "w[{k}] {} vs {}",
            w[k],
            w_ref[k]
        );
    }
}

/// _adjust_device_train_microbatch_size: on OOM the micro-batch halves (after one same-size retry
/// with the cache emptied), the batch stays, until it fits.
#[test]
fn comp_halving_on_oom() {
    let dev = Device::sim(ByteSize::mib(20));
    let mut micro = Vec::new();
    let out = RetryEngine::new()
        .run(
            &dev,
            256,
            |plan| {
                micro.push((plan.batch(), plan.micro_batch()));
                for c in plan.chunks() {
                    dev.alloc::<u8>(c.len() * MIB)?;
                }
                Ok::<_, Error>(())
            },
            |()| (),
        )
        .unwrap();
    // 256 MiB is more than the whole device: the same-plan retry is skipped (Pressure::TooLarge)
    assert_eq!(
        micro,
        [(256, 256), (256, 128), (256, 64), (256, 32), (256, 16)]
    );
    assert_eq!(out.report.final_plan.micro_batch(), 16);
}

/// "The train loop failed with an internal microbatch of size 1": an error, and its text says
/// what to do.
#[test]
fn comp_microbatch_of_one_still_oom() {
    let dev = Device::sim(ByteSize::mib(16));
    let mut last = None;
    let err = RetryEngine::new()
        .run(
            &dev,
            8,
            |plan| {
                last = Some(plan.micro_batch());
                for c in plan.chunks() {
                    dev.alloc::<u8>(c.len() * 20 * MIB)?; // 20 MiB a row on 16 MiB
                }
                Ok::<_, Error>(())
            },
            |()| (),
        )
        .unwrap_err();
    assert_eq!(last, Some(1));
    let report = err.report().unwrap().clone();
    assert_eq!(report.final_plan.micro_batch(), 1, "{report}");
    let e = err.into_error().unwrap();
    assert!(e.is_oom());
    let text = e.to_string();
    assert!(text.contains("larger"), "no advice: {text}");
}

/// Composer keeps the reduced micro-batch for the following batches: the next step starts from
/// it without an OOM.
#[test]
fn comp_reduced_microbatch_is_kept() {
    let dev = Device::sim(ByteSize::mib(40));
    let engine = RetryEngine::new();
    let (_, _, reports) = train(&dev, &engine, 4, 256, MIB);
    assert!(reports[0].retries() > 0);
    for r in &reports[1..] {
        assert_eq!(r.retries(), 0, "{r}");
        assert!(r.from_memory, "{r}");
        assert_eq!(r.final_plan, reports[0].final_plan);
    }
}

/// The OOM flag all-reduced across ranks: a rank that fits follows the rank that ran out of
/// memory; both run the same plan, commit once, and compute the gradient of their whole batch.
#[test]
fn comp_oom_flag_agreed_across_ranks() {
    let handles: Vec<_> = LocalGroup::new(2)
        .into_iter()
        .enumerate()
        .map(|(rank, g)| {
            thread::spawn(move || {
                let dev = Device::sim(ByteSize::mib(if rank == 0 { 32 } else { 1024 }));
                let engine = RetryEngine::new().with_consensus(g);
                let (w, commits, reports) = train(&dev, &engine, 3, 128, MIB);
                let (w_ref, _, _) = train(
                    &Device::sim(ByteSize::gib(1)),
                    &RetryEngine::new(),
                    3,
                    128,
                    MIB,
                );
                (w, w_ref, commits, reports)
            })
        })
        .collect();
    let out: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(out[0].3[0].final_plan, out[1].3[0].final_plan);
    assert!(out[1].3[0].final_plan.num_chunks() > 1);
    assert!(
        out[1].3[0]
            .attempts
            .iter()
            .any(|a| a.outcome == AttemptOutcome::PeerOom),
        "{}",
        out[1].3[0]
    );
    for (w, w_ref, commits, _) in &out {
        assert_eq!(*commits, 3);
        for k in 0..D {
            assert!((w[k] - w_ref[k]).abs() <= 1e-5 * w_ref[k].abs().max(1.0));
        }
    }
}

/// Thrashing (_update_num_consecutive_thrashes): allocator retries in consecutive steps move the
/// step to smaller micro-batches before a hard OOM; every row is still processed.
#[test]
fn comp_thrashing_moves_down() {
    let dev = Device::new(
        SimDevice::new(ByteSize::mib(64)),
        AllocatorConfig::parse("expandable_segments:False").unwrap(),
    );
    let engine = RetryEngine::new();
    let mut moved_at = None;
    let mut plans = Vec::new();
    for s in 0..6 {
        let before = dev.stats().num_alloc_retries;
        let out = engine
            .run(
                &dev,
                50,
                |plan| {
                    drop(dev.alloc::<u8>(30 * MIB)?); // cached: a 50 MiB request must free it
                    let mut rows = 0;
                    for c in plan.chunks() {
                        rows += dev.alloc::<u8>(c.len() * MIB)?.len() / MIB;
                    }
                    dev.empty_cache()?; // each step starts from an emptied cache (as Composer's OOM path)
                    Ok::<_, Error>(rows)
                },
                |rows| rows,
            )
            .unwrap();
        assert_eq!(out.value, 50);
        let retried = dev.stats().num_alloc_retries > before;
        plans.push((out.report.final_plan, retried));
        if out.report.thrash_moved_to.is_some() && moved_at.is_none() {
            moved_at = Some(s);
        }
    }
    let moved_at = moved_at.unwrap_or_else(|| panic!("never moved down: {plans:?}"));
    assert!(moved_at <= 2, "{plans:?}");
    assert!(plans.last().unwrap().0.num_chunks() > 1, "{plans:?}");
    assert!(!plans.last().unwrap().1, "still thrashing: {plans:?}");
}

/// Eval auto micro-batching: an evaluation batch that does not fit is split, every row is still
/// evaluated, and the metric is the unsplit one.
#[test]
fn comp_eval_auto_microbatch() {
    let (x, y) = data(300, 7);
    let w = [2.0f32, -1.0, 0.0, 0.5];
    let eval = |dev: &Device| {
        no_grad_run(|| {
            RetryEngine::new().with_policy(inference_policy()).run(
                dev,
                300,
                |plan| {
                    let mut metric = 0f32;
                    let mut rows = 0;
                    for c in plan.chunks() {
                        let g = chunk_grad(dev, &x, &y, &w, &c, MIB)?;
                        metric += g.iter().sum::<f32>();
                        rows += c.len();
                    }
                    Ok::<_, Error>((metric, rows))
                },
                |m| m,
            )
        })
        .unwrap()
    };
    let whole = eval(&Device::sim(ByteSize::gib(1)));
    let split = eval(&Device::sim(ByteSize::mib(40)));
    assert_eq!(split.report.mode, StepMode::Eval);
    assert!(split.report.final_plan.num_chunks() > 1, "{}", split.report);
    assert_eq!(split.value.1, 300, "rows dropped: {}", split.report);
    assert!((split.value.0 - whole.value.0).abs() <= 1e-4 * whole.value.0.abs().max(1.0));
}

/// test_auto_microbatch_cuda_error: an error that is not an OOM is not retried and is returned.
#[test]
fn comp_non_oom_error_not_retried() {
    let dev = Device::sim(ByteSize::mib(16));
    let mut calls = 0;
    let err = RetryEngine::new()
        .run(
            &dev,
            64,
            |_plan| {
                calls += 1;
                Err::<(), _>(Error::InvalidArgument("c10".into()))
            },
            |()| (),
        )
        .unwrap_err();
    assert_eq!(calls, 1);
    assert!(
        matches!(err, RetryError::Step { error: Error::InvalidArgument(ref s), .. } if s == "c10"),
        "{err}"
    );
}

/// Regrow after clean steps (Composer doubles the micro-batch back under FSDP): the try one size
/// up may run out of memory on purpose; the step still commits once, with every row.
#[test]
fn comp_regrow_is_safe() {
    let dev = Device::sim(ByteSize::mib(40));
    let engine = RetryEngine::new().regrow_after(Some(2));
    let (w_ref, _, _) = train(
        &Device::sim(ByteSize::gib(1)),
        &RetryEngine::new(),
        8,
        256,
        MIB,
    );
    let (w, commits, reports) = train(&dev, &engine, 8, 256, MIB);
    assert_eq!(commits, 8);
    let regrows: Vec<_> = reports.iter().filter_map(|r| r.regrow).collect();
    assert!(!regrows.is_empty(), "no regrow tried");
    assert!(regrows.iter().all(|g| !g.succeeded));
    for k in 0..D {
        assert!((w[k] - w_ref[k]).abs() <= 1e-5 * w_ref[k].abs().max(1.0));
    }
}

struct Trainer {
    dev: Device,
    x: Vec<f32>,
    y: Vec<f32>,
    w: [f32; D],
    updates: usize,
}

impl Trainer {
    #[oom_retry(plan = plan, commit = |g| self.apply(g))]
    fn step(&mut self, plan: &BatchPlan) -> Result<[f32; D], Error> {
        let mut g = [0f32; D];
        for c in plan.chunks() {
            let cg = chunk_grad(&self.dev, &self.x, &self.y, &self.w, &c, MIB)?;
            for k in 0..D {
                g[k] += cg[k];
            }
        }
        Ok(g)
    }
    fn apply(&mut self, g: [f32; D]) -> Result<[f32; D], Error> {
        self.updates += 1;
        for (w, g) in self.w.iter_mut().zip(g) {
            *w -= 0.1 * g;
        }
        Ok(self.w)
    }
}

/// The macro form of auto micro-batching: the same update as the unsplit step, applied once.
#[test]
fn comp_macro_microbatch_equals_unsplit() {
    let (x, y) = data(200, 3);
    let mut small = Trainer {
        dev: Device::sim(ByteSize::mib(24)),
        x: x.clone(),
        y: y.clone(),
        w: [0.0; D],
        updates: 0,
    };
    let mut big = Trainer {
        dev: Device::sim(ByteSize::gib(1)),
        x,
        y,
        w: [0.0; D],
        updates: 0,
    };
    let plan = BatchPlan::whole(200).unwrap();
    let a = small.step(&plan).unwrap();
    let ra = last_report().unwrap();
    let b = big.step(&plan).unwrap();
    assert!(ra.final_plan.num_chunks() > 1, "{ra}");
    assert_eq!((small.updates, big.updates), (1, 1));
    for k in 0..D {
        assert!(
            (a[k] - b[k]).abs() <= 1e-5 * b[k].abs().max(1.0),
            "{a:?} vs {b:?}"
        );
    }
}

/// Ranks whose plans disagree on rows: rank 0 evaluates-style (its policy shrinks the batch),
/// rank 1 trains with the engine's default training policy (gradient accumulation, "the batch
/// and the result stay the same"). Rank 1 must not train on part of its batch: either every rank
/// stops (`StopReason::RanksDisagreeOnRows`) or rank 1 runs all 16 rows.
#[test]
fn comp_training_rank_never_follows_a_rank_that_drops_rows() {
    let handles: Vec<_> = LocalGroup::new(2)
        .into_iter()
        .enumerate()
        .map(|(rank, g)| {
            thread::spawn(move || {
                let dev = Device::sim(ByteSize::mib(if rank == 0 { 4 } else { 1024 }));
                let engine = if rank == 0 {
                    RetryEngine::new().with_policy(inference_policy())
                } else {
                    RetryEngine::new() // training_policy()
                }
                .with_mode_hook(|| StepMode::Train)
                .with_consensus(g);
                let mut trained_rows = None;
                let r = engine.run(
                    &dev,
                    16,
                    |plan| {
                        // the batch's inputs stay held: 16 rows are the whole of rank 0's device
                        let _inputs = dev.alloc::<u8>(plan.batch() * MIB / 4)?;
                        let mut rows = 0;
                        for c in plan.chunks() {
                            rows += dev.alloc::<u8>(c.len() * MIB / 4)?.len() / (MIB / 4);
                        }
                        Ok::<_, Error>(rows)
                    },
                    |rows| trained_rows = Some(rows),
                );
                (r.map(|o| o.report).map_err(|e| e.to_string()), trained_rows)
            })
        })
        .collect();
    let out: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let (r1, rows1) = &out[1];
    if let Some(rows) = rows1 {
        assert_eq!(
            *rows, 16,
            "rank 1 (training policy) trained on {rows} of its 16 rows: {r1:?}"
        );
    }
}

#[allow(dead_code)]
fn _unused() {
    let _ = PolicyExt::max_retries(Accumulate::halving(), 1);
}

struct Evaluator {
    dev: Device,
    cursor: usize,
    seen: Vec<usize>,
}

impl Evaluator {
    /// Accelerate's complaint "no log of the chosen size": the commit sees the batch that ran, so
    /// a cursor advanced by it skips no rows, and the report tells the size chosen.
    #[oom_retry(batch = bs, commit = |rows| self.advance(bs, rows), remember = false)]
    #[no_grad]
    fn eval(&mut self, bs: usize) -> Result<usize, Error> {
        let base = allocated(&self.dev);
        self.seen.push(base as usize);
        let _acts = self.dev.alloc::<u8>(bs * MIB)?;
        Ok(bs)
    }
    fn advance(&mut self, bs: usize, rows: usize) -> Result<usize, Error> {
        assert_eq!(bs, rows);
        self.cursor += bs;
        Ok(rows)
    }
}

#[test]
fn acc_chosen_size_reaches_the_commit_and_the_report() {
    let mut e = Evaluator {
        dev: Device::sim(ByteSize::mib(20)),
        cursor: 0,
        seen: Vec::new(),
    };
    let _held = e.dev.alloc::<u8>(2 * MIB).unwrap();
    let rows = e.eval(64).unwrap();
    let r = last_report().unwrap();
    assert_eq!((r.requested_batch, r.final_plan.batch()), (64, rows));
    assert_eq!(e.cursor, rows);
    assert!((9..=18).contains(&rows), "{r}");
    // every attempt started with only what was held before the call
    assert!(e.seen.iter().all(|&b| b == 2 * MIB), "{:?}", e.seen);
}

/// Composer's "all ranks finished" loop: one rank fails with an error that is not an OOM while
/// the other runs out of memory; neither commits, neither hangs, each is told.
#[test]
fn comp_rank_error_beside_peer_oom_stops_both() {
    let handles: Vec<_> = LocalGroup::with_timeout(2, std::time::Duration::from_secs(10))
        .into_iter()
        .enumerate()
        .map(|(rank, g)| {
            thread::spawn(move || {
                let dev = Device::sim(ByteSize::mib(16));
                let engine = RetryEngine::new().with_consensus(g);
                let mut commits = 0;
                let t0 = std::time::Instant::now();
                let r = engine.run(
                    &dev,
                    64,
                    |plan| {
                        if rank == 0 {
                            return Err(StepErr::Oops("c10".into()));
                        }
                        for c in plan.chunks() {
                            dev.alloc::<u8>(c.len() * MIB)?;
                        }
                        Ok(())
                    },
                    |()| commits += 1,
                );
                (
                    r.map(|_| ()).map_err(|e| e.to_string()),
                    commits,
                    t0.elapsed(),
                )
            })
        })
        .collect();
    let out: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    for (rank, (r, commits, t)) in out.iter().enumerate() {
        assert_eq!(*commits, 0, "rank {rank}");
        assert!(r.is_err(), "rank {rank}: {r:?}");
        // a hang guard, not a speed goal (the peer stops within milliseconds; a loaded 2-core
        // machine can be slow)
        assert!(t.as_secs() < 120, "rank {rank} waited {t:?}");
    }
    assert!(
        out[0].0.as_ref().unwrap_err().contains("c10"),
        "{:?}",
        out[0].0
    );
}

/// Lightning's margin shrinks the size found by that fraction; oomguard's keeps memory free on
/// the jump only. Whatever the margin, the size found ran and is at most the true maximum.
#[test]
fn lit_margin_result_stays_within_truth() {
    let truth = max_rows(ByteSize::mib(512), 40 * MIB, 3 * MIB / 2);
    for m in [0.0, 0.05, 0.3, 0.9] {
        let dev = Device::sim(ByteSize::mib(512));
        let opts = FinderOptions {
            margin: m,
            ..FinderOptions::default()
        };
        let r = find_max_batch(&dev, opts, affine_step(&dev, 40 * MIB, 3 * MIB / 2)).unwrap();
        // the refinement runs with half the margin: about (1 - m/2) of the rows' memory
        assert!(r.max_batch <= truth, "{m}: {r}");
        assert!(
            r.max_batch as f64 >= (1.0 - m / 2.0 - 0.02) * truth as f64,
            "{m}: {r}"
        );
        affine_step(&dev, 40 * MIB, 3 * MIB / 2)(r.max_batch).unwrap();
    }
}
