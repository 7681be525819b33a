//! `find_max_batch` on steps whose memory is monotone but not affine in the batch (issue 15,
//! point 15): quadratic (attention), a jump (a kernel switching to a large workspace),
//! bucketed (rows padded to a multiple). At least 0.95 of the true maximum for each; at most 8
//! step runs, except a memory jump far below the linear prediction (11); at most 4 on affine
//! steps (tests/retry_finder.rs).

use oomguard_runtime::backend::sim::SimDevice;
use oomguard_runtime::retry::{find_max_batch, FinderOptions};
use oomguard_runtime::{AllocatorConfig, ByteSize, Device, Error};

const MIB: usize = 1 << 20;

type Shape = fn(&Device, usize) -> Result<(), Error>;

fn quadratic(dev: &Device, rows: usize) -> Result<(), Error> {
    let _lin = dev.alloc::<u8>(rows * MIB)?;
    let _quad = dev.alloc::<u8>(rows * rows * 4096)?;
    Ok(())
}

fn quadratic_small(dev: &Device, rows: usize) -> Result<(), Error> {
    let _lin = dev.alloc::<u8>(rows * 64 * 1024)?;
    let _quad = dev.alloc::<u8>(rows * rows * 512)?;
    Ok(())
}

fn jump(dev: &Device, rows: usize) -> Result<(), Error> {
    let _a = dev.alloc::<u8>(rows * MIB)?;
    let _ws = dev.alloc::<u8>(if rows > 300 { 900 * MIB } else { MIB })?;
    Ok(())
}

fn jump_early(dev: &Device, rows: usize) -> Result<(), Error> {
    let _a = dev.alloc::<u8>(rows * MIB / 4)?;
    let _ws = dev.alloc::<u8>(if rows > 64 { 2000 * MIB } else { MIB })?;
    Ok(())
}

fn bucketed(dev: &Device, rows: usize) -> Result<(), Error> {
    let padded = rows.div_ceil(64) * 64;
    let _a = dev.alloc::<u8>(padded * MIB)?;
    Ok(())
}

fn bucketed_coarse(dev: &Device, rows: usize) -> Result<(), Error> {
    let padded = rows.div_ceil(256) * 256;
    let _a = dev.alloc::<u8>(padded * MIB / 8)?;
    let _ws = dev.alloc::<u8>(100 * MIB)?;
    Ok(())
}

fn true_max(dev: &Device, step: Shape) -> usize {
    let (mut lo, mut hi) = (0usize, 1usize);
    while step(dev, hi).is_ok() {
        lo = hi;
        hi *= 2;
    }
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if step(dev, mid).is_ok() {
            lo = mid
        } else {
            hi = mid
        }
    }
    lo
}

#[test]
fn monotone_steps_take_at_most_8_runs_and_reach_95_percent() {
    // (name, step, device MiB, most runs)
    let shapes: [(&str, Shape, u64, usize); 6] = [
        ("quadratic", quadratic, 2048, 8),
        ("quadratic small", quadratic_small, 4096, 8),
        ("jump at 300", jump, 1024, 8),
        // the linear prediction is 60× the limit: the bracket is searched blind
        ("jump at 64", jump_early, 1024, 11),
        ("bucketed by 64", bucketed, 1000, 8),
        ("bucketed by 256", bucketed_coarse, 4000, 8),
    ];
    let mut failures = Vec::new();
    for (name, step, mib, most) in shapes {
        let dev = Device::new(
            SimDevice::address_only(ByteSize::mib(mib)),
            AllocatorConfig::default(),
        );
        let truth = true_max(&dev, step);
        let r = find_max_batch(&dev, FinderOptions::default(), |rows| step(&dev, rows)).unwrap();
        let ratio = r.max_batch as f64 / truth as f64;
        println!(
            "{name}: true {truth}, found {} ({ratio:.3}) in {} runs",
            r.max_batch,
            r.runs()
        );
        if r.max_batch > truth || ratio < 0.95 || r.runs() > most || r.stopped_by_max_trials {
            failures.push(format!("{name}: true {truth}: {r}"));
        }
        assert!(step(&dev, r.max_batch).is_ok());
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn the_report_says_when_max_trials_stopped_the_search() {
    let dev = Device::new(
        SimDevice::address_only(ByteSize::mib(2048)),
        AllocatorConfig::default(),
    );
    let opts = FinderOptions {
        max_trials: 4,
        ..FinderOptions::default()
    };
    let r = find_max_batch(&dev, opts, |rows| quadratic(&dev, rows)).unwrap();
    assert_eq!(r.runs(), 4);
    assert!(r.stopped_by_max_trials, "{r}");
    let r = find_max_batch(&dev, FinderOptions::default(), |rows| quadratic(&dev, rows)).unwrap();
    assert!(!r.stopped_by_max_trials, "{r}");
}

#[test]
fn a_step_that_retries_internally_is_refused() {
    use oomguard_runtime::retry::{inference_policy, FinderError, RetryEngine};
    let dev = Device::new(
        SimDevice::address_only(ByteSize::mib(1024)),
        AllocatorConfig::default(),
    );
    // shrinks its batch on OOM: it "succeeds" at any size
    let engine = RetryEngine::new().with_policy(inference_policy());
    let e = find_max_batch(&dev, FinderOptions::default(), |rows| {
        engine
            .run(&dev, rows, |plan| bucketed(&dev, plan.batch()), |_| ())
            .map(|r| r.value)
    })
    .unwrap_err();
    assert!(matches!(e, FinderError::RetriesInside { .. }), "{e}");
}
