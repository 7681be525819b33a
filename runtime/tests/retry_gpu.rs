//! OOM retry on a real GPU (ignored by default: run on the accelerator machine with
//! `../shared/gpu/stage --test retry_gpu` and `bash .gpu/run`). Each test prints its figures.
#![cfg(feature = "cuda")]

use oomguard_runtime::retry::{find_max_batch, BatchPlan, FinderOptions, IsOom, RetryEngine};
use oomguard_runtime::{AllocatorConfig, Device, Error};

const GIB: usize = 1 << 30;

fn cuda(config: AllocatorConfig) -> Device {
    Device::cuda_with_config(0, config).unwrap_or_else(|e| panic!("CUDA device 0 is needed: {e}"))
}

/// A step whose micro-batches each need `rows × row_bytes` of device memory, written through.
fn touch(dev: &Device, plan: &BatchPlan, row_bytes: usize) -> Result<usize, Error> {
    let mut rows = 0;
    for c in plan.chunks() {
        let acts = dev.zeros::<u8>(c.len() * row_bytes)?;
        rows += acts.len() / row_bytes;
    }
    Ok(rows)
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn real_oom_is_classified_and_retried() {
    for (name, config) in [
        ("native", AllocatorConfig::native()),
        ("growable", AllocatorConfig::default()),
    ] {
        let dev = cuda(config);
        let total = dev.mem_info().unwrap().total as usize;
        // a batch needing 1.6 × the card in one pass
        let row = 2 * GIB;
        let batch = (total * 8 / 5) / row;
        let err = dev.zeros::<u8>(batch * row).unwrap_err();
        assert!(IsOom::is_oom(&err), "{err}");
        let engine = RetryEngine::new();
        let mut commits = 0;
        let mut step = || {
            engine
                .run(
                    &dev,
                    batch,
                    |p| touch(&dev, p, row),
                    |rows| {
                        commits += 1;
                        rows
                    },
                )
                .unwrap()
        };
        let out = step();
        println!("{name}: {}", out.report);
        assert_eq!(out.value, batch, "every row processed");
        // a request larger than the whole card is not retried with the same plan: the first
        // retry already splits it (issue 32, point 12)
        assert!(out.report.retries() >= 1);
        assert!(
            out.report.to_string().contains("larger than the whole"),
            "{}",
            out.report
        );
        assert!(out.report.final_plan.micro_batch() * row < total);
        // remembered: the second step makes no retry
        let again = step();
        assert_eq!(again.report.retries(), 0);
        assert_eq!(commits, 2);
        assert_eq!(dev.stats().allocated_bytes.all.current, 0);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn batch_finder_on_the_gpu() {
    let dev = cuda(AllocatorConfig::default());
    let _weights = dev.zeros::<u8>(GIB).unwrap();
    // 6 layers of 48 MiB activations per row, 1 GiB of gradients, 256 MiB workspace
    let step = |rows: usize| -> Result<(), Error> {
        let mut acts = Vec::new();
        for _ in 0..6 {
            acts.push(dev.alloc::<u8>(rows * (48 << 20))?);
        }
        let _g = dev.alloc::<u8>(GIB)?;
        let _ws = dev.alloc::<u8>(256 << 20)?;
        Ok(())
    };
    let t0 = std::time::Instant::now();
    let report = find_max_batch(&dev, FinderOptions::default(), step).unwrap();
    let took = t0.elapsed();
    // the true maximum, by bisection
    dev.empty_cache().unwrap();
    let (mut lo, mut hi) = (report.max_batch, report.max_batch * 2);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        let ok = step(mid).is_ok();
        dev.empty_cache().unwrap();
        if ok {
            lo = mid
        } else {
            hi = mid
        }
    }
    let ratio = report.max_batch as f64 / lo as f64;
    println!("{report}\ntrue max {lo}, found/max {ratio:.3}, {took:.2?}");
    assert!(report.runs() <= 4, "{report}");
    assert!(ratio >= 0.95, "{ratio}");
}
