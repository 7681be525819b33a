//! A `RetryEngine` step nested in another engine's attempt (issue 26, point 1): an error after
//! the inner commit ran (in the commit, or later in the outer attempt) ends the outer step
//! without a retry, so the update is applied once; the outer report holds the inner one.

use oomguard_runtime::retry::{last_report, IsOom, RetryEngine, RetryError};
use oomguard_runtime::{ByteSize, Device, Error};

const MIB: usize = 1 << 20;

#[test]
fn an_oom_in_a_nested_engine_commit_is_not_retried_by_the_outer_engine() {
    let dev = Device::sim(ByteSize::mib(64));
    let outer = RetryEngine::new();
    let inner = RetryEngine::new();
    let mut updates = 0u32;
    let r = outer.run(
        &dev,
        4,
        |_plan| -> Result<f32, Error> {
            let step = inner
                .run(
                    &dev,
                    4,
                    |plan| -> Result<f32, Error> {
                        let _acts = dev.alloc::<u8>(plan.micro_batch() * MIB)?;
                        Ok(1.0)
                    },
                    |g| -> Result<f32, Error> {
                        updates += 1;
                        // scratch on the first commit only: a retried outer step would succeed
                        let scratch = if updates == 1 { 512 * MIB } else { 0 };
                        let _s = dev.alloc::<u8>(scratch)?;
                        Ok(g)
                    },
                )
                .map_err(|e| e.into_error().unwrap())?;
            step.value
        },
        |g| g,
    );
    assert_eq!(updates, 1, "the update is applied once");
    let e = r.expect_err("the inner commit failed: the outer step failed");
    let RetryError::Step { error, report } = &e else {
        panic!("{e}")
    };
    assert!(report.attempts.is_empty(), "not retried: {report}");
    assert!(report.nested_commit.is_some(), "{report}");
    assert!(!e.is_oom(), "{e}");
    // the error is marked: no outer layer of any kind takes it for a retryable OOM
    assert!(!error.is_oom(), "{error}");
    assert!(matches!(error, Error::AfterCommit { .. }), "{error:?}");
    assert!(
        e.to_string().contains("committed during the attempt"),
        "{e}"
    );
    let last = last_report().unwrap();
    assert_eq!(last.nested_commit, report.nested_commit);
}

#[test]
fn an_oom_after_a_nested_engine_step_committed_is_not_retried() {
    let dev = Device::sim(ByteSize::mib(64));
    let outer = RetryEngine::new();
    let inner = RetryEngine::new();
    let mut updates = 0u32;
    let mut outer_attempts = 0u32;
    let r = outer.run(
        &dev,
        1,
        |_plan| -> Result<(), Error> {
            outer_attempts += 1;
            inner
                .run(&dev, 1, |_| Ok::<_, Error>(()), |()| updates += 1)
                .map_err(|e| e.into_error().unwrap())?;
            // after the inner update: an out-of-memory the outer engine would have retried
            let bytes = if outer_attempts == 1 { 512 * MIB } else { 0 };
            let _more = dev.alloc::<u8>(bytes)?;
            Ok(())
        },
        |()| (),
    );
    assert_eq!((updates, outer_attempts), (1, 1));
    let e = r.expect_err("not retried");
    assert!(e.report().unwrap().nested_commit.is_some(), "{e}");
}

#[test]
fn a_commit_noted_by_hand_stops_the_enclosing_retry() {
    // a hand-driven inner step tells enclosing loops about its commit
    let dev = Device::sim(ByteSize::mib(64));
    let outer = RetryEngine::new();
    let mut attempts = 0;
    let r = outer.run(
        &dev,
        1,
        |_| -> Result<(), Error> {
            attempts += 1;
            oomguard_runtime::retry::note_commit();
            dev.alloc::<u8>(512 * MIB).map(drop)
        },
        |()| (),
    );
    assert_eq!(attempts, 1);
    assert!(r.is_err());
}
