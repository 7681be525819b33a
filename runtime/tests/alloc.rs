//! The caching allocator on the simulated device: split/merge, growable segments, OOM handling,
//! fault injection, statistics, thread safety, and random operation sequences.

use std::sync::Arc;

use oomguard_runtime::alloc::{BlockStatus, CachingAllocator};
use oomguard_runtime::backend::sim::SimDevice;
use oomguard_runtime::backend::Backend;
use oomguard_runtime::{AllocatorConfig, ByteSize, Device, Error};
use proptest::prelude::*;

const MIB: u64 = 1 << 20;

fn allocator(cap: ByteSize, cfg: &str) -> (SimDevice, CachingAllocator) {
    let sim = SimDevice::address_only(cap);
    let a = CachingAllocator::new(Arc::new(sim.clone()), AllocatorConfig::parse(cfg).unwrap());
    (sim, a)
}

const MODES: [&str; 2] = ["expandable_segments:False", "expandable_segments:True"];
/// Growable segments that move free pages before passing their high-water mark.
const TIGHT: &str = "expandable_segments:True,page_recycle_threshold:0";

#[test]
fn small_requests_share_a_segment() {
    for mode in MODES {
        let (sim, a) = allocator(ByteSize::mib(64), mode);
        let xs: Vec<_> = (0..1000).map(|_| a.allocate(1000, 0).unwrap()).collect();
        // 1000 blocks of 1 KiB fit in one 2 MiB page/segment
        assert_eq!(a.stats().reserved_bytes.all.current, 2 * MIB, "{mode}");
        assert_eq!(sim.used(), 2 * MIB);
        for x in xs {
            a.free(x).unwrap();
        }
        a.check_invariants().unwrap();
        a.empty_cache().unwrap();
        assert_eq!(a.stats().reserved_bytes.all.current, 0);
        assert_eq!(sim.used(), 0);
    }
}

