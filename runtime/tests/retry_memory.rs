//! Remembered plans: per call site, device and grad mode; regrow after clean steps; persistence
//! across a restart; thrash detection.

use std::cell::Cell;
use std::sync::atomic::{AtomicU32, Ordering};

use oomguard_runtime::backend::sim::SimDevice;
use oomguard_runtime::retry::{
    Accumulate, BatchPlan, EmptyCacheRetry, PolicyExt, Retried, RetryEngine, StepMode,
};
use oomguard_runtime::{AllocatorConfig, ByteSize, Device, Error};

const MIB: usize = 1 << 20;

/// A step whose micro-batches each need `rows × row_mib` MiB of activations.
fn activations(dev: &Device, plan: &BatchPlan, row_mib: usize) -> Result<usize, Error> {
    let mut rows = 0;
    for c in plan.chunks() {
        let acts = dev.alloc::<u8>(c.len() * row_mib * MIB)?;
        rows += acts.len() / (row_mib * MIB);
    }
    Ok(rows)
}

/// One call site shared by the tests that need the same site twice.
fn step_here(engine: &RetryEngine, dev: &Device, batch: usize) -> Retried<usize> {
    engine
        .run(dev, batch, |plan| activations(dev, plan, 2), |rows| rows)
        .expect("the step completes")
}

fn two_retry_engine() -> RetryEngine {
    // 100 rows × 2 MiB in 64 MiB: 100 and 50 rows fail, 25 fit — 2 retries.
    RetryEngine::new().with_policy(Accumulate::halving())
}

/// A remembered micro-batch cap of 25 rows says nothing about a step of 20 rows: its plan is the
/// one it would have without memory (1 × 20), and its report said "from memory" all the same.
#[test]
fn a_remembered_cap_that_does_not_bind_is_not_from_memory() {
    let dev = Device::sim(ByteSize::mib(64));
    let engine = two_retry_engine();
    let first = step_here(&engine, &dev, 100);
    assert_eq!(first.report.final_plan, BatchPlan::new(100, 4).unwrap());
    let small = step_here(&engine, &dev, 20);
    assert_eq!(small.report.initial_plan, BatchPlan::new(20, 1).unwrap());
    assert_eq!(small.report.retries(), 0);
    assert!(!small.report.from_memory, "{}", small.report);
    // where the cap binds, it is
    let bound = step_here(&engine, &dev, 30);
    assert_eq!(bound.report.initial_plan, BatchPlan::new(30, 2).unwrap());
    assert!(bound.report.from_memory, "{}", bound.report);
}

#[test]
fn second_call_makes_no_retry() {
    let dev = Device::sim(ByteSize::mib(64));
    let engine = two_retry_engine();
    let first = step_here(&engine, &dev, 100);
    assert_eq!(first.report.retries(), 2);
    assert_eq!(first.value, 100, "the whole batch is processed");
    assert_eq!(first.report.final_plan, BatchPlan::new(100, 4).unwrap());
    assert!(!first.report.from_memory);
    let limits = engine.remembered(&first.report.site, &dev);
    assert_eq!((limits.micro_batch, limits.batch), (Some(25), None));
    let second = step_here(&engine, &dev, 100);
    assert_eq!(second.report.retries(), 0);
    assert!(second.report.from_memory);
    assert_eq!(second.report.initial_plan, BatchPlan::new(100, 4).unwrap());
    // a smaller batch at the same site reuses the micro-batch cap
    let small = step_here(&engine, &dev, 30);
    assert_eq!(small.report.final_plan, BatchPlan::new(30, 2).unwrap());
    assert_eq!(small.report.retries(), 0);
    // another call site learns on its own
    let other = engine
        .run(&dev, 100, |plan| activations(&dev, plan, 2), |rows| rows)
        .unwrap();
    assert_eq!(other.report.retries(), 2);
    assert_eq!(engine.memory().len(), 2);
}

thread_local! {
    static MODE: Cell<StepMode> = const { Cell::new(StepMode::Train) };
}

