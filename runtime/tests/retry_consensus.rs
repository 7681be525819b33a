//! Data-parallel consensus with 2 ranks on threads: all ranks run the same plan, commit once,
//! and stop together; a rank that panics (in the step or outside it), leaves, or does not come
//! makes the others stop with an error naming it (issue 15, point 11).

use std::thread;
use std::time::Duration;

use oomguard_runtime::retry::{
    Accumulate, AttemptOutcome, BatchPlan, Consensus, LocalGroup, PolicyExt, RetryEngine,
    RetryError,
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
    on_group_no_hang(LocalGroup::new(world), f)
}

/// [`on_ranks_no_hang`] on the ranks of `group`.
fn on_group_no_hang<T: Send + 'static>(
    group: Vec<LocalGroup>,
    f: impl Fn(usize, LocalGroup) -> T + Send + Sync + Clone + 'static,
) -> Vec<thread::Result<T>> {
    let world = group.len();
    let (tx, rx) = std::sync::mpsc::channel();
    for (rank, g) in group.into_iter().enumerate() {
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
            // a hang guard only (a loaded 2-core machine may be slow)
            .recv_timeout(std::time::Duration::from_secs(300))
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

/// One step of 10 rows on a fresh simulated device, agreed with the other ranks.
fn one_step(engine: &RetryEngine, dev: &Device) -> Result<usize, String> {
    engine
        .run(dev, 10, |plan| activations(dev, plan), |r| r)
        .map(|r| r.value)
        .map_err(|e| e.to_string())
}

#[test]
fn a_rank_that_panics_between_steps_stops_the_others() {
    let out = on_ranks_no_hang(2, |rank, group| {
        let dev = Device::sim(ByteSize::mib(64));
        let engine = RetryEngine::new().with_consensus(group);
        let first = one_step(&engine, &dev);
        if rank == 1 {
            // user code between steps, outside the retry engine
            panic!("rank 1 fails between steps");
        }
        (first, one_step(&engine, &dev))
    });
    let (first, second) = out[0].as_ref().expect("rank 0 returns");
    assert_eq!(first, &Ok(10));
    let e = second.as_ref().expect_err("rank 0's second step fails");
    assert!(e.contains("rank 1 panicked"), "{e}");
    assert!(out[1].is_err(), "rank 1 panicked");
}

#[test]
fn a_thread_that_dies_holding_its_rank_stops_the_others() {
    let out = on_ranks_no_hang(3, |rank, group| {
        if rank == 2 {
            // The thread catches its panic and goes on, but its handle died in it.
            let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
                let _held = group;
                panic!("rank 2 dies holding its rank");
            }));
            return Err(format!("caught: {}", caught.is_err()));
        }
        let mut v = [rank as u64];
        group.all_reduce_max(&mut v).map_err(|e| e.to_string())
    });
    for (rank, r) in out.iter().enumerate().take(2) {
        let e = r.as_ref().unwrap().as_ref().unwrap_err();
        assert!(e.contains("rank 2 panicked"), "rank {rank}: {e}");
    }
    assert_eq!(out[2].as_ref().unwrap(), &Err("caught: true".to_string()));
}

#[test]
fn a_rank_that_leaves_stops_the_others() {
    let out = on_ranks_no_hang(2, |rank, group| {
        if rank == 1 {
            // returns without taking part: its only handle is dropped
            drop(group);
            return Ok(0);
        }
        let dev = Device::sim(ByteSize::mib(64));
        one_step(&RetryEngine::new().with_consensus(group), &dev)
    });
    let e = out[0].as_ref().unwrap().as_ref().unwrap_err();
    assert!(e.contains("rank 1 left the group"), "{e}");
}

#[test]
fn a_rank_that_never_comes_times_out_with_its_name() {
    let group = LocalGroup::with_timeout(2, Duration::from_millis(200));
    let out = on_group_no_hang(group, |rank, group| {
        if rank == 1 {
            // alive but never comes (stuck elsewhere, or its handle leaked)
            std::mem::forget(group);
            return (Ok(0), None);
        }
        let dev = Device::sim(ByteSize::mib(64));
        let engine = RetryEngine::new().with_consensus(group.clone());
        let first = one_step(&engine, &dev);
        // the group stays poisoned: the next collective fails at once
        let mut v = [0];
        let again = group.all_reduce_max(&mut v).map_err(|e| e.to_string());
        (first, Some((again, group.poisoned())))
    });
    let (first, rest) = out[0].as_ref().unwrap();
    let e = first.as_ref().unwrap_err();
    assert!(e.contains("rank 1 did not reach"), "{e}");
    assert!(e.contains("200ms"), "{e}");
    let (again, poisoned) = rest.as_ref().unwrap();
    assert!(again.as_ref().unwrap_err().contains("rank 1 did not reach"));
    assert!(poisoned.is_some());
}

