//! rmm's `statistics_resource_adaptor` tests (tests/mr/device/statistics_mr_tests.cpp: Empty,
//! AllFreed, PeakAllocations, NegativeInnerTracking, Nested), ported to the allocator's
//! statistics scopes (`push_statistics_scope`), in every mode, with one thread and with thread
//! caches on; plus the two cases of issue 32 point 17: requested bytes (two allocations of
//! 1,000 bytes count 2,000) and zero-byte allocations from two threads.

use std::sync::Arc;

use oomguard_runtime::alloc::CachingAllocator;
use oomguard_runtime::backend::sim::SimDevice;
use oomguard_runtime::{AllocatorConfig, ByteSize, Device};

const MIB: u64 = 1 << 20;
const TEN_MIB: u64 = 10 * MIB;
const MODES: [&str; 3] = [
    "expandable_segments:False",
    "expandable_segments:True",
    "backend:cudaMallocAsync",
];

/// Every mode, each with one thread and with a second thread having allocated (thread caches).
fn allocators() -> Vec<(String, Arc<CachingAllocator>)> {
    let mut v = Vec::new();
    for mode in MODES {
        for threads in [1, 2] {
            let sim = SimDevice::address_only(ByteSize::mib(512));
            let a = Arc::new(CachingAllocator::new(
                Arc::new(sim),
                AllocatorConfig::parse(mode).unwrap(),
            ));
            if threads == 2 {
                let b = a.clone();
                std::thread::spawn(move || b.free(b.allocate(1000, 0).unwrap()).unwrap())
                    .join()
                    .unwrap();
            }
            v.push((format!("{mode}, {threads} thread(s)"), a));
        }
    }
    v
}

#[test]
fn empty() {
    for (name, a) in allocators() {
        a.push_statistics_scope();
        let s = a.pop_statistics_scope().unwrap();
        assert_eq!(
            (s.bytes.value, s.bytes.peak, s.bytes.total),
            (0, 0, 0),
            "{name}"
        );
        assert_eq!(
            (s.allocations.value, s.allocations.peak, s.allocations.total),
            (0, 0, 0),
            "{name}"
        );
    }
}

#[test]
fn all_freed() {
    for (name, a) in allocators() {
        a.push_statistics_scope();
        let v: Vec<_> = (0..10).map(|_| a.allocate(TEN_MIB, 0).unwrap()).collect();
        for x in v {
            a.free(x).unwrap();
        }
        let s = a.pop_statistics_scope().unwrap();
        assert_eq!((s.bytes.value, s.allocations.value), (0, 0), "{name}");
    }
}

#[test]
fn peak_allocations() {
    for (name, a) in allocators() {
        a.push_statistics_scope();
        let mut v: Vec<_> = (0..10).map(|_| a.allocate(TEN_MIB, 0).unwrap()).collect();
        // free every other one
        let mut i = 0;
        v.retain(|x| {
            i += 1;
            if i % 2 == 1 {
                a.free(*x).unwrap();
                false
            } else {
                true
            }
        });
        let s = a.statistics_scope().unwrap();
        let m = MIB as i64;
        assert_eq!((s.bytes.value, s.allocations.value), (50 * m, 5), "{name}");
        assert_eq!((s.bytes.peak, s.allocations.peak), (100 * m, 10), "{name}");
        assert_eq!(
            (s.bytes.total, s.allocations.total),
            (100 * m, 10),
            "{name}"
        );
        v.extend((0..10).map(|_| a.allocate(TEN_MIB, 0).unwrap()));
        for x in v {
            a.free(x).unwrap();
        }
        let s = a.pop_statistics_scope().unwrap();
        assert_eq!((s.bytes.value, s.allocations.value), (0, 0), "{name}");
        assert_eq!((s.bytes.peak, s.allocations.peak), (150 * m, 15), "{name}");
        assert_eq!(
            (s.bytes.total, s.allocations.total),
            (200 * m, 20),
            "{name}"
        );
    }
}

