//! Issue 32, points 11 and 12: retries that cannot help are not run (or the report says why):
//! a step that keeps memory across attempts, and a request larger than the whole card.

use oomguard_runtime::retry::{BatchPlan, IsOom, Pressure, RetryEngine, RetryError, StopReason};
use oomguard_runtime::{ByteSize, Device, Error};

const MIB: usize = 1 << 20;

/// A step of 100 rows on a 64 MiB card that keeps every chunk's 1 MiB per row alive across
/// attempts (a leak): each attempt starts with more memory held than the last.
fn run_a_leaking_step(engine: RetryEngine) -> RetryError<Error> {
    let dev = Device::sim(ByteSize::mib(64));
    let mut kept = Vec::new();
    engine
        .run(
            &dev,
            100,
            |plan| {
                for c in plan.chunks() {
                    kept.push(dev.alloc::<u8>(c.len() * MIB)?);
                }
                Ok::<_, Error>(())
            },
            |()| (),
        )
        .unwrap_err()
}

/// A step that keeps what each chunk allocated across attempts (a leak behind the retries).
/// Before: the engine halved down to micro-batches of 1 row (10 attempts) and said only that
/// the policy allowed nothing smaller; now it stops once the memory held when attempts start
/// has risen twice, and names the growth.
#[test]
fn a_step_that_keeps_memory_across_attempts_is_stopped_and_named() {
    let e = run_a_leaking_step(RetryEngine::new());
    let r = e.report().unwrap().clone();
    let Some(StopReason::HeldGrew { held }) = &r.stopped else {
        panic!("not stopped for the growth: {r}");
    };
    assert_eq!(held, &r.held_bytes);
    assert!(r.held_grew(), "{r}");
    assert!(r.attempts.len() <= 6, "{} attempts: {r}", r.attempts.len());
    assert!(r.final_plan.micro_batch() > 1, "{r}");
    let text = e.to_string();
    assert!(text.contains("allocated grew 0 bytes -> "), "{text}");
    assert!(
        text.contains("keeps memory across attempts (a leak)"),
        "{text}"
    );
    assert!(r.to_string().contains("stopped: allocated grew"), "{r}");
    assert!(matches!(e, RetryError::GaveUp { .. }));
}

/// With the stop turned off, the engine follows its policy down, and still names the growth.
#[test]
fn held_growth_is_named_when_the_stop_is_off() {
    let e = run_a_leaking_step(RetryEngine::new().stop_when_held_grows(false));
    let r = e.report().unwrap();
    assert_eq!(r.stopped, None);
    assert_eq!(r.final_plan.micro_batch(), 1, "{r}");
    let text = e.to_string();
    assert!(text.contains("the policy allows nothing smaller"), "{text}");
    assert!(text.contains("allocated grew"), "{text}");
    assert!(text.contains("(a leak?)"), "{text}");
}

/// A step that gives back what it allocates is not stopped, however many retries it takes; its
/// held bytes stay where they were.
#[test]
fn a_clean_step_is_never_stopped_for_growth() {
    let dev = Device::sim(ByteSize::mib(64));
    let _weights = dev.alloc::<u8>(40 * MIB).unwrap();
    let out = RetryEngine::new()
        .run(
            &dev,
            400,
            |plan| {
                for c in plan.chunks() {
                    dev.alloc::<u8>(c.len() * MIB / 4)?;
                }
                Ok::<_, Error>(())
            },
            |()| (),
        )
        .unwrap();
    let r = out.report;
    assert!(r.retries() >= 3, "{r}");
    assert!(r.held_bytes.iter().all(|&b| b == 40 * MIB as u64), "{r:?}");
    assert!(!r.held_grew());
    assert!(!r.to_string().contains("grew"), "{r}");
}

