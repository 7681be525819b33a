//! `#[oom_retry]` on the simulated device: batch shrinking, micro-batch plans, remembered plans,
//! giving up with the OOM, non-OOM errors, and guard attributes applied to each attempt.

use std::cell::Cell;

use oomguard::backend::sim::SimDevice;
use oomguard::retry::BatchPlan;
use oomguard::{
    is_grad_enabled, no_grad, oom_retry, AllocatorConfig, ByteSize, Device, DeviceBuffer, Error,
};

const MIB: usize = 1 << 20;

/// A 256 MiB card with all but `free_mib` MiB held by a buffer that outlives the steps. The
/// requests below fit the card but not what is free, so an out-of-memory gets the retry with
/// the same plan after emptying the cache (a request larger than the whole card skips it,
/// issue 32.12).
fn card_with_free(free_mib: usize) -> (Device, DeviceBuffer<u8>) {
    let dev = Device::sim(ByteSize::mib(256));
    let held = dev.alloc::<u8>((256 - free_mib) * MIB).unwrap();
    (dev, held)
}

/// Micro-batches of 2 MiB rows: 100 rows need micro-batches of 25 in 64 MiB free.
#[oom_retry(plan = plan)]
fn train_step(dev: &Device, plan: &BatchPlan, attempts: &Cell<u32>) -> Result<usize, Error> {
    attempts.set(attempts.get() + 1);
    let mut rows = 0;
    for c in plan.chunks() {
        rows += dev.alloc::<u8>(c.len() * 2 * MIB)?.len() / (2 * MIB);
    }
    Ok(rows)
}

#[test]
fn plan_is_split_and_remembered() {
    let (dev, held) = card_with_free(64);
    let attempts = Cell::new(0);
    let plan = BatchPlan::whole(100).unwrap();
    assert_eq!(train_step(&dev, &plan, &attempts).unwrap(), 100);
    // whole, whole again after emptying the cache, 50, 25
    assert_eq!(attempts.get(), 4);
    attempts.set(0);
    assert_eq!(train_step(&dev, &plan, &attempts).unwrap(), 100);
    assert_eq!(
        attempts.get(),
        1,
        "the second call starts from the plan that worked"
    );
    assert_eq!(dev.stats().allocated_bytes.all.current, 192 * MIB as u64);
    drop(held);
    assert_eq!(dev.stats().allocated_bytes.all.current, 0);
}

/// Inference over `rows` rows of 1 MiB; returns how many it processed. `#[no_grad]`: the step
/// evaluates, so `batch =` may shrink it.
#[oom_retry(batch = rows, min = 8, remember = false)]
#[oomguard::no_grad]
fn infer(dev: &Device, rows: u32, attempts: &Cell<u32>) -> Result<u32, Error> {
    attempts.set(attempts.get() + 1);
    let out = dev.alloc::<u8>(rows as usize * MIB)?;
    Ok((out.len() / MIB) as u32)
}

#[test]
fn batch_shrinks_down_to_min_then_gives_up_with_the_oom() {
    let (dev, _held) = card_with_free(64);
    let attempts = Cell::new(0);
    assert_eq!(infer(&dev, 200, &attempts).unwrap(), 50);
    assert_eq!(
        attempts.get(),
        4,
        "200, 200 after emptying the cache, 100, 50"
    );
    attempts.set(0);
    assert_eq!(infer(&dev, 200, &attempts).unwrap(), 50);
    assert_eq!(attempts.get(), 4, "remember = false: learns again");
    let (small, _small_held) = card_with_free(4);
    attempts.set(0);
    let e = infer(&small, 200, &attempts).unwrap_err();
    assert!(e.is_oom(), "{e}");
    assert!(e.to_string().contains("Tried to allocate 8.00 MiB"), "{e}");
    assert_eq!(attempts.get(), 7, "200, 200, 100, 50, 25, 12, 8");
    // On a 4 MiB card the 200 MiB request is larger than the whole card: no retry with the
    // same plan can help (issue 32.12), so it goes straight to 100 and still ends at the min.
    let tiny = Device::sim(ByteSize::mib(4));
    attempts.set(0);
    let e = infer(&tiny, 200, &attempts).unwrap_err();
    assert!(e.is_oom(), "{e}");
    assert!(e.to_string().contains("Tried to allocate 8.00 MiB"), "{e}");
    assert_eq!(attempts.get(), 6, "200, 100, 50, 25, 12, 8");
}

#[oom_retry(max_retries = 2)]
fn plain(dev: &Device, attempts: &Cell<u32>, fail: bool) -> Result<(), Error> {
    attempts.set(attempts.get() + 1);
    if fail {
        return Err(Error::InvalidArgument("bad input".into()));
    }
    let _b = dev.alloc::<u8>(MIB)?;
    Ok(())
}

#[test]
fn plain_retries_after_emptying_the_cache_and_not_other_errors() {
    let sim = SimDevice::new(ByteSize::mib(64));
    let dev = Device::new(sim.clone(), AllocatorConfig::default());
    let attempts = Cell::new(0);
    sim.faults().fail_nth_request(0);
    plain(&dev, &attempts, false).unwrap();
    assert_eq!(attempts.get(), 2);
    attempts.set(0);
    let e = plain(&dev, &attempts, true).unwrap_err();
    assert!(e.to_string().contains("bad input"));
    assert_eq!(attempts.get(), 1, "a non-OOM error is not retried");
}

#[oom_retry(batch = n)]
#[no_grad]
fn eval_rows(dev: &Device, n: usize, grad_seen: &Cell<bool>) -> Result<usize, Error> {
    grad_seen.set(grad_seen.get() || is_grad_enabled());
    Ok(dev.alloc::<u8>(n * MIB)?.len() / MIB)
}

#[test]
fn guards_apply_to_each_attempt() {
    let dev = Device::sim(ByteSize::mib(64));
    let grad_seen = Cell::new(false);
    assert_eq!(eval_rows(&dev, 100, &grad_seen).unwrap(), 50);
    assert!(!grad_seen.get(), "every attempt ran without grad");
    assert!(is_grad_enabled());
    let _g = no_grad();
    assert_eq!(
        eval_rows(&dev, 0, &grad_seen).unwrap(),
        0,
        "an empty batch runs once"
    );
}