/// rmm's NegativeInnerTracking: frees of allocations made before the inner scope count there.
#[test]
fn negative_inner_tracking() {
    for (name, a) in allocators() {
        let m = MIB as i64;
        a.push_statistics_scope();
        let mut v: Vec<_> = (0..10).map(|_| a.allocate(TEN_MIB, 0).unwrap()).collect();
        a.push_statistics_scope();
        v.extend((0..5).map(|_| a.allocate(TEN_MIB, 0).unwrap()));
        let inner = a.statistics_scope().unwrap();
        assert_eq!(
            (inner.bytes.value, inner.allocations.value),
            (50 * m, 5),
            "{name}"
        );
        for x in v {
            a.free(x).unwrap();
        }
        let inner = a.pop_statistics_scope().unwrap();
        assert_eq!(
            (inner.bytes.value, inner.allocations.value),
            (-100 * m, -10),
            "{name}"
        );
        assert_eq!(
            (inner.bytes.peak, inner.allocations.peak),
            (50 * m, 5),
            "{name}"
        );
        assert_eq!(
            (inner.bytes.total, inner.allocations.total),
            (50 * m, 5),
            "{name}"
        );
        let outer = a.pop_statistics_scope().unwrap();
        assert_eq!(
            (outer.bytes.value, outer.allocations.value),
            (0, 0),
            "{name}"
        );
        assert_eq!(
            (outer.bytes.peak, outer.allocations.peak),
            (150 * m, 15),
            "{name}"
        );
        assert_eq!(
            (outer.bytes.total, outer.allocations.total),
            (150 * m, 15),
            "{name}"
        );
    }
}

/// rmm's Nested: a popped scope folds into the one below; popping with none open fails.
#[test]
fn nested() {
    for (name, a) in allocators() {
        let t = TEN_MIB as i64;
        a.push_statistics_scope();
        let a0 = a.allocate(TEN_MIB, 0).unwrap();
        let s = a.statistics_scope().unwrap();
        assert_eq!((s.bytes.value, s.allocations.value), (t, 1), "{name}");
        a.push_statistics_scope();
        let a1 = a.allocate(TEN_MIB, 0).unwrap();
        a.push_statistics_scope();
        let a2 = a.allocate(TEN_MIB, 0).unwrap();
        a.free(a2).unwrap();
        let s = a.pop_statistics_scope().unwrap();
        assert_eq!((s.bytes.value, s.bytes.peak), (0, t), "{name}");
        assert_eq!((s.allocations.value, s.allocations.peak), (0, 1), "{name}");
        a.free(a0).unwrap();
        let s = a.pop_statistics_scope().unwrap();
        assert_eq!((s.bytes.value, s.bytes.peak), (0, 2 * t), "{name}");
        assert_eq!((s.allocations.value, s.allocations.peak), (0, 2), "{name}");
        a.free(a1).unwrap();
        a.pop_statistics_scope().unwrap();
        assert!(a.pop_statistics_scope().is_err(), "{name}");
    }
}

/// Issue 32, point 17: rmm counts requested bytes: two allocations of 1,000 bytes are 2,000
/// (their blocks are 1,024 each).
#[test]
fn requested_bytes_are_counted() {
    for (name, a) in allocators() {
        a.push_statistics_scope();
        let x = a.allocate(1000, 0).unwrap();
        let y = a.allocate(1000, 0).unwrap();
        let s = a.statistics_scope().unwrap();
        assert_eq!((s.bytes.value, s.bytes.total), (2000, 2000), "{name}");
        a.free(x).unwrap();
        a.free(y).unwrap();
        let s = a.pop_statistics_scope().unwrap();
        assert_eq!((s.bytes.value, s.bytes.peak), (0, 2000), "{name}");
    }
}

/// Issue 32, point 17: a zero-byte allocation from each of two threads counts in the totals
/// (rmm adds an allocation of 0 bytes) and its free takes it off.
#[test]
fn zero_byte_allocations_from_two_threads_are_counted() {
    for (name, a) in allocators() {
        a.push_statistics_scope();
        let handles: Vec<_> = (0..2)
            .map(|_| {
                let b = a.clone();
                std::thread::spawn(move || b.allocate(0, 0).unwrap())
            })
            .collect();
        let zs: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let s = a.statistics_scope().unwrap();
        assert_eq!(
            (s.allocations.value, s.allocations.peak, s.allocations.total),
            (2, 2, 2),
            "{name}"
        );
        assert_eq!(s.bytes.total, 0, "{name}");
        for z in zs {
            a.free(z).unwrap();
        }
        let s = a.pop_statistics_scope().unwrap();
        assert_eq!((s.allocations.value, s.allocations.total), (0, 2), "{name}");
    }
}