/// A request larger than the whole card: the same plan is not retried (emptying the cache
/// cannot make it fit), and once the request does not shrink with the plan, the step stops
/// and says why. Before: the engine retried the same plan, then halved down to 1 row (8
/// attempts for 100 rows).
#[test]
fn a_request_larger_than_the_card_is_not_retried_as_it_is() {
    let dev = Device::sim(ByteSize::mib(64));
    let e = RetryEngine::new()
        .run(
            &dev,
            100,
            |_plan| {
                // a weight-sized buffer that does not depend on the batch
                dev.alloc::<u8>(128 * MIB)?;
                Ok::<_, Error>(())
            },
            |()| (),
        )
        .unwrap_err();
    let r = e.report().unwrap().clone();
    assert_eq!(r.attempts.len(), 2, "{r}");
    let (first, second) = (&r.attempts[0], &r.attempts[1]);
    assert!(first
        .too_large
        .is_some_and(|t| t.requested == 128 * MIB as u64
            && t.capacity == 64 * MIB as u64
            && !t.budget));
    assert_ne!(first.plan, second.plan, "the same plan was retried: {r}");
    assert!(
        matches!(r.stopped, Some(StopReason::TooLarge { .. })),
        "{r}"
    );
    let text = e.to_string();
    assert!(
        text.contains("a request of 128.00 MiB against the device's whole capacity of 64.00 MiB did not shrink"),
        "{text}"
    );
    assert!(
        r.to_string().contains("so the same plan was not retried"),
        "{r}"
    );
}

/// A request larger than the card that shrinks with the plan is retried smaller (not as it
/// was) until it fits; a budget's whole limit counts as the whole.
#[test]
fn a_too_large_request_that_shrinks_with_the_plan_is_followed_down() {
    let dev = Device::sim(ByteSize::mib(64));
    let out = RetryEngine::new()
        .run(
            &dev,
            100,
            |plan| {
                for c in plan.chunks() {
                    dev.alloc::<u8>(c.len() * MIB)?;
                }
                Ok::<_, Error>(())
            },
            |()| (),
        )
        .unwrap();
    let r = &out.report;
    assert!(r.attempts.iter().all(|a| a.too_large.is_some()), "{r}");
    assert!(
        r.attempts.windows(2).all(|w| w[0].plan != w[1].plan),
        "a same-plan retry ran: {r}"
    );
    assert_eq!(r.final_plan.micro_batch(), 50, "{r}");

    let _budget = dev.thread_budget(ByteSize::mib(8));
    let e = RetryEngine::new()
        .run(&dev, 4, |_| dev.alloc::<u8>(16 * MIB).map(drop), |()| ())
        .unwrap_err();
    let r = e.report().unwrap();
    assert!(r.attempts[0].too_large.is_some_and(|t| t.budget), "{r}");
    assert!(
        e.to_string()
            .contains("the budget's whole limit of 8.00 MiB"),
        "{e}"
    );
}

/// A step followed down to one row whose one row alone is larger than the whole budget (or
/// card) says what to raise: it said only that the policy allowed nothing smaller.
#[test]
fn a_step_whose_one_row_passes_the_whole_says_what_to_raise() {
    let dev = Device::sim(ByteSize::mib(64));
    let per_row = |dev: &Device, bytes: usize| {
        RetryEngine::new()
            .run(
                dev,
                8,
                |plan| {
                    for c in plan.chunks() {
                        dev.alloc::<u8>(c.len() * bytes)?;
                    }
                    Ok::<_, Error>(())
                },
                |()| (),
            )
            .unwrap_err()
    };
    let budget = dev.thread_budget(ByteSize::b(0));
    let e = per_row(&dev, MIB);
    assert_eq!(e.report().unwrap().stopped, None, "{e}");
    let text = e.to_string();
    assert!(text.contains("the policy allows nothing smaller"), "{text}");
    assert!(
        text.contains("its last plan made a request of 1.00 MiB against the budget's whole limit of 0 bytes: raise the budget"),
        "{text}"
    );
    drop(budget);
    let text = per_row(&dev, 100 * MIB).to_string();
    assert!(
        text.contains("against the device's whole capacity of 64.00 MiB: it needs a larger device"),
        "{text}"
    );
}

/// The error says what was requested against what: `IsOom::oom_request` through oomguard's
/// errors, wrappers and `io::Error`; the engine asks the policy with `Pressure::TooLarge`.
#[test]
fn oom_requests_are_read_through_wrappers() {
    let dev = Device::sim(ByteSize::mib(8));
    let e = dev.alloc::<u8>(16 * MIB).unwrap_err();
    let r = e.oom_request().unwrap();
    assert!(r.exceeds_capacity() && !r.budget);
    let io: std::io::Error = e.into();
    assert_eq!(io.oom_request(), Some(r));
    let fits = dev.alloc::<u8>(4 * MIB).unwrap();
    let e = dev.alloc::<u8>(6 * MIB).unwrap_err();
    assert!(
        !e.oom_request().unwrap().exceeds_capacity(),
        "a request the card could hold"
    );
    drop(fits);
    assert_eq!(Error::InvalidArgument("x".into()).oom_request(), None);
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = seen.clone();
    let policy =
        oomguard_runtime::retry::FnPolicy(move |ctx: &oomguard_runtime::retry::RetryContext| {
            log.lock().unwrap().push(ctx.pressure);
            BatchPlan::with_micro_batch(ctx.plan.batch(), 1)
                .ok()
                .filter(|p| *p != ctx.plan)
        });
    let _ = RetryEngine::new().with_policy(policy).run(
        &dev,
        2,
        |_| dev.alloc::<u8>(16 * MIB).map(drop),
        |()| (),
    );
    assert_eq!(*seen.lock().unwrap(), vec![Pressure::TooLarge]);
}

