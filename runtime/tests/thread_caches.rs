//! Thread caches (multi-thread mode): frees on other threads, budgets and leak checks open,
//! statistics equal to a recount at quiescent points, cached memory released before any
//! out-of-memory, caches of exited threads collected, history and statistics scopes exact.

use std::sync::{Arc, Barrier};

use oomguard_runtime::backend::sim::SimDevice;
use oomguard_runtime::{AllocatorConfig, ByteSize, CachingAllocator, Device, DeviceBuffer};

fn xorshift(seed: u64) -> impl FnMut() -> u64 {
    let mut s = seed | 1;
    move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    }
}

/// Eight threads in rounds: each allocates inside its own leak check and budget, hands every
/// buffer to the next thread, frees what it was handed; the leak checks then find nothing, the
/// budgets are back to zero, and (thread 0, all others waiting) the statistics equal a recount.
#[test]
fn frees_on_other_threads_under_budgets_and_leak_checks() {
    const THREADS: usize = 8;
    for cfg in [AllocatorConfig::default(), AllocatorConfig::native()] {
        let sim = SimDevice::new(ByteSize::gib(4));
        let dev = Device::new(sim.clone(), cfg);
        let wide = dev.device_budget(ByteSize::gib(3));
        let wide_leaks = dev.leak_check();
        let barrier = Barrier::new(THREADS);
        let (txs, rxs): (Vec<_>, Vec<_>) = (0..THREADS)
            .map(|_| std::sync::mpsc::channel::<DeviceBuffer<u8>>())
            .unzip();
        std::thread::scope(|s| {
            for (t, rx) in rxs.into_iter().enumerate() {
                let (dev, barrier) = (dev.clone(), &barrier);
                let to_next = txs[(t + 1) % THREADS].clone();
                s.spawn(move || {
                    let mut next = xorshift(0x5151 ^ (t as u64) << 24);
                    for round in 0..40 {
                        let budget = dev.thread_budget(ByteSize::mib(64));
                        let leaks = dev.leak_check();
                        let mut kept = Vec::new();
                        for k in 0..16 {
                            let r = next();
                            let len = match r % 4 {
                                0 => 512,
                                1 => (r >> 8) % 4096 + 1,
                                2 => (r >> 8) % (1 << 20) + 1,
                                _ => (r >> 8) % (3 << 20) + 1,
                            } as usize;
                            let b = dev.alloc::<u8>(len).unwrap();
                            if k % 2 == 0 {
                                to_next.send(b).unwrap();
                            } else {
                                kept.push(b);
                            }
                        }
                        assert!(budget.used() > 0 && budget.used() <= 64 << 20);
                        drop(kept);
                        barrier.wait(); // everything of this round is sent
                        for b in rx.try_iter() {
                            drop(b); // a buffer another thread allocated, freed here
                        }
                        barrier.wait(); // everything of this round is freed
                        assert_eq!(budget.used(), 0, "thread {t}, round {round}");
                        let report = leaks.finish();
                        assert!(report.is_ok(), "thread {t}, round {round}: {report:?}");
                        drop(budget);
                        if t == 0 {
                            dev.allocator().check_invariants().unwrap();
                            let s = dev.stats();
                            assert_eq!(s.allocated_bytes.all.current, 0, "round {round}");
                            assert_eq!(s.allocation.all.current, 0);
                            assert_eq!(s.requested_bytes.all.current, 0);
                            assert_eq!(s.active_bytes.all.current, 0);
                            assert_eq!(
                                s.allocation.all.allocated, s.allocation.all.freed,
                                "round {round}"
                            );
                            assert_eq!(s.allocation.all.allocated, (round + 1) * 16 * 8);
                        }
                        barrier.wait(); // checked
                    }
                });
            }
        });
        assert_eq!(wide.used(), 0);
        assert!(wide_leaks.finish().is_ok());
        dev.allocator().check_invariants().unwrap();
        dev.empty_cache().unwrap();
        dev.allocator().check_invariants().unwrap();
        assert_eq!(dev.stats().reserved_bytes.all.current, 0);
        assert_eq!(sim.used(), 0);
    }
}