#[test]
fn train_and_eval_are_remembered_separately() {
    let dev = Device::sim(ByteSize::mib(64));
    let engine = two_retry_engine().with_mode_hook(|| MODE.with(|m| m.get()));
    let eval_step = |engine: &RetryEngine| {
        // evaluation needs half the memory per row at the same call site
        engine
            .run(
                &dev,
                100,
                |plan| {
                    let row = if MODE.with(|m| m.get()) == StepMode::Eval {
                        1
                    } else {
                        2
                    };
                    activations(&dev, plan, row)
                },
                |rows| rows,
            )
            .unwrap()
    };
    assert_eq!(eval_step(&engine).report.retries(), 2);
    MODE.with(|m| m.set(StepMode::Eval));
    let eval = eval_step(&engine);
    assert_eq!(eval.report.mode, StepMode::Eval);
    assert!(!eval.report.from_memory, "train's plan is not eval's");
    assert_eq!(eval.report.retries(), 1);
    assert_eq!(eval.report.final_plan, BatchPlan::new(100, 2).unwrap());
    MODE.with(|m| m.set(StepMode::Train));
    let train = eval_step(&engine);
    assert_eq!(train.report.retries(), 0);
    assert_eq!(train.report.final_plan, BatchPlan::new(100, 4).unwrap());
    MODE.with(|m| m.set(StepMode::Eval));
    assert_eq!(
        eval_step(&engine).report.final_plan,
        BatchPlan::new(100, 2).unwrap()
    );
    MODE.with(|m| m.set(StepMode::Train));
    assert_eq!(engine.memory().len(), 2);
}

#[test]
fn regrow_after_clean_steps_and_fall_back_on_oom() {
    let sim = SimDevice::new(ByteSize::mib(64));
    let dev = Device::new(sim.clone(), AllocatorConfig::default());
    let engine = two_retry_engine().regrow_after(Some(3));
    let commits = AtomicU32::new(0);
    let step = |engine: &RetryEngine| {
        engine
            .run(
                &dev,
                100,
                |plan| activations(&dev, plan, 2),
                |rows| {
                    commits.fetch_add(1, Ordering::SeqCst);
                    rows
                },
            )
            .unwrap()
    };
    assert_eq!(step(&engine).report.retries(), 2);
    for _ in 0..3 {
        let r = step(&engine);
        assert_eq!((r.report.retries(), r.report.regrow), (0, None));
    }
    // 4th clean step: one size up (50 rows = 100 MiB) fails, falls back to 25 rows in the step
    let r = step(&engine);
    let regrow = r.report.regrow.expect("a regrow was tried");
    assert_eq!(regrow.tried, BatchPlan::new(100, 2).unwrap());
    assert!(!regrow.succeeded);
    assert!(
        r.report.to_string().contains(
            "regrow: tried batch 100 in 2 micro-batches of ≤50 after clean steps; out of memory"
        ),
        "{}",
        r.report
    );
    assert_eq!(r.report.retries(), 1);
    assert_eq!(r.report.final_plan, BatchPlan::new(100, 4).unwrap());
    assert_eq!(r.value, 100);
    // more memory: the next regrow (after twice the wait) succeeds and is remembered
    sim.set_capacity(ByteSize::mib(128));
    for _ in 0..6 {
        assert_eq!(step(&engine).report.regrow, None);
    }
    let r = step(&engine);
    assert_eq!(
        r.report.regrow.map(|g| (g.tried.num_chunks(), g.succeeded)),
        Some((2, true))
    );
    assert!(
        r.report.to_string().contains("; it fit, remembered"),
        "{}",
        r.report
    );
    assert_eq!(r.report.retries(), 0);
    assert_eq!(
        step(&engine).report.final_plan,
        BatchPlan::new(100, 2).unwrap()
    );
    assert_eq!(commits.load(Ordering::SeqCst), 13, "one commit per step");
}

fn temp_path(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("oomguard-{name}-{}.json", std::process::id()))
}

/// A plan file at a fresh `temp_path(name)` holding the plan a 64 MiB card learns for a step of
/// 100 rows (2 retries, micro-batches of 25): the path and the file's text.
fn learned_plan_file(name: &str) -> (std::path::PathBuf, String) {
    let path = temp_path(name);
    let _ = std::fs::remove_file(&path);
    {
        let dev = Device::sim(ByteSize::mib(64));
        let engine = two_retry_engine().with_memory_file(&path).unwrap();
        assert_eq!(step_here(&engine, &dev, 100).report.retries(), 2);
    }
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains("\"micro_batch\": 25"), "{text}");
    (path, text)
}

#[test]
fn plans_persist_across_a_restart() {
    let (path, text) = learned_plan_file("persist");
    assert!(text.contains("\"mode\": \"train\""), "{text}");
    // "restart": a new engine and a new device of the same kind
    let dev = Device::sim(ByteSize::mib(64));
    let engine = two_retry_engine().with_memory_file(&path).unwrap();
    let r = step_here(&engine, &dev, 100);
    assert!(r.report.from_memory);
    assert_eq!(r.report.retries(), 0);
    // a device with another capacity does not inherit the plan
    let bigger = Device::sim(ByteSize::mib(80));
    let r = step_here(&engine, &bigger, 100);
    assert!(!r.report.from_memory);
    assert_eq!(r.report.retries(), 2);
    std::fs::remove_file(&path).unwrap();
}