#[test]
fn ranks_that_all_come_are_not_stopped_by_the_timeout() {
    // Rank 1 arrives after rank 0 has waited a while, well within the limit; then both leave
    // normally after the last round.
    let group = LocalGroup::with_timeout(2, Duration::from_secs(120));
    let out = on_group_no_hang(group, |rank, group| {
        let mut sums = Vec::new();
        for round in 0..20u64 {
            if rank == 1 && round % 5 == 0 {
                thread::sleep(Duration::from_millis(20));
            }
            let mut v = [round + rank as u64];
            group.all_reduce_max(&mut v).map_err(|e| e.to_string())?;
            sums.push(v[0]);
        }
        Ok::<_, String>(sums)
    });
    for r in out {
        let sums = r.unwrap().unwrap();
        assert_eq!(sums, (1..=20).collect::<Vec<u64>>());
    }
}

/// A rank whose policy keeps every row (a training step's `KeepsRows`) never follows a peer
/// whose `Shrink` drops rows: every rank gives up and says why (rank 0 trained 25 of its 100
/// rows and returned `Ok`).
#[test]
fn a_rank_that_keeps_rows_does_not_follow_a_peer_that_drops_them() {
    use oomguard_runtime::retry::{advanced::KeepsRows, Shrink, StopReason};
    let out = on_ranks(2, |rank, group| {
        let dev = Device::sim(ByteSize::mib(if rank == 0 { 1024 } else { 64 }));
        let engine = if rank == 0 {
            RetryEngine::new().with_policy(KeepsRows::new(Accumulate::halving()))
        } else {
            RetryEngine::new().with_policy(Shrink::halving())
        }
        .with_consensus(group);
        engine
            .run(&dev, 100, |plan| activations(&dev, plan), |rows| rows)
            .map(|r| r.value)
    });
    for (rank, r) in out.iter().enumerate() {
        let e = r.as_ref().expect_err("no rank trains part of its batch");
        let report = e.report().expect("the step ran");
        assert!(
            matches!(
                report.stopped,
                Some(StopReason::RanksDisagreeOnRows { dropped: 50 })
            ),
            "rank {rank}: {e}"
        );
        assert!(
            e.to_string().contains("no plan serves both"),
            "rank {rank}: {e}"
        );
    }
}

/// Two threads with handles of one rank in one round: an error for every rank, not a sum that
/// silently lost one of them (1 + 10 + 100 came back as 110 on every thread).
#[test]
fn two_threads_on_one_rank_are_refused() {
    let mut group = LocalGroup::new(2).into_iter();
    let (zero, one) = (group.next().unwrap(), group.next().unwrap());
    let zero_again = zero.clone();
    let sum = |g: LocalGroup, v: f32| {
        thread::spawn(move || {
            let mut x = [v];
            g.all_reduce_sum_f32(&mut x).map(|()| x[0])
        })
    };
    let a = sum(zero, 1.0);
    thread::sleep(Duration::from_millis(50));
    let b = sum(zero_again, 10.0);
    thread::sleep(Duration::from_millis(50));
    let c = sum(one, 100.0);
    let results = [a.join().unwrap(), b.join().unwrap(), c.join().unwrap()];
    assert!(
        results.iter().all(|r| r.is_err()),
        "every thread is told: {results:?}"
    );
    let e = results[1].as_ref().unwrap_err().to_string();
    assert!(e.contains("rank 0 took part twice in round"), "{e}");
}

