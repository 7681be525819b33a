//! `find_max_batch` on steps whose memory is monotone but not affine in the batch (issue 15,
//! point 15): quadratic (attention-like), jumps (a kernel switching to a large workspace) at
//! many positions, a staircase of workspaces, bucketed rows (padded to a multiple or to a power
//! of two), concave growth. Every search ends at 0.95 of the true maximum or more, never above
//! it. At most 8 step runs where the measured peaks say where the limit is; where memory jumps at
//! a row nothing measured points to, no search can do better than bisecting between the
//! probe at `8 × start` and the failed jump, and the finder takes no more than that (the
//! bisection bound is computed here): 9–11 runs on these shapes. At most 4 runs on affine steps
//! (also tests/retry_finder.rs).

use oomguard_runtime::backend::sim::SimDevice;
use oomguard_runtime::retry::{find_max_batch, FinderOptions, FinderReport};
use oomguard_runtime::{AllocatorConfig, ByteSize, Device, Error};

const MIB: usize = 1 << 20;

type Step = Box<dyn Fn(&Device, usize) -> Result<(), Error>>;

/// `rows × per_row + fixed` bytes.
fn affine(per_row: usize, fixed: usize) -> Step {
    Box::new(move |dev, rows| {
        let _a = dev.alloc::<u8>(rows * per_row)?;
        let _f = dev.alloc::<u8>(fixed)?;
        Ok(())
    })
}

/// `rows × lin + rows² × quad` bytes.
fn quadratic(lin: usize, quad: usize) -> Step {
    Box::new(move |dev, rows| {
        let _l = dev.alloc::<u8>(rows * lin)?;
        let _q = dev.alloc::<u8>(rows.saturating_mul(rows).saturating_mul(quad))?;
        Ok(())
    })
}

/// `rows × per_row`, plus a workspace of `small` bytes up to `at` rows and `large` above.
fn jump(per_row: usize, at: usize, small: usize, large: usize) -> Step {
    Box::new(move |dev, rows| {
        let _a = dev.alloc::<u8>(rows * per_row)?;
        let _ws = dev.alloc::<u8>(if rows > at { large } else { small })?;
        Ok(())
    })
}

/// Rows padded to a multiple of `bucket`, `per_row` bytes each, plus `fixed`.
fn bucketed(bucket: usize, per_row: usize, fixed: usize) -> Step {
    Box::new(move |dev, rows| {
        let _a = dev.alloc::<u8>(rows.div_ceil(bucket) * bucket * per_row)?;
        let _f = dev.alloc::<u8>(fixed)?;
        Ok(())
    })
}

