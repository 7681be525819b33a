//! After an out-of-memory, the retry engine empties the caches of the sources that want it
//! (`MemorySource::retry_empties_cache`): a fixed-segment cache gives its free segments back;
//! growable segments keep their free pages mapped, and the next attempt takes them where it
//! needs them instead of mapping them again.

use oomguard_runtime::retry::RetryEngine;
use oomguard_runtime::source::MemorySource;
use oomguard_runtime::{AllocatorConfig, ByteSize, Device, Error};

const MIB: usize = 1 << 20;

/// 100 rows of 1 MiB each, held at once, on a 64 MiB card: the whole batch fails, a split runs.
fn split_step(dev: &Device) -> usize {
    let done = RetryEngine::new()
        .run(
            dev,
            100,
            |plan| {
                for c in plan.chunks() {
                    let _rows = dev.alloc::<u8>(c.len() * MIB)?;
                }
                Ok::<_, Error>(())
            },
            |()| (),
        )
        .unwrap();
    assert!(done.report.retries() > 0, "{}", done.report);
    done.report.final_plan.micro_batch()
}

fn device(cfg: &str) -> Device {
    Device::new(
        oomguard_runtime::backend::sim::SimDevice::new(ByteSize::mib(64)),
        AllocatorConfig::parse(cfg).unwrap(),
    )
}

#[test]
fn growable_segments_keep_their_pages_across_a_retry() {
    let dev = device("expandable_segments:True");
    assert!(!dev.retry_empties_cache());
    // pages a failed attempt left free, mapped: the retry must not unmap them
    let warm = dev.alloc::<u8>(40 * MIB).unwrap();
    drop(warm);
    let before = dev.stats();
    let micro = split_step(&dev);
    let after = dev.stats();
    assert!(micro < 100);
    assert_eq!(
        after.unmapped_bytes_total, before.unmapped_bytes_total,
        "the engine emptied a growable cache"
    );
    assert_eq!(after.num_sync_all_streams, before.num_sync_all_streams);
    assert!(after.reserved_bytes.all.current > 0, "nothing left mapped");
}

#[test]
fn fixed_segments_are_still_given_back_after_an_oom() {
    let dev = device("expandable_segments:False");
    assert!(dev.retry_empties_cache());
    let warm = dev.alloc::<u8>(40 * MIB).unwrap();
    drop(warm);
    let before = dev.stats();
    split_step(&dev);
    let after = dev.stats();
    assert!(
        after.num_device_free > before.num_device_free,
        "the free segment went back"
    );
}