/// Memory that one thread's cache holds serves another thread rather than fail it.
#[test]
fn a_threads_cache_never_causes_an_oom() {
    for cfg in [AllocatorConfig::default(), AllocatorConfig::native()] {
        let sim = SimDevice::new(ByteSize::mib(64));
        let a = Arc::new(CachingAllocator::new(Arc::new(sim.clone()), cfg));
        // the first thread makes the allocator multi-threaded; then each thread fills the
        // device with 512 KiB blocks and frees them (cached in its own cache)
        let fill = |a: &CachingAllocator| {
            let mut v = Vec::new();
            while let Ok(x) = a.allocate(512 << 10, 0) {
                v.push(x);
            }
            let n = v.len();
            for x in v {
                a.free(x).unwrap();
            }
            n
        };
        let first = std::thread::scope(|s| s.spawn(|| fill(&a)).join().unwrap());
        // another thread, while the first thread's blocks may sit in its cache: (exited threads'
        // caches are collected, so keep a live thread holding a cache as well)
        let (tx, rx) = std::sync::mpsc::channel();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        std::thread::scope(|s| {
            // owned here: dropped when an assertion below fails, so the thread never waits on
            // it forever
            let go_tx = go_tx;
            let a2 = &a;
            s.spawn(move || {
                let x = a2.allocate(512 << 10, 0).unwrap();
                a2.free(x).unwrap(); // cached here, the thread stays alive
                tx.send(()).unwrap();
                go_rx.recv().unwrap();
            });
            rx.recv().unwrap();
            let big = a.allocate(48 << 20, 0);
            assert!(
                big.is_ok(),
                "48 MiB of a 64 MiB device with nothing allocated: {:?}",
                big.err()
            );
            a.free(big.unwrap()).unwrap();
            assert_eq!(fill(&a), first, "the same number of blocks fit");
            go_tx.send(()).unwrap();
        });
        a.check_invariants().unwrap();
        a.empty_cache().unwrap();
        assert_eq!(sim.used(), 0);
    }
}

/// Blocks cached by threads that exited are collected: nothing is lost, `empty_cache` gives
/// everything back.
#[test]
fn caches_of_exited_threads_are_collected() {
    let sim = SimDevice::new(ByteSize::gib(1));
    let a = Arc::new(CachingAllocator::new(
        Arc::new(sim.clone()),
        AllocatorConfig::default(),
    ));
    let held = a.allocate(1 << 20, 0).unwrap(); // the main thread's own
    for round in 0..20u64 {
        let leftover = std::thread::scope(|s| {
            s.spawn(|| {
                let xs: Vec<_> = (0..10)
                    .map(|k| a.allocate(4096 * (k + 1), 0).unwrap())
                    .collect();
                let mut xs = xs.into_iter();
                let keep = xs.next().unwrap();
                for x in xs {
                    a.free(x).unwrap();
                }
                keep // outlives its thread
            })
            .join()
            .unwrap()
        });
        a.check_invariants().unwrap();
        a.free(leftover).unwrap(); // freed on another thread than its cache's, which exited
        a.check_invariants().unwrap();
        let s = a.stats();
        assert_eq!(s.allocation.all.current, 1, "round {round}");
    }
    a.free(held).unwrap();
    a.empty_cache().unwrap();
    a.check_invariants().unwrap();
    assert_eq!(a.stats().reserved_bytes.all.current, 0);
    assert_eq!(sim.used(), 0);
}

/// History and statistics scopes stop the caches: every allocation and free after they start is
/// recorded and counted, also frees of blocks a cache handed out before.
#[test]
fn history_and_statistics_scopes_see_every_event_in_multi_thread_mode() {
    use oomguard_runtime::alloc::TraceAction;
    let sim = SimDevice::new(ByteSize::gib(1));
    let a = Arc::new(CachingAllocator::new(
        Arc::new(sim.clone()),
        AllocatorConfig::default(),
    ));
    let first = a.allocate(4096, 0).unwrap();
    let from_cache = std::thread::scope(|s| {
        s.spawn(|| {
            let x = a.allocate(4096, 0).unwrap();
            a.free(x).unwrap();
            a.allocate(4096, 0).unwrap() // from that thread's cache
        })
        .join()
        .unwrap()
    });
    a.record_history(100, false);
    a.push_statistics_scope();
    std::thread::scope(|s| {
        s.spawn(|| {
            a.free(from_cache).unwrap();
            let x = a.allocate(8192, 0).unwrap();
            a.free(x).unwrap();
        });
    });
    let scope = a.pop_statistics_scope().unwrap();
    assert_eq!(scope.allocations.total, 1);
    assert_eq!(scope.allocations.value, -1, "one allocation in, two frees");
    let h = a.history();
    let count = |act| h.iter().filter(|e| e.action == act).count();
    assert_eq!(count(TraceAction::Alloc), 1, "{h:?}");
    assert_eq!(count(TraceAction::FreeRequested), 2, "{h:?}");
    a.free(first).unwrap();
    a.check_invariants().unwrap();
    assert_eq!(a.stats().allocation.all.current, 0);
}