/// A step whose second layer is 4 times as wide as its first, 100 rows on a 64 MiB card: the
/// first attempt fails on the narrow layer (100 MiB), the second (2 × 50 rows) on the wide one
/// (200 MiB). The two failing requests are two different allocations, so the larger second one
/// says nothing about a request that does not shrink. Before: the engine stopped there ("no
/// plan can serve it"); 7-row chunks fit.
#[test]
fn a_step_whose_layers_widen_is_split_until_it_fits() {
    let dev = Device::sim(ByteSize::mib(64));
    let out = RetryEngine::new()
        .run(
            &dev,
            100,
            |plan| {
                for c in plan.chunks() {
                    let narrow = dev.alloc::<u8>(c.len() * MIB)?;
                    let wide = dev.alloc::<u8>(c.len() * 4 * MIB)?;
                    drop((narrow, wide));
                }
                Ok::<_, Error>(())
            },
            |()| (),
        )
        .unwrap_or_else(|e| panic!("{e}"));
    let r = &out.report;
    let requested: Vec<_> = r
        .attempts
        .iter()
        .map(|a| a.too_large.map(|t| t.requested))
        .collect();
    assert_eq!(
        requested[..2],
        [Some(100 * MIB as u64), Some(200 * MIB as u64)],
        "{r}"
    );
    assert_eq!(r.stopped, None, "{r}");
    assert_eq!(r.final_plan.batch(), 100, "{r}");
    assert!(r.final_plan.micro_batch() <= 12, "{r}");
}

/// Layers of 1 and 2 MiB per row: the second attempt (2 × 50 rows) fails on the wide layer with
/// a request of the same size as the first attempt's (100 MiB), but with the narrow layer's
/// 50 MiB in use: another allocation, not the same one failing again. Before: stopped.
#[test]
fn an_equal_request_of_another_layer_is_not_taken_for_a_fixed_one() {
    let dev = Device::sim(ByteSize::mib(64));
    let out = RetryEngine::new()
        .run(
            &dev,
            100,
            |plan| {
                for c in plan.chunks() {
                    let narrow = dev.alloc::<u8>(c.len() * MIB)?;
                    let wide = dev.alloc::<u8>(c.len() * 2 * MIB)?;
                    drop((narrow, wide));
                }
                Ok::<_, Error>(())
            },
            |()| (),
        )
        .unwrap_or_else(|e| panic!("{e}"));
    let r = &out.report;
    assert_eq!(
        r.attempts[0].too_large.map(|t| t.requested),
        Some(100 * MIB as u64),
        "{r}"
    );
    assert_eq!(
        r.attempts[1].too_large.map(|t| t.requested),
        Some(100 * MIB as u64),
        "{r}"
    );
    assert!(r.final_plan.micro_batch() <= 21, "{r}");
}

/// A weight-sized buffer allocated after the chunk's rows: the same request fails again with
/// less in use before it (the rows shrank), which is still the same allocation: the step stops
/// after two attempts.
#[test]
fn a_fixed_request_after_the_rows_still_stops() {
    let dev = Device::sim(ByteSize::mib(64));
    let e = RetryEngine::new()
        .run(
            &dev,
            100,
            |plan| {
                for c in plan.chunks() {
                    let rows = dev.alloc::<u8>(c.len() * MIB / 8)?;
                    let weight = dev.alloc::<u8>(128 * MIB)?;
                    drop((rows, weight));
                }
                Ok::<_, Error>(())
            },
            |()| (),
        )
        .unwrap_err();
    let r = e.report().unwrap();
    assert_eq!(r.attempts.len(), 2, "{r}");
    assert!(
        matches!(r.stopped, Some(StopReason::TooLarge { .. })),
        "{r}"
    );
}