/// Two ranks learn micro-batches of 25 in a step with a 30 MiB spike; rank 1 then restarts from
/// its plan file (its limits kept, its clean-step count lost). Their regrows fall due one step
/// apart: a regrow cancelled because the other rank starts smaller stays due, so the two regrow
/// together (they took turns cancelling each other's, and stayed at 4 × 25 for good).
#[test]
fn ranks_whose_regrows_fall_due_apart_still_regrow() {
    let dir = std::env::temp_dir().join(format!("oomguard-regrow-phase-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let dir2 = dir.clone();
    let out = on_ranks(2, move |rank, group| {
        let dev = Device::sim(ByteSize::mib(64));
        let file = dir2.join(format!("plans{rank}.json"));
        let make = || {
            RetryEngine::new()
                .with_policy(Accumulate::halving())
                .regrow_after(Some(2))
                .with_memory_file(&file)
                .unwrap()
                .with_consensus(group.clone())
        };
        let mut engine = make();
        let mut regrown = Vec::new();
        for s in 0..12 {
            if rank == 1 && s == 2 {
                engine = make(); // a restart: the plan file's limits, no clean steps
            }
            let r = engine
                .run(
                    &dev,
                    100,
                    |plan| {
                        let _spike = if s == 0 {
                            Some(dev.alloc::<u8>(30 * MIB)?)
                        } else {
                            None
                        };
                        let mut rows = 0;
                        for c in plan.chunks() {
                            rows += dev.alloc::<u8>(c.len() * MIB)?.len() / MIB;
                        }
                        Ok::<_, Error>(rows)
                    },
                    |rows| rows,
                )
                .unwrap();
            assert_eq!(r.value, 100);
            if r.report.regrow.is_some_and(|g| g.succeeded) {
                regrown.push(s);
            }
        }
        regrown
    });
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!out[0].is_empty(), "the ranks regrew: {out:?}");
    assert_eq!(out[0], out[1], "together: {out:?}");
}

/// Ranks whose batches differ drop the same share of their own batch, not the same count: a
/// 40-row rank beside a 100-row rank that shrank to 50 runs 20 rows (it ran 1).
#[test]
fn ranks_with_other_batches_drop_the_same_share() {
    use oomguard_runtime::retry::Shrink;
    let out = on_ranks(2, |rank, group| {
        let (mib, batch) = if rank == 0 { (64, 100) } else { (1024, 40) };
        let dev = Device::sim(ByteSize::mib(mib));
        let engine = RetryEngine::new()
            .with_policy(Shrink::halving())
            .with_consensus(group);
        let r = engine
            .run(&dev, batch, |plan| activations(&dev, plan), |rows| rows)
            .unwrap();
        (r.value, r.report.final_plan.batch())
    });
    let (rows0, kept0) = out[0];
    assert_eq!(rows0, kept0);
    assert!(kept0 < 100, "rank 0 shrank: {out:?}");
    let share_dropped = (100 - kept0) as f64 / 100.0;
    let want = 40 - (40.0 * share_dropped).ceil() as usize;
    assert_eq!(out[1], (want, want), "{out:?}");
}

/// Ranks at different call sites (one rank ran a step the others did not) agreed silently and
/// went on with each other's plans; every rank stops now, saying why.
#[test]
fn ranks_at_different_steps_stop_every_rank() {
    let out = on_ranks_no_hang(2, |rank, group| {
        let dev = Device::sim(ByteSize::mib(64));
        let engine = RetryEngine::new().with_consensus(group);
        let step = |plan: &BatchPlan| activations(&dev, plan);
        let r = if rank == 0 {
            engine.run(&dev, 10, step, |r| r)
        } else {
            engine.run(&dev, 10, step, |r| r)
        };
        r.map(|r| r.value).map_err(|e| e.to_string())
    });
    for (rank, r) in out.into_iter().enumerate() {
        let e = r
            .unwrap()
            .expect_err("ranks at different steps must not commit");
        assert!(e.contains("from different steps"), "rank {rank}: {e}");
    }
}

/// A step nested on one rank only: its agreement meets the other rank's outer one. Both stop
/// (no rank commits a step the other did not run), and nothing hangs.
#[test]
fn a_step_nested_on_one_rank_only_stops_every_rank() {
    let out = on_ranks_no_hang(2, |rank, group| {
        // rank 1 needs a retry (16 MiB): its agreement after the failed attempt meets rank 0's
        // inner step's start
        let dev = Device::sim(ByteSize::mib(if rank == 0 { 1024 } else { 16 }));
        let engine = RetryEngine::new()
            .with_policy(Accumulate::halving())
            .with_consensus(group);
        let mut inner_commits = 0;
        let r = engine.run(
            &dev,
            10,
            |plan| {
                if rank == 0 {
                    engine
                        .run(&dev, 4, |p| activations(&dev, p), |_| inner_commits += 1)
                        .map_err(|_| Error::InvalidArgument("inner step failed".into()))?;
                }
                activations(&dev, plan)
            },
            |r| r,
        );
        (r.map(|r| r.value).map_err(|e| e.to_string()), inner_commits)
    });
    let out: Vec<_> = out.into_iter().map(|r| r.unwrap()).collect();
    assert_eq!(out[0].1, 0, "rank 0's inner step committed alone: {out:?}");
    for (rank, (r, _)) in out.iter().enumerate() {
        assert!(
            r.is_err(),
            "rank {rank} committed a step the other did not run: {out:?}"
        );
    }
    assert!(
        out.iter()
            .any(|(r, _)| r.as_ref().unwrap_err().contains("from different steps")),
        "{out:?}"
    );
}

/// A step nested in a retried one gives up for lack of memory on one rank only: the other rank's
/// inner step stopped with `PeerFailed`, which was not an out-of-memory, so its outer step
/// stopped for good while the first rank's outer step retried (every rank stopped). Both outer
/// steps retry with a smaller plan now and commit together.
#[test]
fn a_nested_give_up_on_one_rank_retries_the_outer_step_on_every_rank() {
    let out = on_ranks_no_hang(2, |rank, group| {
        // 2 MiB a row: rank 0 fits 50 rows, not 100; rank 1 fits both
        let dev = Device::sim(ByteSize::mib(if rank == 0 { 128 } else { 1024 }));
        let outer = RetryEngine::new()
            .with_policy(Accumulate::halving())
            .with_consensus(group.clone());
        let inner = RetryEngine::new()
            .with_policy(Accumulate::halving().max_retries(0))
            .with_consensus(group);
        let mut inner_errors = Vec::new();
        let r = outer.run(
            &dev,
            100,
            |plan| {
                let mut rows = 0;
                for c in plan.chunks() {
                    match inner.run(&dev, c.len(), |p| activations(&dev, p), |r| r) {
                        Ok(r) => rows += r.value,
                        Err(e) => {
                            inner_errors
                                .push((e.to_string(), oomguard_runtime::retry::IsOom::is_oom(&e)));
                            return Err(e);
                        }
                    }
                }
                Ok(rows)
            },
            |r| r,
        );
        (
            r.map(|r| (r.value, r.report.final_plan))
                .map_err(|e| e.to_string()),
            inner_errors,
        )
    });
    let out: Vec<_> = out.into_iter().map(|r| r.unwrap()).collect();
    for (rank, (r, inner_errors)) in out.iter().enumerate() {
        let (rows, plan) = r
            .as_ref()
            .unwrap_or_else(|e| panic!("rank {rank}: {e}; {out:?}"));
        assert_eq!(*rows, 100, "rank {rank}: every row once");
        assert_eq!(*plan, BatchPlan::new(100, 2).unwrap(), "rank {rank}");
        assert_eq!(inner_errors.len(), 1, "rank {rank}: {inner_errors:?}");
        assert!(
            inner_errors[0].1,
            "rank {rank}: an out-of-memory: {inner_errors:?}"
        );
    }
    assert!(
        out[1].1[0].0.contains("gave up for lack of memory"),
        "{out:?}"
    );
}

/// A rank on the default training policy (empty the cache once, then accumulate) beside a rank
/// whose inference policy shrinks its batch: the training rank followed and trained 8 of its 16
/// rows with `Ok` (only `KeepsRows` said it keeps rows). Every rank stops now.
#[test]
fn a_rank_on_the_training_policy_does_not_follow_a_peer_that_shrinks() {
    use oomguard_runtime::retry::{inference_policy, StopReason};
    let out = on_ranks_no_hang(2, |rank, group| {
        let dev = Device::sim(ByteSize::mib(if rank == 0 { 4 } else { 1024 }));
        let engine = if rank == 0 {
            RetryEngine::new().with_policy(inference_policy())
        } else {
            RetryEngine::new()
        }
        .with_consensus(group);
        engine
            .run(
                &dev,
                16,
                |plan| {
                    // the inputs, held for the whole step: micro-batches cannot shrink them
                    let _inputs = dev.alloc::<u8>(plan.batch() * MIB / 4)?;
                    for c in plan.chunks() {
                        dev.alloc::<u8>(c.len() * MIB / 4)?;
                    }
                    Ok::<_, Error>(plan.batch())
                },
                |rows| rows,
            )
            .map(|r| r.value)
            .map_err(|e| (e.to_string(), e.report().and_then(|r| r.stopped.clone())))
    });
    for (rank, r) in out.into_iter().enumerate() {
        let (e, stopped) = r.unwrap().expect_err("no rank trains part of its batch");
        assert!(
            matches!(stopped, Some(StopReason::RanksDisagreeOnRows { .. })),
            "rank {rank}: {e}"
        );
    }
}

/// A 7-row rank (one pass) beside a 100-row rank that must split into micro-batches of 25: the
/// agreement took the smallest micro-batch of any plan, 7, so the large rank ran 15
/// micro-batches of 7. A plan of one pass limits no one now: 4 × 25 and 1 × 7.
#[test]
fn a_small_batch_in_one_pass_does_not_split_a_large_one_finer() {
    let out = on_ranks(2, |rank, group| {
        // 2 MiB a row: rank 0 fits 25 rows at once (64 MiB), rank 1 all of its 7
        let (mib, batch) = if rank == 0 { (64, 100) } else { (1024, 7) };
        let dev = Device::sim(ByteSize::mib(mib));
        let engine = RetryEngine::new()
            .with_policy(Accumulate::halving())
            .with_consensus(group);
        let r = engine
            .run(&dev, batch, |plan| activations(&dev, plan), |rows| rows)
            .unwrap();
        (r.value, r.report.final_plan)
    });
    assert_eq!(out[0], (100, BatchPlan::new(100, 4).unwrap()), "{out:?}");
    assert_eq!(out[1], (7, BatchPlan::whole(7).unwrap()), "{out:?}");
}