/// Peaks in multi-thread mode: never below the true peak; exact while one thread allocates
/// between two reads of the statistics.
#[test]
fn peaks_are_upper_bounds_and_exact_for_one_thread_between_reads() {
    let sim = SimDevice::new(ByteSize::gib(1));
    let a = Arc::new(CachingAllocator::new(
        Arc::new(sim.clone()),
        AllocatorConfig::default(),
    ));
    let base = a.allocate(1 << 20, 0).unwrap(); // 1 MiB, main thread
    let run = |n: u64| {
        std::thread::scope(|s| {
            s.spawn(|| {
                let xs: Vec<_> = (0..n).map(|_| a.allocate(1 << 20, 0).unwrap()).collect();
                for x in xs {
                    a.free(x).unwrap();
                }
                // again, from this thread's cache
                let xs: Vec<_> = (0..n).map(|_| a.allocate(1 << 20, 0).unwrap()).collect();
                for x in xs {
                    a.free(x).unwrap();
                }
            });
        })
    };
    run(5);
    let s = a.stats();
    assert_eq!(s.allocated_bytes.all.peak, 6 << 20, "1 + 5 MiB");
    assert_eq!(s.allocated_bytes.all.current, 1 << 20);
    run(3);
    assert_eq!(
        a.stats().allocated_bytes.all.peak,
        6 << 20,
        "below the old peak"
    );
    a.reset_peak_stats();
    run(3);
    assert_eq!(
        a.stats().allocated_bytes.all.peak,
        4 << 20,
        "1 + 3 MiB after the reset"
    );
    // two threads holding memory at the same time: the peak is at least their sum
    let barrier = Barrier::new(2);
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                let xs: Vec<_> = (0..4).map(|_| a.allocate(1 << 20, 0).unwrap()).collect();
                barrier.wait();
                for x in xs {
                    a.free(x).unwrap();
                }
            });
        }
    });
    let s = a.stats();
    assert!(
        s.allocated_bytes.all.peak >= 9 << 20,
        "{}",
        s.allocated_bytes.all.peak
    );
    a.free(base).unwrap();
    a.check_invariants().unwrap();
}

/// Handles stay exact across threads: a double free, a free of a lent-out copy and a foreign
/// handle are errors whatever cache handed the block out.
#[test]
fn bad_frees_of_cache_handles_are_errors() {
    let sim = SimDevice::new(ByteSize::gib(1));
    let a = Arc::new(CachingAllocator::new(
        Arc::new(sim.clone()),
        AllocatorConfig::default(),
    ));
    let other = CachingAllocator::new(Arc::new(sim.clone()), AllocatorConfig::default());
    let _ = a.allocate(512, 0).map(|x| a.free(x));
    let x = std::thread::scope(|s| s.spawn(|| a.allocate(4096, 0).unwrap()).join().unwrap());
    assert!(other.free(x).is_err(), "another allocator's handle");
    a.record_stream(&x, 2).unwrap();
    a.free(x).unwrap();
    let e = a.free(x).unwrap_err();
    assert!(e.to_string().contains("double free"), "{e}");
    let e = a.record_stream(&x, 2).unwrap_err();
    assert!(e.to_string().contains("not a live allocation"), "{e}");
    a.empty_cache().unwrap();
    a.check_invariants().unwrap();
    assert_eq!(sim.used(), 0);
}

/// `reserve_initial` in multi-thread mode: the reserved block is in the shared pool, where
/// another thread's request splits it (no new memory from the device).
#[test]
fn an_initial_reservation_serves_every_thread() {
    let sim = SimDevice::new(ByteSize::gib(1));
    let a = Arc::new(CachingAllocator::new(
        Arc::new(sim.clone()),
        AllocatorConfig::default(),
    ));
    let x = a.allocate(512, 0).unwrap();
    std::thread::scope(|s| {
        s.spawn(|| a.free(x).unwrap()); // a second thread: multi-thread mode from now on
    });
    let y = std::thread::scope(|s| s.spawn(|| a.allocate(4096, 0).unwrap()).join().unwrap());
    a.free(y).unwrap();
    a.reserve_initial(256 << 20).unwrap();
    let reserved = a.stats().reserved_bytes.all.current;
    let z = std::thread::scope(|s| {
        s.spawn(|| a.allocate(100 << 20, 0).unwrap())
            .join()
            .unwrap()
    });
    assert_eq!(
        a.stats().reserved_bytes.all.current,
        reserved,
        "the 100 MiB request was carved from the reservation"
    );
    a.free(z).unwrap();
    a.check_invariants().unwrap();
}