/// The largest batch that runs, up to `cap`.
fn true_max(dev: &Device, step: &Step, cap: usize) -> usize {
    let (mut lo, mut hi) = (0usize, 1usize);
    while hi <= cap && step(dev, hi).is_ok() {
        lo = hi;
        hi *= 2;
    }
    hi = hi.min(cap + 1);
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

/// The runs a bisection needs to bring a bracket `(l ran, h did not)` to the finder's stopping
/// rule (`l >= 0.95 × (h - 1)`), whatever the memory does.
fn bisection_runs(l: usize, h: usize) -> usize {
    let settled = |l: usize, h: usize| h <= l + 1 || l as f64 >= 0.95 * (h - 1) as f64;
    // the largest h settled from l, applied until h is passed
    let mut steps = 0usize;
    let mut x = l;
    while x < h {
        let mut y = x + 1;
        while settled(x, y + 1) {
            y += 1;
        }
        x = y;
        steps += 1;
    }
    steps.next_power_of_two().trailing_zeros() as usize
}

/// The most runs a search may take on this report: 8, or the three probes and a blind
/// bisection of what the failed jump left (when memory jumps where nothing measured says).
fn allowed_runs(r: &FinderReport) -> usize {
    match r.trials.get(2) {
        Some(t) if t.peak_bytes.is_none() => 8.max(3 + bisection_runs(r.trials[1].rows, t.rows)),
        _ => 8,
    }
}

/// Runs the finder on `step` on a device of `mib` MiB; returns a failure's description.
fn check(name: &str, step: &Step, mib: u64, most_runs: Option<usize>) -> Option<String> {
    let dev = Device::new(
        SimDevice::address_only(ByteSize::mib(mib)),
        AllocatorConfig::default(),
    );
    let opts = FinderOptions::default();
    let truth = true_max(&dev, step, opts.max);
    let r = find_max_batch(&dev, opts, |rows| step(&dev, rows)).unwrap();
    let ratio = r.max_batch as f64 / truth as f64;
    let most = most_runs.unwrap_or_else(|| allowed_runs(&r));
    let rows: Vec<String> = r
        .trials
        .iter()
        .map(|t| {
            format!(
                "{}{}",
                t.rows,
                if t.peak_bytes.is_some() { "" } else { "x" }
            )
        })
        .collect();
    println!(
        "{name:<26} true {truth:>7}  found {:>7} ({ratio:.3})  runs {:>2} (at most {most})  [{}]",
        r.max_batch,
        r.runs(),
        rows.join(" ")
    );
    assert!(step(&dev, r.max_batch).is_ok(), "{name}: {r}");
    (r.max_batch > truth || ratio < 0.95 || r.runs() > most || r.stopped_by_max_trials)
        .then(|| format!("{name}: true {truth}, at most {most} runs: {r}"))
}

#[test]
fn affine_steps_take_at_most_4_runs() {
    let shapes: Vec<(&str, Step, u64)> = vec![
        ("affine, activations only", affine(MIB, 0), 1024),
        ("affine, large fixed part", affine(MIB / 4, 700 * MIB), 1024),
        ("affine, small rows", affine(64 << 10, 3 * MIB), 8192),
    ];
    let failures: Vec<_> = shapes
        .iter()
        .filter_map(|(name, step, mib)| check(name, step, *mib, Some(4)))
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn monotone_steps_take_at_most_8_runs_where_the_peaks_point_to_the_limit() {
    let mut shapes: Vec<(String, Step, u64)> = vec![
        ("quadratic".into(), quadratic(MIB, 4096), 2048),
        (
            "quadratic, small rows".into(),
            quadratic(64 << 10, 512),
            4096,
        ),
        ("quadratic only".into(), quadratic(0, 1024), 8192),
        ("bucketed by 64".into(), bucketed(64, MIB, 0), 1000),
        (
            "bucketed by 256".into(),
            bucketed(256, MIB / 8, 100 * MIB),
            4000,
        ),
        (
            "concave".into(),
            Box::new(|dev: &Device, rows: usize| {
                let _a = dev.alloc::<u8>(((rows as f64).sqrt() * 16.0 * MIB as f64) as usize)?;
                Ok(())
            }),
            4000,
        ),
    ];
    // A jump that still leaves room for rows past it: the limit is on the line after the jump.
    for at in [10, 40, 100] {
        shapes.push((
            format!("jump +25% at {at}"),
            jump(MIB / 4, at, MIB, 256 * MIB),
            1024,
        ));
    }
    // A jump below the largest batch that fits after it.
    for at in [16, 64, 100] {
        shapes.push((
            format!("jump +900 MiB at {at}"),
            jump(MIB, at, MIB, 900 * MIB),
            1024,
        ));
    }
    let failures: Vec<_> = shapes
        .iter()
        .filter_map(|(name, step, mib)| check(name, step, *mib, Some(8)))
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn memory_jumps_anywhere_cost_no_more_than_bisecting_the_failed_jump() {
    let mut shapes: Vec<(String, Step, u64)> = Vec::new();
    // Past the jump nothing fits: the limit is the jump itself, which no peak points to.
    for at in [150, 200, 300, 450, 600, 800] {
        shapes.push((
            format!("jump +900 MiB at {at}"),
            jump(MIB, at, MIB, 900 * MIB),
            1024,
        ));
    }
    for at in [10, 16, 24, 40, 64, 100, 200, 400, 800, 1600, 3000] {
        shapes.push((
            format!("jump +2000 MiB at {at}"),
            jump(MIB / 4, at, MIB, 2000 * MIB),
            1024,
        ));
    }
    for at in [300, 1000, 2000] {
        shapes.push((
            format!("jump +25% at {at}"),
            jump(MIB / 4, at, MIB, 256 * MIB),
            1024,
        ));
    }
    shapes.push((
        "staircase of workspaces".into(),
        Box::new(|dev: &Device, rows: usize| {
            let _a = dev.alloc::<u8>(rows * MIB / 2)?;
            let _w = dev.alloc::<u8>((rows / 500 + 1) * 300 * MIB)?;
            Ok(())
        }),
        4000,
    ));
    shapes.push((
        "bucketed by powers of two".into(),
        Box::new(|dev: &Device, rows: usize| {
            let _a = dev.alloc::<u8>(rows.next_power_of_two() * MIB / 4)?;
            Ok(())
        }),
        4000,
    ));
    shapes.push((
        "cubic".into(),
        Box::new(|dev: &Device, rows: usize| {
            let bytes = rows.saturating_pow(3).saturating_mul(64).min(1 << 40);
            let _a = dev.alloc::<u8>(bytes + MIB)?;
            Ok(())
        }),
        8192,
    ));
    let failures: Vec<_> = shapes
        .iter()
        .filter_map(|(name, step, mib)| check(name, step, *mib, None))
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn the_report_says_when_max_trials_stopped_the_search() {
    let dev = Device::new(
        SimDevice::address_only(ByteSize::mib(2048)),
        AllocatorConfig::default(),
    );
    let step = quadratic(MIB, 4096);
    let opts = FinderOptions {
        max_trials: 4,
        ..FinderOptions::default()
    };
    let r = find_max_batch(&dev, opts, |rows| step(&dev, rows)).unwrap();
    assert_eq!(r.runs(), 4);
    assert!(r.stopped_by_max_trials, "{r}");
    let r = find_max_batch(&dev, FinderOptions::default(), |rows| step(&dev, rows)).unwrap();
    assert!(!r.stopped_by_max_trials, "{r}");
}

#[test]
fn a_step_that_retries_internally_is_refused() {
    use oomguard_runtime::retry::{inference_policy, FinderError, RetryEngine};
    let dev = Device::new(
        SimDevice::address_only(ByteSize::mib(1024)),
        AllocatorConfig::default(),
    );
    let step = bucketed(64, MIB, 0);
    // shrinks its batch on OOM: it "succeeds" at any size
    let engine = RetryEngine::new().with_policy(inference_policy());
    let e = find_max_batch(&dev, FinderOptions::default(), |rows| {
        engine
            .run(&dev, rows, |plan| step(&dev, plan.batch()), |_| ())
            .map(|r| r.value)
    })
    .unwrap_err();
    assert!(matches!(e, FinderError::RetriesInside { .. }), "{e}");
}