/// Without splitting (one device segment per allocation, as plain cudaMalloc with PyTorch's
/// segment sizes would do) this sequence runs out of memory; with split/merge it fits.
#[test]
fn split_and_merge_avoid_oom_where_one_segment_per_allocation_fails() {
    // 8 MiB device: four small requests already take four 2 MiB segments without splitting.
    let naive = SimDevice::address_only(ByteSize::mib(8));
    let mut naive_failed = false;
    for _ in 0..5 {
        if naive.alloc_segment(2 * MIB, 0).is_err() {
            naive_failed = true;
        }
    }
    assert!(
        naive_failed,
        "one segment per allocation must run out of memory"
    );
    for mode in MODES {
        let (_, a) = allocator(ByteSize::mib(8), mode);
        let xs: Vec<_> = (0..5).map(|_| a.allocate(4096, 0).unwrap()).collect();
        assert_eq!(a.stats().reserved_bytes.all.current, 2 * MIB);
        for x in xs {
            a.free(x).unwrap();
        }
    }
    // Merging: ten 2 MiB blocks freed merge back into one 20 MiB block that serves 18 MiB.
    let (_, a) = allocator(ByteSize::mib(20), MODES[0]);
    let xs: Vec<_> = (0..9).map(|_| a.allocate(2 * MIB, 0).unwrap()).collect();
    assert_eq!(a.stats().num_device_alloc, 1, "all from one 20 MiB segment");
    for x in xs {
        a.free(x).unwrap();
    }
    let big = a.allocate(18 * MIB, 0).unwrap();
    assert_eq!(
        a.stats().num_device_alloc,
        1,
        "served from the merged cache"
    );
    assert_eq!(a.stats().num_alloc_retries, 0);
    a.free(big).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn fragmentation_oom_is_recovered_by_releasing_the_cache() {
    // Fixed segments: free 20 MiB segments cached, then a 30 MiB request on a 40 MiB device.
    let (_, a) = allocator(ByteSize::mib(40), MODES[0]);
    let x = a.allocate(5 * MIB, 0).unwrap();
    let y = a.allocate(16 * MIB, 0).unwrap();
    a.free(x).unwrap();
    a.free(y).unwrap();
    assert_eq!(a.stats().reserved_bytes.all.current, 20 * MIB + 16 * MIB);
    let z = a.allocate(30 * MIB, 0).unwrap();
    let s = a.stats();
    assert_eq!(s.num_alloc_retries, 1, "the cache was released once");
    assert_eq!(s.reserved_bytes.all.current, 30 * MIB);
    a.free(z).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn growable_segments_reuse_pages_and_unmap_holes() {
    let (sim, a) = allocator(ByteSize::mib(64), MODES[1]);
    let xs: Vec<_> = (0..8).map(|_| a.allocate(6 * MIB, 0).unwrap()).collect();
    assert_eq!(
        a.stats().reserved_bytes.all.current,
        48 * MIB,
        "no rounding to 20 MiB segments"
    );
    // free every other block: 24 MiB in 6 MiB holes
    let mut keep = Vec::new();
    for (i, x) in xs.into_iter().enumerate() {
        if i % 2 == 0 {
            a.free(x).unwrap();
        } else {
            keep.push(x);
        }
    }
    // 40 MiB cannot fit in any hole, and only 16 MiB are unmapped: it needs the holes' pages
    let big = a.allocate(40 * MIB, 0).unwrap();
    let s = a.stats();
    assert!(s.num_unmap >= 1, "holes were unmapped to make room");
    assert_eq!(
        s.num_alloc_retries, 0,
        "pages were recycled before the device said OOM"
    );
    assert_eq!(s.reserved_bytes.all.current, 64 * MIB);
    assert!(sim.used() <= 64 * MIB);
    a.check_invariants().unwrap();
    a.free(big).unwrap();
    for x in keep {
        a.free(x).unwrap();
    }
    a.empty_cache().unwrap();
    assert_eq!(sim.used(), 0);
    assert_eq!(a.stats().segment.all.current, 0, "address ranges released");
    let calls = sim.calls();
    assert_eq!(calls.reserve, calls.release);
}

/// Steps whose shapes vary: sizes shift every step so old holes rarely fit exactly, and a third
/// of each step's blocks live on into the next step, splitting the free space. Returns the peak
/// live bytes.
fn varying_steps(a: &CachingAllocator) -> u64 {
    let mut carried = Vec::new();
    let mut peak_live = 0;
    for step in 0..20u64 {
        let xs: Vec<_> = (0..10)
            .map(|i| {
                a.allocate((3 + (step * 7 + i) % 11) * MIB + 4096 * step, 0)
                    .unwrap()
            })
            .collect();
        let live: u64 = xs.iter().chain(&carried).map(|x| x.requested).sum();
        peak_live = peak_live.max(live);
        for x in carried.drain(..) {
            a.free(x).unwrap();
        }
        for (i, x) in xs.into_iter().enumerate() {
            if i % 3 == 0 {
                carried.push(x);
            } else {
                a.free(x).unwrap();
            }
        }
    }
    for x in carried {
        a.free(x).unwrap();
    }
    peak_live
}

/// Tight mode (`page_recycle_threshold:0`): with memory to spare, growable segments still move
/// free pages out of holes rather than pass their high-water mark, so reserved memory follows
/// live memory (the default maps instead: runtime/tests/growable_policy.rs).
#[test]
fn tight_mode_recycles_pages_before_a_new_high_water_mark() {
    let (_, a) = allocator(ByteSize::gib(80), TIGHT);
    let peak_live = varying_steps(&a);
    let s = a.stats();
    let ratio = s.reserved_bytes.all.peak as f64 / peak_live as f64;
    eprintln!(
        "growable: peak reserved {} vs peak live {peak_live}: {ratio}",
        s.reserved_bytes.all.peak
    );
    assert!(
        ratio < 1.10,
        "peak reserved {} vs peak live {peak_live}: {ratio}",
        s.reserved_bytes.all.peak
    );
    assert!(s.num_unmap > 0, "pages were moved out of holes");
    assert_eq!(s.num_alloc_retries, 0);
    a.check_invariants().unwrap();
    // the native allocator on the same sequence keeps whole segments and holds more
    let (_, n) = allocator(ByteSize::gib(80), MODES[0]);
    assert_eq!(varying_steps(&n), peak_live);
    let native_ratio = n.stats().reserved_bytes.all.peak as f64 / peak_live as f64;
    eprintln!("native: {native_ratio}");
    assert!(
        native_ratio > ratio,
        "native {native_ratio} vs growable {ratio}"
    );
}

#[test]
fn oom_error_explains_itself() {
    for mode in MODES {
        let dev = Device::new(
            SimDevice::address_only(ByteSize::gib(8)),
            AllocatorConfig::parse(mode).unwrap(),
        );
        let keep = dev.alloc_raw(5 << 30, 0).unwrap();
        let err = dev.alloc_raw(4 << 30, 0).unwrap_err();
        let Error::Oom(oom) = &err else {
            panic!("expected an OOM, got {err:?}")
        };
        assert_eq!(oom.requested, 4 << 30);
        assert_eq!(oom.device_total, 8 << 30);
        assert_eq!(oom.device_free, 3 << 30);
        assert_eq!(oom.allocated, 5 << 30);
        let msg = err.to_string();
        assert!(msg.contains("Tried to allocate 4.00 GiB"), "{msg}");
        assert!(
            msg.contains("total capacity of 8.00 GiB of which 3.00 GiB is free"),
            "{msg}"
        );
        assert_eq!(dev.stats().num_ooms, 1);
        assert_eq!(dev.stats().num_alloc_retries, 1);
        dev.free_raw(keep).unwrap();
        // after the failure the allocator works as before
        let ok = dev.alloc_raw(7 << 30, 0).unwrap();
        dev.free_raw(ok).unwrap();
        dev.allocator().check_invariants().unwrap();
    }
}

#[test]
fn fault_injection_fails_the_nth_request_once_and_above_a_size() {
    let sim = SimDevice::address_only(ByteSize::gib(1));
    let dev = Device::new(sim.clone(), AllocatorConfig::default());
    sim.faults().fail_nth_request(2);
    let a = dev.alloc_raw(100, 0).unwrap();
    let b = dev.alloc_raw(100, 0).unwrap();
    let e = dev.alloc_raw(100, 0).unwrap_err();
    assert!(e.is_oom(), "{e}");
    assert!(e.to_string().contains("injected fault"), "{e}");
    let c = dev.alloc_raw(100, 0).unwrap();
    sim.faults().fail_requests_above(10 * MIB);
    assert!(dev.alloc_raw(10 * MIB + 1, 0).unwrap_err().is_oom());
    let d = dev.alloc_raw(10 * MIB, 0).unwrap();
    sim.faults().clear();
    // capacity shrinks at run time: another process took memory
    for x in [a, b, c, d] {
        dev.free_raw(x).unwrap();
    }
    dev.empty_cache().unwrap();
    sim.set_capacity(ByteSize::mib(100));
    assert!(dev.alloc_raw(200 * MIB, 0).unwrap_err().is_oom());
    let ok = dev.alloc_raw(90 * MIB, 0).unwrap();
    dev.free_raw(ok).unwrap();
    dev.allocator().check_invariants().unwrap();
}

#[test]
fn double_free_and_stale_handles_are_rejected() {
    let (_, a) = allocator(ByteSize::mib(64), MODES[1]);
    let x = a.allocate(4096, 0).unwrap();
    a.free(x).unwrap();
    let e = a.free(x).unwrap_err();
    assert!(e.to_string().contains("double free"), "{e}");
    let y = a.allocate(4096, 0).unwrap(); // may reuse x's block
    assert!(
        a.free(x).is_err(),
        "a stale handle never frees the new owner's block"
    );
    a.free(y).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn huge_and_zero_sizes_do_not_panic() {
    let (_, a) = allocator(ByteSize::gib(1), MODES[1]);
    // 1 EB or more: out of memory with PyTorch's message (issue 26 point 13)
    let e = a.allocate(u64::MAX, 0).unwrap_err();
    assert!(matches!(&e, Error::Oom(_)), "{e}");
    assert!(e.to_string().contains("more than 1EB"), "{e}");
    assert!(a.allocate(u64::MAX / 2, 0).unwrap_err().is_oom());
    let z = a.allocate(0, 0).unwrap();
    assert_eq!(
        (z.ptr, z.size),
        (0, 0),
        "zero bytes allocate nothing (issue 16 point 4)"
    );
    a.free(z).unwrap();
    let dev = Device::sim(ByteSize::mib(1));
    assert!(dev.alloc::<u64>(usize::MAX).is_err());
    a.check_invariants().unwrap();
}

#[test]
fn streams_do_not_share_free_blocks_and_recorded_streams_delay_reuse() {
    let (_, a) = allocator(ByteSize::mib(64), MODES[0]);
    let x = a.allocate(4096, 1).unwrap();
    a.free(x).unwrap();
    let y = a.allocate(4096, 2).unwrap();
    assert_ne!(
        x.ptr, y.ptr,
        "a block freed on stream 1 is not handed to stream 2"
    );
    let z = a.allocate(4096, 1).unwrap();
    assert_eq!(z.ptr, x.ptr, "but is reused on its own stream");
    a.record_stream(&z, 2).unwrap();
    a.free(z).unwrap();
    let s = a.stats();
    assert_eq!(
        s.active.all.current, 2,
        "z is pending until stream 2's event completes"
    );
    a.check_invariants().unwrap();
    // the simulated device completes events at once: the next allocation processes them
    let w = a.allocate(4096, 1).unwrap();
    assert_eq!(w.ptr, x.ptr);
    a.free(w).unwrap();
    a.free(y).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn stats_track_peaks_and_reset() {
    let dev = Device::sim(ByteSize::gib(1));
    let a = dev.alloc::<u8>(3 * MIB as usize).unwrap();
    let b = dev.alloc::<u8>(1000).unwrap();
    drop(a);
    let s = dev.stats();
    assert_eq!(s.allocated_bytes.all.peak, 3 * MIB + 1024);
    assert_eq!(s.allocated_bytes.all.current, 1024);
    assert_eq!(s.allocated_bytes.small.current, 1024);
    assert_eq!(s.requested_bytes.all.current, 1000);
    assert_eq!(s.allocation.all.allocated, 2);
    assert_eq!(s.allocation.all.freed, 1);
    dev.reset_peak_stats();
    assert_eq!(dev.stats().allocated_bytes.all.peak, 1024);
    let summary = dev.memory_summary();
    assert!(summary.contains("Allocated memory"), "{summary}");
    assert!(summary.contains("Reserved memory"), "{summary}");
    assert!(summary.contains("expandable_segments:True"), "{summary}");
    drop(b);
}

/// `memory_summary` has PyTorch's rows: the counts of active and non-releasable blocks and
/// the oversize rows were missing (found by a port of PyTorch's tests), and every row is as
/// wide as the table.
#[test]
fn the_summary_has_pytorchs_rows() {
    let (_, a) = allocator(
        ByteSize::gib(1),
        "expandable_segments:False,max_split_size_mb:64",
    );
    let big = a.allocate(100 * MIB, 0).unwrap();
    let small = a.allocate(1000, 0).unwrap();
    let s = a.memory_summary();
    for row in [
        "Allocated memory",
        "Active memory",
        "Requested memory",
        "Reserved memory",
        "Non-releasable memory",
        "Allocations",
        "Active allocs",
        "Segments",
        "Non-releasable allocs",
        "Oversize allocations",
        "Oversize segments",
    ] {
        assert!(s.contains(&format!("| {row:<25} |")), "{row}: {s}");
    }
    let oversize = s
        .lines()
        .find(|l| l.contains("Oversize allocations"))
        .unwrap();
    let cells: Vec<&str> = oversize.split('|').map(str::trim).collect();
    assert_eq!(&cells[2..6], ["1", "1", "1", "0"], "{oversize}");
    let active = s.lines().find(|l| l.contains("| Active allocs")).unwrap();
    assert!(active.split('|').nth(2).unwrap().trim() == "2", "{active}");
    assert!(s.lines().all(|l| l.chars().count() == 93), "{s}");
    a.free(big).unwrap();
    a.free(small).unwrap();
}

#[test]
fn max_split_size_keeps_oversize_blocks_whole() {
    let (_, a) = allocator(
        ByteSize::gib(1),
        "expandable_segments:False,max_split_size_mb:64",
    );
    let big = a.allocate(100 * MIB, 0).unwrap();
    a.free(big).unwrap();
    // a small large-pool request must not carve up the 100 MiB oversize block
    let x = a.allocate(4 * MIB, 0).unwrap();
    let snap = a.snapshot();
    let oversize = snap.iter().find(|s| s.size == 100 * MIB).unwrap();
    assert_eq!(oversize.blocks.len(), 1);
    assert_eq!(oversize.blocks[0].status, BlockStatus::Free);
    // an oversize request within 20 MiB of it reuses it whole
    let y = a.allocate(90 * MIB, 0).unwrap();
    assert_eq!(y.size, 100 * MIB);
    assert_eq!(a.stats().oversize_allocations.current, 1);
    a.free(x).unwrap();
    a.free(y).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn device_wide_limit_caps_reserved_memory() {
    let (_, a) = allocator(ByteSize::gib(1), MODES[1]);
    a.set_memory_limit(Some(100 * MIB));
    let x = a.allocate(60 * MIB, 0).unwrap();
    let e = a.allocate(60 * MIB, 0).unwrap_err();
    assert!(e.is_oom(), "{e}");
    assert!(e.to_string().contains("limit"), "{e}");
    a.free(x).unwrap();
    let y = a.allocate(90 * MIB, 0).unwrap();
    a.free(y).unwrap();
}

#[test]
fn garbage_collection_threshold_releases_cache_before_growing() {
    let (_, a) = allocator(
        ByteSize::mib(100),
        "expandable_segments:False,garbage_collection_threshold:0.5",
    );
    let x = a.allocate(40 * MIB, 0).unwrap();
    a.free(x).unwrap();
    let y = a.allocate(45 * MIB, 0).unwrap();
    let s = a.stats();
    assert_eq!(
        s.reserved_bytes.all.current,
        46 * MIB,
        "the cached 40 MiB went back first"
    );
    assert_eq!(s.num_alloc_retries, 0, "no OOM was needed for that");
    a.free(y).unwrap();
}

#[test]
fn buffers_round_trip_data_and_drop_to_the_cache() {
    let dev = Device::sim(ByteSize::gib(2));
    let data: Vec<f32> = (0..100_000).map(|i| i as f32 * 0.5).collect();
    let buf = dev.from_slice(&data).unwrap();
    assert_eq!(buf.to_vec().unwrap(), data);
    let z = dev.zeros::<u64>(1000).unwrap();
    assert!(z.to_vec().unwrap().iter().all(|&v| v == 0));
    let mut wrong = vec![0f32; 3];
    assert!(
        buf.copy_to_slice(&mut wrong).is_err(),
        "length mismatch is an error"
    );
    drop(buf);
    drop(z);
    let s = dev.stats();
    assert_eq!(s.allocated_bytes.all.current, 0);
    assert!(s.reserved_bytes.all.current > 0, "memory stays cached");
    dev.empty_cache().unwrap();
    assert_eq!(dev.stats().reserved_bytes.all.current, 0);
}

#[test]
fn many_threads_share_one_allocator() {
    for mode in MODES {
        let dev = Device::new(
            SimDevice::new(ByteSize::gib(4)),
            AllocatorConfig::parse(mode).unwrap(),
        );
        std::thread::scope(|s| {
            for t in 0..8u64 {
                let dev = dev.clone();
                s.spawn(move || {
                    let mut live = Vec::new();
                    for i in 0..2000u64 {
                        let n = ((i * 7919 + t * 104729) % 5000 + 1) as usize;
                        let mut b = dev.alloc::<u64>(n).unwrap();
                        b.copy_from_slice(&vec![t * 1_000_000 + i; n]).unwrap();
                        live.push((t * 1_000_000 + i, b));
                        if live.len() > 16 {
                            let (tag, b) = live.swap_remove((i % 16) as usize);
                            assert!(b.to_vec().unwrap().iter().all(|&v| v == tag), "data intact");
                        }
                    }
                });
            }
        });
        dev.allocator().check_invariants().unwrap();
        assert_eq!(dev.stats().allocated_bytes.all.current, 0);
        dev.empty_cache().unwrap();
        assert_eq!(dev.stats().reserved_bytes.all.current, 0);
    }
}

#[derive(Clone, Debug)]
enum Op {
    Alloc(u64, u64),
    Free(usize),
    EmptyCache,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (prop_oneof![1u64..4096, 4096u64..(2 << 20), (2u64 << 20)..(48 << 20)], 0u64..2)
            .prop_map(|(s, st)| Op::Alloc(s, st)),
        5 => any::<usize>().prop_map(Op::Free),
        1 => Just(Op::EmptyCache),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// Random alloc/free/empty_cache: no two live blocks overlap, stats equal a recount, and
    /// after freeing everything and emptying the cache nothing is reserved.
    #[test]
    fn random_sequences_keep_invariants(ops in prop::collection::vec(op(), 1..120), mode in 0usize..2) {
        let (sim, a) = allocator(ByteSize::mib(256), MODES[mode]);
        let mut live: Vec<oomguard_runtime::Allocation> = Vec::new();
        for op in ops {
            match op {
                Op::Alloc(s, st) => match a.allocate(s, st) {
                    Ok(x) => {
                        prop_assert!(x.size >= s);
                        for y in &live {
                            prop_assert!(x.ptr + x.size <= y.ptr || y.ptr + y.size <= x.ptr, "overlap");
                        }
                        live.push(x);
                    }
                    Err(e) => prop_assert!(e.is_oom(), "{e}"),
                },
                Op::Free(i) if !live.is_empty() => {
                    let x = live.swap_remove(i % live.len());
                    a.free(x).unwrap();
                }
                Op::Free(_) => {}
                Op::EmptyCache => a.empty_cache().unwrap(),
            }
            if let Err(e) = a.check_invariants() {
                return Err(TestCaseError::fail(e));
            }
            let s = a.stats();
            prop_assert_eq!(s.allocated_bytes.all.current, live.iter().map(|x| x.size).sum::<u64>());
            prop_assert_eq!(s.reserved_bytes.all.current, sim.used());
        }
        for x in live.drain(..) {
            a.free(x).unwrap();
        }
        a.empty_cache().unwrap();
        prop_assert_eq!(a.stats().reserved_bytes.all.current, 0);
        prop_assert_eq!(sim.used(), 0);
        a.check_invariants().map_err(TestCaseError::fail)?;
    }
}

/// Found by the retry engine's tests: with growable segments and max_split_size, a refused
/// oversize free block made the allocator map 0 bytes.
#[test]
fn growable_segments_with_max_split_size_never_map_nothing() {
    let dev = Device::new(
        SimDevice::new(ByteSize::mib(256)),
        AllocatorConfig::parse("max_split_size_mb:64").unwrap(),
    );
    drop(dev.alloc::<u8>(100 << 20).unwrap());
    drop(dev.alloc::<u8>(200 << 20).unwrap());
    drop(dev.alloc::<u8>(100 << 20).unwrap());
    let small = dev.alloc::<u8>(10 << 20).unwrap();
    dev.allocator().check_invariants().unwrap();
    drop(small);
}

/// `backend:cudaMallocAsync`: no caching; every allocation is its own device segment of the
/// rounded size and goes back to the device when freed.
#[test]
fn pass_through_backend_caches_nothing() {
    let (sim, a) = allocator(ByteSize::gib(1), "backend:cudaMallocAsync");
    assert!(!a.uses_growable_segments());
    let xs: Vec<_> = (1..20u64)
        .map(|i| a.allocate(i * 1000, 0).unwrap())
        .collect();
    let live: u64 = xs.iter().map(|x| x.size).sum();
    assert_eq!(a.stats().reserved_bytes.all.current, live);
    assert_eq!(sim.used(), live);
    assert_eq!(sim.calls().alloc_segment, 19);
    for x in xs {
        a.free(x).unwrap();
    }
    assert_eq!(sim.used(), 0, "freed straight back");
    assert_eq!(sim.calls().free_segment, 19);
    a.check_invariants().unwrap();
    assert!(a.allocate(2 << 30, 0).unwrap_err().is_oom());
}

/// `page_recycle_threshold`: below that share of the device growable segments map new pages
/// instead of moving free ones, so the same steps make no unmap and no synchronisation and
/// hold more than tight mode (0); the memory limit, when lower, bounds the share.
#[test]
fn page_recycle_threshold_maps_instead_of_moving_below_it() {
    let (_, tight) = allocator(ByteSize::gib(1), TIGHT);
    let peak_live = varying_steps(&tight);
    let t = tight.stats();
    assert!(t.num_unmap > 0 && t.num_stream_syncs > 0, "{t:?}");

    let (_, loose) = allocator(
        ByteSize::gib(1),
        "expandable_segments:True,page_recycle_threshold:0.5",
    );
    assert_eq!(varying_steps(&loose), peak_live);
    let l = loose.stats();
    eprintln!(
        "peak live {peak_live}: default reserved {} ({} unmaps), threshold 0.5 reserved {} ({} unmaps)",
        t.reserved_bytes.all.peak, t.num_unmap, l.reserved_bytes.all.peak, l.num_unmap
    );
    assert_eq!((l.num_unmap, l.num_stream_syncs), (0, 0), "{l:?}");
    assert!(l.reserved_bytes.all.peak > t.reserved_bytes.all.peak);
    assert!(l.reserved_bytes.all.peak <= 512 * MIB);
    assert!(loose
        .config()
        .to_string()
        .contains("page_recycle_threshold:0.5"));
    loose.check_invariants().unwrap();

    // a memory limit below the threshold's share: pages are moved again at the limit, and
    // every allocation is still served
    let (_, capped) = allocator(
        ByteSize::gib(1),
        "expandable_segments:True,page_recycle_threshold:1",
    );
    // between what tight mode and the default (with room) reserve on these steps
    let (_, roomy) = allocator(ByteSize::gib(1), "expandable_segments:True");
    assert_eq!(varying_steps(&roomy), peak_live);
    let room_peak = roomy.stats().reserved_bytes.all.peak;
    assert!(room_peak > t.reserved_bytes.all.peak, "{room_peak}");
    let limit = (t.reserved_bytes.all.peak + room_peak) / 2;
    capped.set_memory_limit(Some(limit));
    assert_eq!(varying_steps(&capped), peak_live);
    let c = capped.stats();
    assert!(c.reserved_bytes.all.peak <= limit, "{c:?}");
    assert!(c.num_unmap > 0, "{c:?}");
    assert_eq!(c.num_ooms, 0);
    capped.check_invariants().unwrap();
}

/// The large block freed last waits at its exact size (a repeated alloc+free pair takes it back
/// at once), and is merged before any other large request looks for a free block: best fit
/// sees the space it would see had it been merged at the free, and so do the statistics and
/// the snapshot. In both segment kinds.
#[test]
fn the_large_block_freed_last_is_reused_at_once_and_merged_before_anything_else() {
    const MIB: u64 = 1 << 20;
    // (fixed segments: two large blocks share a 20 MiB segment below 10 MiB, as in PyTorch)
    for (cfg, size) in [
        ("expandable_segments:True", 64 * MIB),
        ("expandable_segments:False", 4 * MIB),
    ] {
        let (_sim, a) = allocator(ByteSize::gib(1), cfg);
        let x = a.allocate(size, 0).unwrap();
        let y = a.allocate(size, 0).unwrap();
        let (x_ptr, y_ptr) = (x.ptr, y.ptr);
        assert_eq!(y_ptr, x_ptr + size, "{cfg}: adjacent");
        a.free(y).unwrap();
        // the pair: the same block again
        let y = a.allocate(size, 0).unwrap();
        assert_eq!(y.ptr, y_ptr, "{cfg}");
        a.free(y).unwrap();
        a.free(x).unwrap();
        // seen merged: one free block of both where x and y were
        assert!(a.stats().largest_free_block >= 2 * size, "{cfg}");
        let free_at_x = a
            .snapshot()
            .iter()
            .flat_map(|s| s.blocks.clone())
            .find(|b| b.addr == x_ptr)
            .unwrap();
        assert_eq!(free_at_x.status, BlockStatus::Free, "{cfg}");
        assert!(free_at_x.size >= 2 * size, "{cfg}: {free_at_x:?}");
        let reserved = a.stats().reserved_bytes.all.current;
        // a request that needs both: served where they were, nothing new reserved
        let z = a.allocate(2 * size, 0).unwrap();
        assert_eq!(z.ptr, x_ptr, "{cfg}");
        assert_eq!(a.stats().reserved_bytes.all.current, reserved, "{cfg}");
        a.free(z).unwrap();
        a.check_invariants().unwrap();
    }
}
