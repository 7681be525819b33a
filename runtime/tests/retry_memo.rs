//! `RetryEngine::begin_any_memo` (what `#[oom_retry]` uses): a site with nothing remembered runs
//! its first attempt without setting up the loop, and behaves exactly as `begin_any` otherwise
//! (issue 15, point 14).

use std::ops::ControlFlow;

use oomguard_runtime::retry::{
    last_report, Accumulate, DeviceKey, Limits, MemoryKey, PlanMemory, RetryEngine, SiteMemo,
    StepMode,
};
use oomguard_runtime::{BatchPlan, ByteSize, Device, Error};

const SITE: &str = "memo.rs:1 step";

/// 2 MiB of activations per row, one allocation per micro-batch.
fn step(dev: &Device, plan: &BatchPlan) -> Result<usize, Error> {
    let mut rows = 0;
    for c in plan.chunks() {
        rows += dev.alloc::<u8>(c.len() << 21)?.len() >> 21;
    }
    Ok(rows)
}

/// One call through the memo: rows processed and the micro-batch of every attempt.
fn call(
    engine: &RetryEngine,
    memo: &SiteMemo,
    dev: &Device,
    start: BatchPlan,
) -> (usize, Vec<usize>) {
    let mut lp = engine.begin_any_memo::<Error>(SITE, start, memo).unwrap();
    let mut micro = vec![];
    loop {
        let plan = lp.plan();
        micro.push(plan.micro_batch());
        match lp.next_value(step(dev, &plan)) {
            ControlFlow::Break(done) => return (done.unwrap(), micro),
            ControlFlow::Continue(()) => {}
        }
    }
}

fn key(dev: &Device) -> MemoryKey {
    MemoryKey {
        site: SITE.into(),
        device: DeviceKey::of(dev),
        mode: StepMode::current(),
    }
}

#[test]
fn a_clean_step_touches_no_memory_and_reports_as_before() {
    let dev = Device::sim(ByteSize::mib(64));
    drop(dev.alloc::<u8>(1).unwrap()); // this thread's device
    let engine = RetryEngine::new().with_policy(Accumulate::halving());
    let memo = SiteMemo::new();
    let start = BatchPlan::new(8, 2).unwrap();
    let generation = engine.memory().generation();
    for _ in 0..3 {
        assert_eq!(call(&engine, &memo, &dev, start), (8, vec![4]));
        let r = last_report().expect("a report");
        assert_eq!(r.site, SITE);
        assert_eq!(
            (r.requested_batch, r.initial_plan, r.final_plan),
            (8, start, start)
        );
        assert_eq!(
            (r.retries(), r.from_memory, r.mode),
            (0, false, StepMode::current())
        );
    }
    // nothing was looked up for writing, nothing stored
    assert!(engine.memory().is_empty());
    assert_eq!(engine.memory().generation(), generation);
    // the report of a loop that ran without being set up, asked for
    let mut lp = engine.begin_any_memo::<Error>(SITE, start, &memo).unwrap();
    assert_eq!(lp.report().final_plan, start);
    let plan = lp.plan();
    let (rows, report) = match lp.next(step(&dev, &plan)) {
        ControlFlow::Break(done) => done.unwrap(),
        ControlFlow::Continue(()) => panic!("fits"),
    };
    assert_eq!((rows, report.retries(), report.final_plan), (8, 0, start));
    assert!(
        lp.next(Ok::<usize, Error>(1)).is_break(),
        "a finished loop refuses more"
    );
}

#[test]
fn a_first_attempt_that_fails_goes_on_as_the_loop_and_is_remembered() {
    let dev = Device::sim(ByteSize::mib(16));
    drop(dev.alloc::<u8>(1).unwrap());
    let engine = RetryEngine::new().with_policy(Accumulate::halving());
    let memo = SiteMemo::new();
    let start = BatchPlan::new(100, 5).unwrap();
    // 2 MiB rows in 16 MiB: micro-batches of 20 and 10 rows fail, 5 fit
    assert_eq!(call(&engine, &memo, &dev, start), (100, vec![20, 10, 5]));
    let r = last_report().unwrap();
    assert_eq!((r.retries(), r.final_plan.micro_batch()), (2, 5));
    assert_eq!(engine.memory().limits(&key(&dev)).micro_batch, Some(5));
    // the next call starts from what was learned
    assert_eq!(call(&engine, &memo, &dev, start), (100, vec![5]));
    assert!(last_report().unwrap().from_memory);
    // forgotten: back to the caller's plan
    engine.memory().clear().unwrap();
    assert_eq!(call(&engine, &memo, &dev, start), (100, vec![20, 10, 5]));
}

#[test]
fn limits_set_from_outside_apply_at_the_next_call() {
    let dev = Device::sim(ByteSize::mib(64));
    drop(dev.alloc::<u8>(1).unwrap());
    let engine = RetryEngine::new();
    let memo = SiteMemo::new();
    let start = BatchPlan::new(8, 1).unwrap();
    assert_eq!(call(&engine, &memo, &dev, start), (8, vec![8]));
    let limits = Limits {
        micro_batch: Some(2),
        batch: None,
    };
    engine.memory().set_limits(&key(&dev), limits).unwrap();
    assert_eq!(call(&engine, &memo, &dev, start), (8, vec![2]));
}

#[test]
fn a_plan_remembered_for_another_device_is_not_used_and_its_own_is() {
    let small = Device::sim(ByteSize::mib(16));
    let large = Device::sim(ByteSize::mib(256));
    let engine = RetryEngine::new();
    let memo = SiteMemo::new();
    let start = BatchPlan::new(8, 1).unwrap();
    let limits = Limits {
        micro_batch: Some(2),
        batch: None,
    };
    engine.memory().set_limits(&key(&small), limits).unwrap();
    drop(large.alloc::<u8>(1).unwrap());
    assert_eq!(call(&engine, &memo, &large, start), (8, vec![8]));
    assert_eq!(call(&engine, &memo, &large, start), (8, vec![8]));
    drop(small.alloc::<u8>(1).unwrap());
    assert_eq!(call(&engine, &memo, &small, start), (8, vec![2]));
    drop(large.alloc::<u8>(1).unwrap());
    assert_eq!(call(&engine, &memo, &large, start), (8, vec![8]));
}

/// A memory replaced wholesale is seen at the next call, also one whose limits were set before
/// the memo last looked (a check of "no memory changed since" without the memory's lock would
/// miss it: the assignment changes no generation).
#[test]
fn a_memory_replaced_wholesale_applies_at_the_next_call() {
    let dev = Device::sim(ByteSize::mib(64));
    drop(dev.alloc::<u8>(1).unwrap());
    let engine = RetryEngine::new();
    let memo = SiteMemo::new();
    let start = BatchPlan::new(8, 1).unwrap();
    let limits = Limits {
        micro_batch: Some(4),
        batch: None,
    };
    // built (and its limits set) before the memo is confirmed below
    let mut prepared = PlanMemory::default();
    prepared.set_limits(&key(&dev), limits).unwrap();
    assert_eq!(call(&engine, &memo, &dev, start), (8, vec![8]));
    assert_eq!(call(&engine, &memo, &dev, start), (8, vec![8]));
    *engine.memory() = prepared;
    assert_eq!(call(&engine, &memo, &dev, start), (8, vec![4]));
    *engine.memory() = PlanMemory::default();
    assert_eq!(call(&engine, &memo, &dev, start), (8, vec![8]));
}