/// A plan file whose entry caps the micro-batch at 0 rows (the engine never writes one) ran
/// every later step at that call site as micro-batches of 1 row without a word (found by a
/// hostile pass of the API): now the file is refused, naming the call site.
#[test]
fn a_plan_file_with_a_cap_of_zero_rows_is_refused() {
    let (path, text) = learned_plan_file("zero-cap");
    std::fs::write(
        &path,
        text.replace("\"micro_batch\": 25", "\"micro_batch\": 0"),
    )
    .unwrap();
    let e = two_retry_engine().with_memory_file(&path).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("caps a batch or micro-batch at 0 rows"),
        "{msg}"
    );
    assert!(
        msg.contains("retry_memory.rs"),
        "names the call site: {msg}"
    );
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn thrashing_moves_down_before_a_hard_oom() {
    // Oversize blocks (>= 64 MiB) are never split and serve only requests within 20 MiB of their
    // size: alternating 100 and 200 MiB steps in 256 MiB force the allocator to free its cache
    // and retry in every step, without ever failing.
    let cfg = AllocatorConfig::parse("expandable_segments:False,max_split_size_mb:64").unwrap();
    let dev = Device::new(SimDevice::new(ByteSize::mib(256)), cfg);
    let engine =
        RetryEngine::new().with_policy(EmptyCacheRetry::once().then(Accumulate::halving()));
    let calls = Cell::new(0usize);
    let step = || {
        calls.set(calls.get() + 1);
        let row = if calls.get() % 2 == 0 { 2 } else { 1 };
        engine
            .run(&dev, 100, |plan| activations(&dev, plan, row), |rows| rows)
            .unwrap()
    };
    let mut moved = None;
    for i in 0..6 {
        let before = dev.stats().num_alloc_retries;
        let r = step();
        assert_eq!(r.report.retries(), 0, "never a hard OOM");
        if let Some(p) = r.report.thrash_moved_to {
            moved = Some((i, p));
            break;
        }
        assert!(
            dev.stats().num_alloc_retries > before || i == 0,
            "the allocator retried in step {i}"
        );
    }
    let (at, plan) = moved.expect("thrash detected");
    assert_eq!(
        at, 3,
        "after 3 consecutive thrashing steps (the first step only grows)"
    );
    assert_eq!(plan, BatchPlan::new(100, 2).unwrap());
    // the first two steps at the new plan may still meet the old 200 MiB segment in the cache
    step();
    step();
    let before = dev.stats().num_alloc_retries;
    for _ in 0..4 {
        let r = step();
        assert_eq!(r.report.initial_plan, plan);
        assert_eq!(r.report.thrash_moved_to, None);
    }
    assert_eq!(dev.stats().num_alloc_retries, before, "no more thrashing");
}

#[test]
fn invalid_batch_is_an_error() {
    let dev = Device::sim(ByteSize::mib(64));
    let e = RetryEngine::new()
        .run(&dev, 0, |_| Ok::<_, Error>(()), |_| ())
        .unwrap_err();
    assert!(e.to_string().contains("0 rows"), "{e}");
}

#[test]
fn non_oom_errors_are_not_retried() {
    let dev = Device::sim(ByteSize::mib(64));
    let mut runs = 0;
    let mut commits = 0;
    let e = RetryEngine::new()
        .run(
            &dev,
            10,
            |_| {
                runs += 1;
                Err::<(), _>(Error::InvalidArgument("bad row".into()))
            },
            |_| commits += 1,
        )
        .unwrap_err();
    assert_eq!((runs, commits), (1, 0));
    assert!(e.to_string().contains("bad row"), "{e}");
    assert!(e.report().unwrap().attempts.is_empty());
}

#[test]
fn giving_up_holds_every_attempt() {
    // 8 MiB free on a 64 MiB card: the requests fit the card (a request larger than the whole
    // card is not retried with the same plan, issue 32.12), but not what is free
    let dev = Device::sim(ByteSize::mib(64));
    let held = dev.alloc::<u8>(56 << 20).unwrap();
    let e = RetryEngine::new()
        .with_policy(
            EmptyCacheRetry::once()
                .then(Accumulate::halving())
                .max_retries(3),
        )
        .run(&dev, 64, |plan| activations(&dev, plan, 1), |_| ())
        .unwrap_err();
    match &e {
        oomguard_runtime::RetryError::GaveUp { failures, report } => {
            assert_eq!(failures.len(), 4);
            let micro: Vec<usize> = failures.iter().map(|f| f.plan.micro_batch()).collect();
            assert_eq!(micro, [64, 64, 32, 16]);
            assert!(failures
                .iter()
                .all(|f| f.error.as_ref().is_some_and(|e| e.is_oom())));
            assert_eq!(report.attempts.len(), 4);
            assert_eq!(report.attempts[3].next, None);
        }
        other => panic!("expected GaveUp, got {other}"),
    }
    assert!(e.to_string().contains("attempt 4"), "{e}");
    let last = e.into_error().expect("the last OOM");
    assert!(last.is_oom());
    assert!(
        last.to_string().contains("Tried to allocate 16.00 MiB"),
        "{last}"
    );
    assert_eq!(dev.stats().allocated_bytes.all.current, 56 << 20);
    assert_eq!(
        dev.stats().reserved_bytes.all.current,
        56 << 20,
        "cache emptied: only the held buffer's memory stays"
    );
    drop(held);
}