/// A step whose chunks of more than one row never fit (two 40 MiB blocks live together on a
/// 64 MiB card; each alone fits, so no request is larger than the card), run at `batch` rows.
fn run_a_step_that_needs_single_rows(engine: RetryEngine, batch: usize) -> RetryError<Error> {
    let dev = Device::sim(ByteSize::mib(64));
    engine
        .run(
            &dev,
            batch,
            |plan| {
                if plan.micro_batch() > 1 {
                    let _a = dev.alloc::<u8>(40 * MIB)?;
                    let _b = dev.alloc::<u8>(40 * MIB)?;
                }
                Ok::<_, Error>(plan.micro_batch())
            },
            |m| m,
        )
        .unwrap_err()
}

/// A step given up on because the policy's retry limit was reached says so, and does not say
/// that the policy allowed nothing smaller (it did: micro-batches of 1 row fit). Before: "the
/// policy allows nothing smaller" after 17 attempts, `stopped: None`.
#[test]
fn a_step_stopped_by_the_retry_limit_says_so() {
    let e = run_a_step_that_needs_single_rows(RetryEngine::new(), 1 << 20);
    let r = e.report().unwrap();
    assert_eq!(r.stopped, Some(StopReason::RetryLimit { max: 16 }), "{r}");
    assert_eq!(r.attempts.len(), 17, "{r}");
    assert!(r.final_plan.micro_batch() > 1, "{r}");
    let text = e.to_string();
    assert!(
        text.contains("stopped: the retry policy's limit of 16 retries in one step was reached"),
        "{text}"
    );
    assert!(!text.contains("allows nothing smaller"), "{text}");
    assert!(
        r.to_string().contains("stopped: the retry policy's limit"),
        "{r}"
    );

    // a limit of the caller's, and one retry (the singular)
    use oomguard_runtime::retry::{Accumulate, PolicyExt};
    for max in [1, 3] {
        let engine = RetryEngine::new().with_policy(Accumulate::halving().max_retries(max));
        let e = run_a_step_that_needs_single_rows(engine, 1 << 20);
        let r = e.report().unwrap();
        assert_eq!(r.stopped, Some(StopReason::RetryLimit { max }), "{r}");
        assert_eq!(r.attempts.len() as u32, max + 1, "{r}");
    }
    let engine = RetryEngine::new().with_policy(Accumulate::halving().max_retries(1));
    let text = run_a_step_that_needs_single_rows(engine, 64).to_string();
    assert!(text.contains("limit of 1 retry in one step"), "{text}");
}

/// A policy that runs out of smaller plans within its limit is not said to have hit it: 8 rows
/// halve to 1 in 3 splits (after one retry of the same plan), and 1 row still does not fit
/// here, so the policy has nothing smaller after 5 attempts.
#[test]
fn a_policy_out_of_plans_within_its_limit_is_not_stopped_by_it() {
    let dev = Device::sim(ByteSize::mib(64));
    let e = RetryEngine::new()
        .run(
            &dev,
            8,
            |plan| {
                let _a = dev.alloc::<u8>(40 * MIB)?;
                let _b = dev.alloc::<u8>(plan.micro_batch() * 4 * MIB)?;
                let _c = dev.alloc::<u8>(30 * MIB)?;
                Ok::<_, Error>(())
            },
            |()| (),
        )
        .unwrap_err();
    let r = e.report().unwrap();
    assert_eq!(r.stopped, None, "{r}");
    assert_eq!(r.final_plan.micro_batch(), 1, "{r}");
    assert!(
        e.to_string().contains("the policy allows nothing smaller"),
        "{e}"
    );
}

/// A policy that never splits (a same-plan retry alone) gives up with the batch whole: the text
/// does not say only "it needs a larger device" when smaller micro-batches were never tried.
#[test]
fn a_give_up_without_a_split_names_the_split_too() {
    let dev = Device::sim(ByteSize::mib(64));
    let e = RetryEngine::new()
        .with_policy(oomguard_runtime::retry::EmptyCacheRetry::once())
        .run(
            &dev,
            8,
            |plan| {
                for c in plan.chunks() {
                    dev.alloc::<u8>(c.len() * 10 * MIB)?;
                }
                Ok::<_, Error>(())
            },
            |()| (),
        )
        .unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains("it needs a larger device, or a policy that splits the batch into smaller micro-batches (its plan had 8 rows at once)"),
        "{text}"
    );
}
