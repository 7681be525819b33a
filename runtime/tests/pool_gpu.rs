//! The CUDA driver's memory pool as a memory source (`DriverPool`), on a real GPU: what cudarc's
//! `CudaStream::alloc` (and so candle) allocates is seen, capped, trimmed and retried. Ignored
//! without a GPU (`../shared/gpu/stage --test pool_gpu`, then `bash .gpu/run` on the device
//! machine); the no-driver test runs everywhere.

use std::sync::Arc;

use oomguard_runtime::cudarc::driver::CudaContext;
use oomguard_runtime::retry::{find_max_batch, FinderOptions, RetryEngine};
use oomguard_runtime::source::guards::{UsageLeakCheck, UsagePeakScope};
use oomguard_runtime::source::{DriverPool, MemorySource};
use oomguard_runtime::IsOom;

const MIB: usize = 1 << 20;

#[test]
fn no_driver_is_an_error_not_a_panic() {
    if oomguard_runtime::backend::cuda::driver_available() {
        return; // a machine with a driver: the GPU tests below cover it
    }
    let e = DriverPool::current(0).unwrap_err();
    assert!(!e.to_string().is_empty());
    assert!(DriverPool::builder(0)
        .max_size(1u64 << 30)
        .install()
        .is_err());
}

fn pool() -> (
    DriverPool,
    Arc<oomguard_runtime::cudarc::driver::CudaStream>,
) {
    let ctx = CudaContext::new(0).expect("a CUDA device");
    let pool = DriverPool::of_context(&ctx).unwrap();
    pool.set_release_threshold(u64::MAX).unwrap();
    (pool, ctx.default_stream())
}

#[test]
#[ignore = "needs a CUDA device"]
fn usage_peak_trim_and_leak_check_follow_cudarc_allocations() {
    let (pool, stream) = pool();
    pool.empty_cache().unwrap();
    let base = pool.usage().unwrap();
    println!("pool at start: {base:?}");
    let peak = UsagePeakScope::new(&pool).unwrap();
    let check = UsageLeakCheck::new(&pool).unwrap();
    let a = stream.alloc_zeros::<u8>(256 * MIB).unwrap();
    let b = stream.alloc_zeros::<u8>(64 * MIB).unwrap();
    stream.synchronize().unwrap();
    let u = pool.usage().unwrap();
    println!("with 320 MiB allocated: {u:?}");
    assert!(u.used >= base.used + 320 * MIB as u64, "{u:?}");
    assert!(u.reserved >= u.used);
    drop(b);
    let r = check.finish().unwrap();
    println!("{r}");
    assert!(
        r.leaked_bytes >= 256 * MIB as u64 && r.leaked_bytes < 320 * MIB as u64,
        "{r}"
    );
    assert!(r.exceeds_allowance());
    assert!(peak.peak_bytes().unwrap() >= base.used + 320 * MIB as u64);
    drop(a);
    stream.synchronize().unwrap();
    let cached = pool.usage().unwrap();
    assert!(
        cached.reserved >= 256 * MIB as u64,
        "the pool caches: {cached:?}"
    );
    pool.empty_cache().unwrap();
    let trimmed = pool.usage().unwrap();
    println!("after empty_cache: {trimmed:?}");
    assert_eq!(trimmed.used, base.used);
    assert!(trimmed.reserved < cached.reserved);
    let s = pool.memory_summary();
    println!("{s}");
    assert!(s.contains("driver pool") && s.contains("release threshold"));
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_budget_caps_what_cudarc_can_allocate_and_lifts_on_drop() {
    let (pool, stream) = pool();
    {
        let budget = pool.budget(512 * MIB as u64).unwrap();
        println!("{budget:?}");
        let fits = stream.alloc_zeros::<u8>(256 * MIB).unwrap();
        let err = stream.alloc_zeros::<u8>(512 * MIB).unwrap_err();
        println!("past the cap: {err}");
        assert!(err.is_oom(), "{err:?}");
        assert!(pool.available().unwrap() <= 256 * MIB as u64);
        drop(fits);
        stream.synchronize().unwrap();
    }
    // lifted: the device's own pool is current again
    let big = stream.alloc_zeros::<u8>(2048 * MIB).unwrap();
    drop(big);
    stream.synchronize().unwrap();
}

#[test]
#[ignore = "needs a CUDA device"]
fn retry_engine_splits_a_step_that_outgrows_a_capped_pool() {
    let (pool, stream) = pool();
    let _budget = pool.budget(1024 * MIB as u64).unwrap();
    let source: Arc<dyn MemorySource> = Arc::new(pool.clone());
    let engine = RetryEngine::new();
    // 16 MiB per row; 100 rows (1.6 GB) do not fit under 1 GiB.
    let done = engine
        .run(
            &source,
            100,
            |plan| {
                let mut rows = 0;
                for c in plan.chunks() {
                    let acts = stream.alloc_zeros::<u8>(c.len() * 16 * MIB)?;
                    stream.synchronize()?;
                    rows += acts.len() / (16 * MIB);
                }
                Ok::<_, oomguard_runtime::cudarc::driver::DriverError>(rows)
            },
            |rows| rows,
        )
        .unwrap();
    println!("{}", done.report);
    assert_eq!(done.value, 100);
    assert!(done.report.retries() >= 1);
    assert!(done.report.final_plan.micro_batch() <= 64);

    // the finder, on the same capped pool
    let r = find_max_batch(&source, FinderOptions::default(), |rows| {
        let _a = stream.alloc_zeros::<u8>(rows * 4 * MIB)?;
        stream.synchronize()
    })
    .unwrap();
    println!("{r}");
    assert!(r.max_batch >= 230 && r.max_batch <= 256, "{r}");
}