/// Issue 32, point 17: a `PeakScope` (the guard that "nests as rmm's statistics stack") counts
/// an allocation of 0 bytes as an allocation, as rmm does (it did not); its bytes stay block
/// sizes, as its rustdoc says (two allocations of 1,000 bytes are 2,048 there).
#[test]
fn a_peak_scope_counts_zero_byte_allocations() {
    for mode in MODES {
        let dev = Device::new(
            SimDevice::address_only(ByteSize::mib(64)),
            AllocatorConfig::parse(mode).unwrap(),
        );
        let p = dev.peak_scope();
        let z = dev.alloc::<u8>(0).unwrap();
        let x = dev.alloc::<u8>(1000).unwrap();
        let y = dev.alloc::<u8>(1000).unwrap();
        assert_eq!(p.allocations(), 3, "{mode}");
        assert_eq!(
            p.live_allocations(),
            2,
            "{mode}: nothing of 0 bytes is live"
        );
        assert_eq!(p.peak_bytes(), 2048, "{mode}: block sizes");
        drop((z, x, y));
        assert_eq!(p.current_bytes(), 0, "{mode}");
        assert_eq!(p.live_allocations(), 0, "{mode}");
    }
}

/// Two threads with their caches warm (blocks of every size they ask for parked in them before
/// the scope opens) allocate requests of odd sizes and zero bytes inside a scope, and free each
/// other's: the scope's bytes are the sum of the requests (not of the blocks), its allocations
/// count the zero-byte ones, and every free takes off exactly what its allocation added.
#[test]
fn requested_bytes_and_zero_byte_allocations_of_two_threads_with_warm_caches() {
    const SIZES: [u64; 5] = [0, 1, 1000, 3 * MIB + 7, 0];
    for (name, a) in allocators() {
        // warm every thread's cache (thread-cache mode parks these blocks per thread)
        let warm = |a: &Arc<CachingAllocator>| {
            let xs: Vec<_> = SIZES.iter().map(|&n| a.allocate(n, 0).unwrap()).collect();
            for x in xs {
                a.free(x).unwrap();
            }
        };
        warm(&a);
        let b = a.clone();
        std::thread::spawn(move || warm(&b)).join().unwrap();
        a.push_statistics_scope();
        let mine: Vec<_> = SIZES.iter().map(|&n| a.allocate(n, 0).unwrap()).collect();
        let b = a.clone();
        let theirs = std::thread::spawn(move || {
            SIZES
                .iter()
                .map(|&n| b.allocate(n, 0).unwrap())
                .collect::<Vec<_>>()
        })
        .join()
        .unwrap();
        let sum: u64 = SIZES.iter().sum();
        let s = a.statistics_scope().unwrap();
        assert_eq!(
            (s.bytes.value, s.bytes.total),
            (2 * sum as i64, 2 * sum as i64),
            "{name}: the requests' bytes"
        );
        assert_eq!(
            (s.allocations.value, s.allocations.total),
            (10, 10),
            "{name}: zero-byte allocations included"
        );
        // the allocator's own requested-bytes statistic (PyTorch's `requested_bytes`) agrees
        assert_eq!(a.stats().requested_bytes.all.current, 2 * sum, "{name}");
        // free each other's allocations
        let b = a.clone();
        std::thread::spawn(move || {
            for x in mine {
                b.free(x).unwrap();
            }
        })
        .join()
        .unwrap();
        for x in theirs {
            a.free(x).unwrap();
        }
        let s = a.pop_statistics_scope().unwrap();
        assert_eq!((s.bytes.value, s.allocations.value), (0, 0), "{name}");
        assert_eq!(
            (s.bytes.peak, s.allocations.peak),
            (2 * sum as i64, 10),
            "{name}"
        );
        assert_eq!(a.stats().requested_bytes.all.current, 0, "{name}");
    }
}
