//! Data-parallel consensus with 2 ranks on threads: all ranks run the same plan, commit once,
//! and stop together.

use std::thread;

use oomguard_runtime::retry::{
    Accumulate, AttemptOutcome, BatchPlan, LocalGroup, PolicyExt, RetryEngine, RetryError,
};
use oomguard_runtime::{ByteSize, Device, Error};

const MIB: usize = 1 << 20;

fn activations(dev: &Device, plan: &BatchPlan) -> Result<usize, Error> {
    let mut rows = 0;
    for c in plan.chunks() {
        let acts = dev.alloc::<u8>(c.len() * 2 * MIB)?;
        rows += acts.len() / (2 * MIB);
    }
    Ok(rows)
}

/// Runs `f(rank, group)` on one thread per rank and collects the results in rank order.
fn on_ranks<T: Send + 'static>(
    world: usize,
    f: impl Fn(usize, LocalGroup) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    let handles: Vec<_> = LocalGroup::new(world)
        .into_iter()
        .enumerate()
        .map(|(rank, g)| {
            let f = f.clone();
            thread::spawn(move || f(rank, g))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn ranks_agree_on_the_smaller_plan() {
    let out = on_ranks(2, |rank, group| {
        // rank 0 has 64 MiB (needs micro-batches of 25 rows), rank 1 plenty
        let dev = Device::sim(ByteSize::mib(if rank == 0 { 64 } else { 1024 }));
        let engine = RetryEngine::new()
            .with_policy(Accumulate::halving())
            .with_consensus(group.clone());
        let mut commits = 0;
        // one call site for both steps
        let mut step = |engine: &RetryEngine| {
            engine
                .run(
                    &dev,
                    100,
                    |plan| activations(&dev, plan),
                    |rows| {
                        commits += 1;
                        rows
                    },
                )
                .unwrap()
        };
        let first = step(&engine);
        // a restarted rank 1 (memory lost) still starts from the agreed plan
        let engine2 = if rank == 1 {
            RetryEngine::new()
                .with_policy(Accumulate::halving())
                .with_consensus(group)
        } else {
            engine
        };
        let second = step(&engine2);
        (first, second, commits)
    });
    let plan = BatchPlan::new(100, 4).unwrap();
    for (rank, (first, second, commits)) in out.iter().enumerate() {
        assert_eq!(*commits, 2, "rank {rank}: one commit per step");
        assert_eq!(first.value, 100);
        assert_eq!(first.report.final_plan, plan, "rank {rank}");
        let outcomes: Vec<_> = first.report.attempts.iter().map(|a| a.outcome).collect();
        let expected = if rank == 0 {
            AttemptOutcome::Oom
        } else {
            AttemptOutcome::PeerOom
        };
        assert_eq!(outcomes, [expected, expected], "rank {rank}");
        assert_eq!(second.report.retries(), 0, "rank {rank}");
        assert_eq!(second.report.initial_plan, plan, "rank {rank}");
    }
}

#[test]
fn a_failing_rank_stops_all_ranks() {
    let out = on_ranks(2, |rank, group| {
        let dev = Device::sim(ByteSize::gib(1));
        let engine = RetryEngine::new().with_consensus(group);
        let mut commits = 0;
        let r = engine.run(
            &dev,
            16,
            |_plan| {
                if rank == 0 {
                    Err(Error::InvalidArgument("corrupt shard".into()))
                } else {
                    Ok(())
                }
            },
            |_| commits += 1,
        );
        (r.map(|_| ()), commits)
    });
    assert!(matches!(out[0].0, Err(RetryError::Step { .. })));
    assert!(matches!(out[1].0, Err(RetryError::PeerFailed { .. })));
    assert_eq!((out[0].1, out[1].1), (0, 0));
}

#[test]
fn giving_up_on_one_rank_stops_all_ranks() {
    let out = on_ranks(2, |rank, group| {
        // rank 0 cannot fit even 25 rows; it gives up after one retry
        let dev = Device::sim(ByteSize::mib(if rank == 0 { 16 } else { 1024 }));
        let engine = RetryEngine::new()
            .with_policy(Accumulate::halving().max_retries(1))
            .with_consensus(group);
        let mut commits = 0;
        let r = engine.run(&dev, 100, |plan| activations(&dev, plan), |_| commits += 1);
        let msg = r.as_ref().err().map(|e| e.to_string());
        (
            r.map(|_| ()),
            commits,
            msg,
            dev.stats().allocated_bytes.all.current,
        )
    });
    match &out[0].0 {
        Err(RetryError::GaveUp { failures, .. }) => assert_eq!(failures.len(), 2),
        other => panic!("rank 0: {other:?}"),
    }
    assert!(matches!(out[1].0, Err(RetryError::PeerFailed { .. })));
    for (rank, o) in out.iter().enumerate() {
        assert_eq!(o.1, 0, "rank {rank} committed nothing");
        assert_eq!(o.3, 0, "rank {rank} holds no memory");
        assert!(o.2.is_some());
    }
}

/// Runs `f` on one thread per rank; fails the test if they do not all finish within 20 s (a
/// hang). Each rank's result is `Err` when its thread panicked.
fn on_ranks_no_hang<T: Send + 'static>(
    world: usize,
    f: impl Fn(usize, LocalGroup) -> T + Send + Sync + Clone + 'static,
) -> Vec<thread::Result<T>> {
    let (tx, rx) = std::sync::mpsc::channel();
    for (rank, g) in LocalGroup::new(world).into_iter().enumerate() {
        let f = f.clone();
        let tx = tx.clone();
        thread::spawn(move || {
            let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(rank, g)));
            let _ = tx.send((rank, out));
        });
    }
    let mut out: Vec<Option<thread::Result<T>>> = (0..world).map(|_| None).collect();
    for _ in 0..world {
        let (rank, r) = rx
            .recv_timeout(std::time::Duration::from_secs(20))
            .expect("a rank hangs");
        out[rank] = Some(r);
    }
    out.into_iter().map(|r| r.unwrap()).collect()
}

#[test]
fn a_rank_with_an_empty_batch_stops_every_rank() {
    let out = on_ranks_no_hang(2, |rank, group| {
        let dev = Device::sim(ByteSize::mib(64));
        let engine = RetryEngine::new().with_consensus(group);
        let rows = if rank == 1 { 0 } else { 10 };
        engine
            .run(&dev, rows, |plan| activations(&dev, plan), |r| r)
            .map(|r| r.value)
            .map_err(|e| e.to_string())
    });
    let errors: Vec<String> = out.into_iter().map(|r| r.unwrap().unwrap_err()).collect();
    assert!(
        errors[0].contains("another rank cannot start"),
        "{errors:?}"
    );
    assert!(errors[1].contains("0 rows"), "{errors:?}");
}

#[test]
fn a_rank_that_panics_mid_attempt_stops_the_others() {
    let out = on_ranks_no_hang(2, |rank, group| {
        let dev = Device::sim(ByteSize::mib(64));
        let engine = RetryEngine::new().with_consensus(group);
        engine
            .run(
                &dev,
                10,
                |plan| {
                    if rank == 1 {
                        panic!("rank 1 fails mid-attempt");
                    }
                    activations(&dev, plan)
                },
                |r| r,
            )
            .map(|r| r.value)
            .map_err(|e| matches!(e, RetryError::PeerFailed { .. }))
    });
    assert_eq!(
        out[0].as_ref().unwrap(),
        &Err(true),
        "rank 0 stops with PeerFailed"
    );
    assert!(out[1].is_err(), "rank 1 panicked");
}
