//! The hand-driven retry loop (`RetryEngine::begin` → `RetryLoop`), as macros use it.

use std::ops::ControlFlow;

use oomguard_runtime::retry::{Accumulate, RetryEngine, RetryError};
use oomguard_runtime::{BatchPlan, ByteSize, Device, Error};

fn step(dev: &Device, plan: &BatchPlan) -> Result<usize, Error> {
    let mut rows = 0;
    for c in plan.chunks() {
        rows += dev.alloc::<u8>(c.len() << 21)?.len() >> 21;
    }
    Ok(rows)
}

#[test]
fn hand_driven_loop() {
    let dev = Device::sim(ByteSize::mib(64));
    let engine = RetryEngine::new().with_policy(Accumulate::halving());
    let mut lp = engine.begin::<Error>(&dev, 100).unwrap();
    let mut attempts = 0;
    let (rows, report) = loop {
        attempts += 1;
        let plan = lp.plan();
        assert_eq!(lp.batch(), 100);
        match lp.next(step(&dev, &plan)) {
            ControlFlow::Break(done) => break done.unwrap(),
            ControlFlow::Continue(()) => assert_eq!(lp.report().retries(), attempts),
        }
    };
    assert_eq!((rows, attempts, report.retries()), (100, 3, 2));
    // a finished loop refuses more results
    match lp.next(Ok::<usize, Error>(1)) {
        ControlFlow::Break(Err(RetryError::InvalidArgument(m))) => assert!(m.contains("after")),
        other => panic!("{other:?}"),
    }
    // an explicit site name is a memory key of its own
    let mut named = engine
        .begin_at::<Error>("train.rs:1 step", &dev, 100)
        .unwrap();
    assert_eq!(named.plan().num_chunks(), 1);
    let plan = named.plan();
    assert!(matches!(
        named.next(step(&dev, &plan)),
        ControlFlow::Continue(())
    ));
}

#[test]
fn any_device_loop_keeps_the_callers_chunking() {
    let dev = Device::sim(ByteSize::mib(16));
    let engine = RetryEngine::new().with_policy(Accumulate::halving());
    let start = BatchPlan::new(100, 5).unwrap();
    let mut lp = engine.begin_any::<Error>("loop.rs:1 any", start).unwrap();
    assert_eq!(lp.plan(), start, "micro-batches of 20 rows, as asked");
    let mut plans = vec![];
    let rows = loop {
        let plan = lp.plan();
        plans.push(plan.micro_batch());
        match lp.next(step(&dev, &plan)) {
            ControlFlow::Break(done) => break done.unwrap().0,
            ControlFlow::Continue(()) => {}
        }
    };
    // 2 MiB rows in 16 MiB: 20 and 10 rows fail, 5 fit
    assert_eq!((rows, plans), (100, vec![20, 10, 5]));
    let again = engine.begin_any::<Error>("loop.rs:1 any", start).unwrap();
    assert_eq!(
        again.plan().micro_batch(),
        5,
        "remembered under the any-device key"
    );
    assert!(engine
        .begin_any::<Error>("x", BatchPlan::whole(3).unwrap())
        .is_ok());
}

/// A step that holds no source is measured on the device its thread allocates on: another
/// thread allocating on another device between its attempts (a data loader, a second model, a
/// parallel test) made the step look as if it kept memory across attempts, and it stopped
/// with `HeldGrew` ("a leak") before trying the plan that fits; the report's figures were the
/// other device's too.
#[test]
fn another_threads_device_is_not_this_steps_memory() {
    let dev = Device::sim(ByteSize::mib(16));
    let other = Device::sim(ByteSize::gib(1));
    let kept = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let engine = RetryEngine::new().with_policy(Accumulate::halving());
    let start = BatchPlan::whole(100).unwrap();
    let mut lp = engine
        .begin_any::<Error>("loop.rs:2 other thread", start)
        .unwrap();
    let (rows, report) = loop {
        // another thread takes 16 MiB more of its own device during every attempt
        let (o, k) = (other.clone(), kept.clone());
        std::thread::spawn(move || k.lock().unwrap().push(o.alloc::<u8>(16 << 20).unwrap()))
            .join()
            .unwrap();
        let plan = lp.plan();
        match lp.next(step(&dev, &plan)) {
            ControlFlow::Break(Ok((rows, report))) => break (Ok(rows), report),
            ControlFlow::Break(Err(e)) => {
                let report = e.report().cloned().expect("the step ran");
                break (Err(e.to_string()), report);
            }
            ControlFlow::Continue(()) => {}
        }
    };
    assert_eq!(rows, Ok(100), "{report}");
    assert!(report.stopped.is_none(), "{report}");
    // what the report says was in use is this device's (at most its 16 MiB), not the other's
    for a in &report.attempts {
        assert!(a.allocated_bytes <= 16 << 20, "{report}");
    }
}
