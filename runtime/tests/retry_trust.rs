//! The engine does not trust custom policies: plans with more rows than the step (or than the
//! plan that failed) are refused, and a policy that never gives up is stopped after
//! `MAX_ATTEMPTS` failed attempts.

use oomguard_runtime::retry::{
    BatchPlan, FnPolicy, RetryContext, RetryEngine, RetryError, StopReason, MAX_ATTEMPTS,
};
use oomguard_runtime::{ByteSize, Device, Error};

/// 1 MiB of device memory per row of each micro-batch.
fn step(dev: &Device, plan: &BatchPlan) -> Result<usize, Error> {
    let mut n = 0;
    for c in plan.chunks() {
        n += dev.alloc::<u8>(c.len() << 20)?.len() >> 20;
    }
    Ok(n)
}

#[test]
fn a_policy_that_never_gives_up_is_stopped() {
    // 64 rows of 1 MiB never fit in the 4 MiB left free; the policy retries the same plan
    // forever. (The card could hold them: a request larger than the whole card is stopped
    // sooner, once it does not shrink, issue 32.12.)
    let dev = Device::sim(ByteSize::mib(128));
    let _held = dev.alloc::<u8>(124 << 20).unwrap();
    let engine = RetryEngine::new().with_policy(FnPolicy(|ctx: &RetryContext| Some(ctx.plan)));
    let mut attempts = 0u32;
    let e = engine
        .run(
            &dev,
            64,
            |plan| {
                attempts += 1;
                step(&dev, plan)
            },
            |n| n,
        )
        .unwrap_err();
    assert!(matches!(e, RetryError::GaveUp { .. }), "{e}");
    assert_eq!(attempts, MAX_ATTEMPTS + 1);
    let r = e.report().unwrap();
    // every attempt failed; all but the last were retried
    assert_eq!(r.attempts.len(), (MAX_ATTEMPTS + 1) as usize);
    assert_eq!(r.retries(), MAX_ATTEMPTS as usize);
    assert!(r.gave_up());
    // and says that the cap stopped it (it said "the policy allows nothing smaller")
    let cap = Some(StopReason::AttemptCap { max: MAX_ATTEMPTS });
    assert_eq!(r.stopped, cap, "{r}");
    let text = e.to_string();
    assert!(
        text.contains("stopped: the engine's cap of 64 failed attempts"),
        "{text}"
    );
    assert!(!text.contains("allows nothing smaller"), "{text}");
}

#[test]
fn a_plan_with_more_rows_than_the_step_is_refused() {
    let dev = Device::sim(ByteSize::mib(8));
    let engine = RetryEngine::new().with_policy(FnPolicy(|ctx: &RetryContext| {
        BatchPlan::whole(ctx.requested_batch + 1).ok()
    }));
    let mut attempts = 0;
    let e = engine
        .run(
            &dev,
            16,
            |plan| {
                attempts += 1;
                step(&dev, plan)
            },
            |n| n,
        )
        .unwrap_err();
    assert!(matches!(e, RetryError::GaveUp { .. }), "{e}");
    assert_eq!(attempts, 1, "the larger plan was not run");
    assert!(e.into_error().unwrap().is_oom());
}