/// Issue 26 point 6: `backend:cudaMallocAsync` stays a pass-through once a second thread
/// allocates: each allocation is its own device segment of its rounded size, nothing is
/// sub-allocated and nothing stays cached (it used to sub-allocate inside 2/20 MiB segments and
/// keep them: 1000 B + 3 MiB left 22 MiB reserved).
#[test]
fn pass_through_stays_a_pass_through_on_two_threads() {
    for cfg in [
        "backend:cudaMallocAsync",
        "backend:cudaMallocAsync,expandable_segments:False",
    ] {
        let sim = SimDevice::new(ByteSize::gib(1));
        let a = CachingAllocator::new(Arc::new(sim.clone()), AllocatorConfig::parse(cfg).unwrap());
        let barrier = Barrier::new(2);
        let (small, large) = std::thread::scope(|s| {
            let t1 = s.spawn(|| {
                let x = a.allocate(1000, 0).unwrap();
                barrier.wait();
                x
            });
            let t2 = s.spawn(|| {
                let x = a.allocate(3 << 20, 0).unwrap();
                barrier.wait();
                x
            });
            (t1.join().unwrap(), t2.join().unwrap())
        });
        let live = 1024 + (3 << 20);
        let s = a.stats();
        assert_eq!(s.reserved_bytes.all.current, live, "{cfg}: reserved = live");
        assert_eq!(s.segment.all.current, 2, "{cfg}: one segment each");
        assert_eq!(sim.used(), live, "{cfg}: device");
        // a third thread frees one, allocates again, frees again: only live bytes stay
        std::thread::scope(|s| {
            s.spawn(|| {
                a.free(large).unwrap();
                let y = a.allocate(2000, 0).unwrap();
                assert_eq!(a.stats().reserved_bytes.all.current, 1024 + 2048, "{cfg}");
                a.free(y).unwrap();
            });
        });
        assert_eq!(
            a.stats().reserved_bytes.all.current,
            1024,
            "{cfg}: after frees"
        );
        assert_eq!(sim.used(), 1024, "{cfg}: device after frees");
        a.free(small).unwrap();
        let s = a.stats();
        assert_eq!(s.reserved_bytes.all.current, 0, "{cfg}");
        assert_eq!(
            s.num_device_alloc, 3,
            "{cfg}: one device allocation per request"
        );
        assert_eq!(sim.used(), 0, "{cfg}");
        a.check_invariants().unwrap();
    }
}

/// A thread parks the one large block it allocated and freed last (an alloc+free pair then
/// takes no shared lock), but before any large block is placed at the shared state every
/// parked one is merged back: another thread's request sees the free space it would see
/// without parking (here: the same address, no new page), and a step mark stops parking.
#[test]
fn a_parked_large_block_is_merged_before_any_large_placement() {
    const MIB: u64 = 1 << 20;
    let sim = SimDevice::new(ByteSize::gib(4));
    let a = Arc::new(CachingAllocator::new(
        Arc::new(sim),
        AllocatorConfig::parse("expandable_segments:True").unwrap(),
    ));
    // a second thread makes the allocator multi-thread (thread caches)
    let other = Arc::clone(&a);
    std::thread::spawn(move || other.free(other.allocate(512, 0).unwrap()).unwrap())
        .join()
        .unwrap();
    // the pair on this thread: the block is parked in this thread's cache
    let x = a.allocate(64 * MIB, 0).unwrap();
    let at = x.ptr;
    a.free(x).unwrap();
    let x = a.allocate(64 * MIB, 0).unwrap();
    assert_eq!(x.ptr, at, "served again from this thread's cache");
    a.free(x).unwrap();
    let reserved = a.stats().reserved_bytes.large.current;
    // another thread's larger request: placed after the parked block is merged, in its space
    let other = Arc::clone(&a);
    let got = std::thread::spawn(move || {
        let y = other.allocate(96 * MIB, 0).unwrap();
        let p = y.ptr;
        other.free(y).unwrap();
        p
    })
    .join()
    .unwrap();
    assert_eq!(got, at, "the parked block's space served the other thread");
    assert_eq!(
        a.stats().reserved_bytes.large.current,
        reserved.max(96 * MIB),
        "only the 32 MiB the larger request lacked were mapped"
    );
    a.check_invariants().unwrap();
    // after a step mark nothing large is parked: a pair's free merges at once
    a.mark_step();
    let x = a.allocate(64 * MIB, 0).unwrap();
    a.free(x).unwrap();
    let snap = a.snapshot();
    let free_large: usize = snap
        .iter()
        .flat_map(|s| &s.blocks)
        .filter(|b| b.size >= 64 * MIB && b.status == oomguard_runtime::alloc::BlockStatus::Free)
        .count();
    assert_eq!(free_large, 1, "one merged free block: {snap:?}");
    a.check_invariants().unwrap();
}