#[test]
fn a_panicking_attempt_commits_nothing_and_leaves_the_engine_usable() {
    let dev = Device::sim(ByteSize::mib(64));
    let engine = two_retry_engine();
    let commits = AtomicU32::new(0);
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        engine.run(
            &dev,
            100,
            |plan| -> Result<(), Error> {
                let _acts = dev.alloc::<u8>(plan.micro_batch() << 10)?;
                panic!("bug in the step")
            },
            |_| commits.fetch_add(1, Ordering::SeqCst),
        )
    }));
    assert!(caught.is_err());
    assert_eq!(commits.load(Ordering::SeqCst), 0);
    assert_eq!(
        dev.stats().allocated_bytes.all.current,
        0,
        "unwinding freed the buffer"
    );
    assert_eq!(step_here(&engine, &dev, 100).report.retries(), 2);
}

#[test]
fn the_default_mode_follows_the_grad_mode() {
    let dev = Device::sim(ByteSize::mib(64));
    let engine = two_retry_engine();
    let step = |engine: &RetryEngine| step_here(engine, &dev, 100);
    assert_eq!(step(&engine).report.retries(), 2);
    assert_eq!(step(&engine).report.retries(), 0);
    {
        let _eval = oomguard_runtime::no_grad();
        let r = step(&engine);
        assert_eq!(r.report.mode, StepMode::Eval);
        assert_eq!(r.report.retries(), 2, "eval learns on its own");
    }
    {
        let _inference = oomguard_runtime::inference_mode();
        assert_eq!(step(&engine).report.retries(), 0);
    }
    assert_eq!(step(&engine).report.mode, StepMode::Train);
}

/// A seeded engine whose regrows reach the whole batch keeps the whole batch: a regrow that
/// leaves no cap is what the memory says, not "nothing learned" (the seed applied again, and
/// the loop cycled 4 × 25 → 2 × 50 → 1 × 100 → 4 × 25 every few steps).
#[test]
fn a_regrow_that_outgrows_the_seed_is_kept() {
    let dev = Device::sim(ByteSize::mib(1024)); // the whole batch (100 rows × 1 MiB) fits
    let engine = RetryEngine::new()
        .start_from(BatchPlan::whole(32).unwrap())
        .regrow_after(Some(2));
    let mut plans = Vec::new();
    for _ in 0..14 {
        let out = engine
            .run(&dev, 100, |plan| activations(&dev, plan, 1), |rows| rows)
            .expect("the step completes");
        assert_eq!(out.value, 100, "every row ran");
        plans.push(out.report.final_plan.micro_batch());
    }
    let whole = plans
        .iter()
        .position(|&m| m == 100)
        .expect("the regrows reach the whole batch");
    assert!(
        plans[whole..].iter().all(|&m| m == 100),
        "the seed came back after the whole batch ran: {plans:?}"
    );
    assert_eq!(
        plans[0], 25,
        "the seed's 32-row cap gives 4 × 25: {plans:?}"
    );
}

/// `regrow_after(Some(0))` waits for one clean step, as `Some(1)` does: a wait of 0 doubled
/// after a failed regrow stayed 0, and every step ran out of memory on purpose.
#[test]
fn regrow_after_zero_is_one_clean_step() {
    let dev = Device::sim(ByteSize::mib(64));
    let engine = two_retry_engine().regrow_after(Some(0));
    let mut failed_regrows = 0;
    for _ in 0..12 {
        let out = step_here(&engine, &dev, 100);
        assert_eq!(out.value, 100);
        failed_regrows += usize::from(out.report.regrow.is_some_and(|g| !g.succeeded));
    }
    // waits of 1, 2, 4 clean steps after the first learning step: at most 4 tries in 12 steps
    assert!(
        (1..=4).contains(&failed_regrows),
        "{failed_regrows} failed regrows in 12 steps"
    );
}
