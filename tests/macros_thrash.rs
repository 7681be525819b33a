//! Thrash detection of `#[oom_retry]` watches only what the step uses: another thread's device
//! whose allocator retries does not make an unrelated step move to smaller plans (issue 15,
//! point 2).

use oomguard::backend::sim::SimDevice;
use oomguard::retry::{last_report, BatchPlan};
use oomguard::{oom_retry, AllocatorConfig, ByteSize, Device, Error};

const MIB: usize = 1 << 20;

/// Each call makes another thread allocate on `other` through an allocator retry (the request
/// does not fit beside the cache: the allocator frees its cache and retries): the other thread's
/// device "thrashes" during every step of this one.
#[oom_retry(plan = plan)]
fn step(dev: &Device, plan: &BatchPlan, other: &Device) -> Result<usize, Error> {
    let mut n = 0;
    for c in plan.chunks() {
        n += dev.alloc::<u8>(c.len() * MIB)?.len() / MIB;
    }
    std::thread::scope(|s| {
        s.spawn(|| {
            // 40 MiB cached, then 50 MiB of 64: the allocator must free its cache and retry
            drop(other.alloc::<u8>(40 * MIB).unwrap());
            drop(other.alloc::<u8>(50 * MIB).unwrap());
            other.empty_cache().unwrap();
        });
    });
    Ok(n)
}

#[test]
fn another_threads_allocator_retries_do_not_shrink_this_step() {
    let dev = Device::sim(ByteSize::mib(64));
    // fixed segments (PyTorch's native mode): a cached segment is only given back by a retry
    let other = Device::new(
        SimDevice::new(ByteSize::mib(64)),
        AllocatorConfig::parse("expandable_segments:False").unwrap(),
    );
    let plan = BatchPlan::whole(16).unwrap();
    for i in 0..8 {
        let before = other.stats().num_alloc_retries;
        assert_eq!(step(&dev, &plan, &other).unwrap(), 16);
        assert!(
            other.stats().num_alloc_retries > before,
            "the other device retried during step {i}"
        );
        let r = last_report().unwrap();
        assert_eq!(r.thrash_moved_to, None, "step {i}: {r}");
        assert_eq!(r.final_plan.num_chunks(), 1, "step {i}: {r}");
    }
    assert_eq!(dev.stats().num_alloc_retries, 0);
}

/// The same churn on the step's own thread: that is the step thrashing.
#[oom_retry(plan = plan)]
fn churning_step(plan: &BatchPlan, dev: &Device) -> Result<usize, Error> {
    drop(dev.alloc::<u8>(40 * MIB)?);
    drop(dev.alloc::<u8>(50 * MIB)?);
    dev.empty_cache()?;
    Ok(plan.batch())
}

#[test]
fn the_steps_own_allocator_retries_still_move_it_down() {
    let dev = Device::new(
        SimDevice::new(ByteSize::mib(64)),
        AllocatorConfig::parse("expandable_segments:False").unwrap(),
    );
    let plan = BatchPlan::whole(16).unwrap();
    let mut moved = None;
    for _ in 0..3 {
        churning_step(&plan, &dev).unwrap();
        moved = moved.or(last_report().unwrap().thrash_moved_to);
    }
    assert_eq!(
        moved.map(|p| p.num_chunks()),
        Some(2),
        "thrash detected after 3 steps"
    );
}
