//! Conformance and soundness of the allocator against what PyTorch's caching allocator and RMM's
//! resources do, and against misuse of handles and absurd inputs (issue 16). Each test names the
//! point of the issue it covers.

use std::future::Future;
use std::sync::Arc;

use oomguard_runtime::alloc::{BlockStatus, CachingAllocator, TraceAction};
use oomguard_runtime::backend::sim::{SimDevice, SIM_GRANULARITY};
use oomguard_runtime::backend::Backend;
use oomguard_runtime::{AllocatorConfig, ByteSize, Device, Error};

const MIB: u64 = 1 << 20;
const MODES: [&str; 2] = ["expandable_segments:False", "expandable_segments:True"];

fn allocator(cap: ByteSize, cfg: &str) -> (SimDevice, CachingAllocator) {
    let sim = SimDevice::address_only(cap);
    let a = CachingAllocator::new(Arc::new(sim.clone()), AllocatorConfig::parse(cfg).unwrap());
    (sim, a)
}

fn device(cap: ByteSize, cfg: &str) -> Device {
    Device::new(SimDevice::new(cap), AllocatorConfig::parse(cfg).unwrap())
}

// ---- point 1: stale and foreign handles ----

/// A handle kept after its buffer was dropped must not free the block that now sits at the same
/// address after a merge and a split reused its arena slot (it used to: generations restarted at
/// 0 for new blocks, and the next allocation aliased the live buffer).
#[test]
fn p1_stale_handle_after_merge_and_split_is_rejected() {
    for mode in MODES {
        let dev = device(ByteSize::mib(64), mode);
        let a0 = dev.alloc::<u8>(1000).unwrap();
        let x = dev.alloc::<u8>(1000).unwrap();
        let _y = dev.alloc::<u8>(1000).unwrap();
        let stale = *x.allocation();
        drop(a0);
        drop(x);
        dev.empty_cache().unwrap(); // merges a0 and x: x's slot is vacant
        let _p = dev.alloc::<u8>(1000).unwrap();
        let z = dev.from_slice(&[7u8; 1000]).unwrap();
        // The scenario: the live buffer now sits where the stale handle points.
        assert_eq!(z.device_ptr(), stale.ptr, "{mode}: scenario not reproduced");
        let e = dev.free_raw(stale).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{mode}: {e}");
        let w = dev.from_slice(&[9u8; 1000]).unwrap();
        assert_ne!(w.device_ptr(), z.device_ptr(), "{mode}: aliased");
        assert_eq!(z.to_vec().unwrap(), vec![7u8; 1000], "{mode}");
        dev.allocator().check_invariants().unwrap();
    }
}

/// Random alloc/free churn, trying every stale handle after each step: none is ever accepted.
#[test]
fn p1_no_stale_handle_is_ever_accepted_under_churn() {
    for mode in MODES {
        let (_, a) = allocator(ByteSize::mib(256), mode);
        let mut live = Vec::new();
        let mut stale = Vec::new();
        let mut rng = 0x2545F4914F6CDD1Du64;
        for step in 0..3000 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            if (rng % 3 != 0 && live.len() < 40) || live.is_empty() {
                let size = [512, 1000, 1024, 3000, 2 * MIB, 5 * MIB][(rng >> 8) as usize % 6];
                live.push(a.allocate(size, 0).unwrap());
            } else {
                let x = live.swap_remove((rng >> 8) as usize % live.len());
                a.free(x).unwrap();
                stale.push(x);
            }
            if step % 97 == 0 {
                a.empty_cache().unwrap();
            }
            for s in &stale {
                assert!(
                    a.free(*s).is_err(),
                    "{mode}: stale handle accepted at {step}"
                );
            }
            stale.truncate(64);
        }
        a.check_invariants().unwrap();
    }
}

/// A handle from another allocator is rejected, even when its address and block index match a
/// live block here (every simulated device starts at the same address).
#[test]
fn p1_foreign_handle_is_rejected() {
    for mode in MODES {
        let d1 = device(ByteSize::mib(64), mode);
        let d2 = device(ByteSize::mib(64), mode);
        let x1 = d1.alloc::<u8>(4096).unwrap();
        let x2 = d2.from_slice(&[5u8; 4096]).unwrap();
        assert_eq!(x1.device_ptr(), x2.device_ptr(), "same address on both");
        let foreign = *x1.allocation();
        assert!(d2.free_raw(foreign).is_err(), "{mode}");
        assert!(d2.allocator().free(foreign).is_err(), "{mode}");
        assert!(d2.allocator().record_stream(&foreign, 1).is_err(), "{mode}");
        let again = d2.alloc::<u8>(4096).unwrap();
        assert_ne!(again.device_ptr(), x2.device_ptr());
        assert_eq!(x2.to_vec().unwrap(), vec![5u8; 4096]);
    }
}

/// The handle a live buffer lends out (`*buf.allocation()`) cannot free the buffer's memory
/// behind its back; the buffer frees it on drop.
#[test]
fn p1_borrowed_handle_of_a_live_buffer_cannot_free_it() {
    let dev = device(ByteSize::mib(64), MODES[1]);
    let buf = dev.from_slice(&[3u8; 4096]).unwrap();
    let copy = *buf.allocation();
    let e = dev.free_raw(copy).unwrap_err();
    assert!(e.to_string().contains("DeviceBuffer"), "{e}");
    assert!(dev.allocator().free(copy).is_err());
    let other = dev.alloc::<u8>(4096).unwrap();
    assert_ne!(other.device_ptr(), buf.device_ptr());
    // record_stream through the borrowed handle is fine (it frees nothing)
    dev.allocator().record_stream(&copy, 1).unwrap();
    drop(buf);
    assert_eq!(dev.stats().allocated_bytes.all.current, 4096);
    drop(other);
    assert_eq!(dev.stats().allocated_bytes.all.current, 0);
    dev.allocator().check_invariants().unwrap();
}

// ---- point 16: absurd values are errors, never panics ----

#[test]
fn p16_huge_roundup_divisions_do_not_panic() {
    for v in [1u64 << 62, 1 << 63] {
        for mode in MODES {
            let cfg = format!("{mode},roundup_power2_divisions:{v}");
            match AllocatorConfig::parse(&cfg) {
                Err(e) => assert!(e.to_string().contains("roundup_power2_divisions"), "{e}"),
                Ok(c) => {
                    let a = CachingAllocator::new(
                        Arc::new(SimDevice::address_only(ByteSize::gib(1))),
                        c,
                    );
                    for size in [1, 513, 3 * MIB, 1 << 40, u64::MAX / 3] {
                        let _ = a.allocate(size, 0).map(|x| a.free(x).unwrap());
                    }
                    a.check_invariants().unwrap();
                }
            }
        }
    }
}

#[test]
fn p16_requests_near_2_pow_64_are_errors() {
    for mode in MODES {
        let (_, a) = allocator(ByteSize::gib(1), mode);
        for size in [
            u64::MAX,
            u64::MAX - 511,
            u64::MAX - MIB,
            u64::MAX - 2 * MIB + 1,
            u64::MAX - 3 * MIB,
            u64::MAX / 2 + 1,
        ] {
            let e = a.allocate(size, 0).unwrap_err();
            assert!(
                e.is_oom() || matches!(e, Error::InvalidArgument(_)),
                "{mode} {size}: {e}"
            );
        }
        a.check_invariants().unwrap();
    }
}

#[test]
fn p16_sim_map_with_an_overflowing_range_is_an_error() {
    let sim = SimDevice::new(ByteSize::gib(1));
    let base = sim.reserve(64 * MIB).unwrap();
    let g = SIM_GRANULARITY;
    assert!(sim.map(base, u64::MAX / g * g).is_err());
    assert!(sim.map(u64::MAX / g * g, g).is_err());
    assert!(sim.unmap(u64::MAX / g * g, 2 * g).is_err());
    assert!(sim.release(u64::MAX / g * g, 2 * g).is_err());
    assert!(sim.reserve(u64::MAX / g * g).is_err());
    assert!(sim.alloc_segment(u64::MAX / 512 * 512, 0).is_err());
    sim.map(base, g).unwrap();
    assert_eq!(sim.used(), g);
}

#[test]
fn p16_byte_size_constructors_and_parser_never_overflow() {
    // saturating constructors (const, infallible) and checked ones
    assert_eq!(ByteSize::gib(1 << 34), ByteSize(u64::MAX));
    assert_eq!(ByteSize::mib(u64::MAX), ByteSize(u64::MAX));
    assert_eq!(ByteSize::kib(u64::MAX), ByteSize(u64::MAX));
    assert!(ByteSize::checked_gib(1 << 34).is_err());
    assert_eq!(ByteSize::checked_gib(3).unwrap(), ByteSize::gib(3));
    assert!(ByteSize::checked_mib(1 << 44).is_err());
    assert!(ByteSize::checked_kib(1 << 54).is_err());
    // sizes above 2^64 - 1 are errors, not silently u64::MAX
    for s in [
        "16777216.5 TiB",
        "16777216.01 TiB",
        "16777216 TiB",
        "18446744073709551616",
        "18446744073709551616.0",
        "18446744073709.551616 MB",
    ] {
        let e = s.parse::<ByteSize>().unwrap_err();
        assert!(e.reason.contains("too large"), "{s}: {e}");
    }
    assert_eq!(
        "18446744073709551615".parse::<ByteSize>().unwrap(),
        ByteSize(u64::MAX)
    );
    // the largest values still print in a form that parses back
    for n in [u64::MAX, u64::MAX - 1, u64::MAX - (1 << 30)] {
        let back: ByteSize = ByteSize(n).to_string().parse().unwrap();
        assert!(back.0.abs_diff(n) as f64 <= n as f64 * 0.005, "{n}");
    }
}

// ---- point 2: pass-through mode ----

/// `backend:cudaMallocAsync` frees blocks waiting on other streams before it gives up, and
/// records its allocations in the history.
#[test]
fn p2_pass_through_processes_pending_frees_and_records_allocs() {
    let (sim, a) = allocator(ByteSize::mib(64), "backend:cudaMallocAsync");
    a.record_history(100, false);
    let x = a.allocate(40 * MIB, 0).unwrap();
    a.record_stream(&x, 1).unwrap();
    a.free(x).unwrap();
    // nothing is live: the pending block must be given back for this to fit
    let y = a.allocate(40 * MIB, 0).unwrap();
    a.free(y).unwrap();
    assert_eq!(sim.used(), 0);
    let h = a.history();
    let allocs = h.iter().filter(|e| e.action == TraceAction::Alloc).count();
    assert_eq!(allocs, 2, "{h:?}");
    a.check_invariants().unwrap();
}

// ---- point 4: zero-byte allocations ----

/// PyTorch (`malloc` of 0 returns a null data pointer) and RMM (`allocate(0)` returns nullptr)
/// allocate nothing for zero bytes.
#[test]
fn p4_zero_byte_allocations_take_nothing() {
    for mode in MODES {
        let (sim, a) = allocator(ByteSize::mib(64), mode);
        let z = a.allocate(0, 0).unwrap();
        assert_eq!((z.ptr, z.size, z.requested), (0, 0, 0));
        let s = a.stats();
        assert_eq!(s.allocated_bytes.all.current, 0);
        assert_eq!(s.allocation.all.current, 0);
        assert_eq!(s.reserved_bytes.all.current, 0);
        assert_eq!(sim.used(), 0);
        a.free(z).unwrap();
        a.check_invariants().unwrap();
    }
    // through a device: an empty buffer, charging no budget
    let dev = device(ByteSize::mib(64), MODES[1]);
    let budget = dev.thread_budget(ByteSize(0));
    let e = dev.alloc::<f32>(0).unwrap();
    assert!(e.is_empty());
    assert_eq!(e.to_vec().unwrap(), Vec::<f32>::new());
    assert_eq!(budget.used(), 0);
    assert!(dev.alloc::<u8>(1).unwrap_err().is_oom(), "the budget is 0");
    drop(e);
    drop(budget);
    assert_eq!(dev.stats().allocation.all.allocated, 0);
}

// ---- point 3: statistics equal a recount ----

/// `inactive_split` as PyTorch keeps it: free (cached or parked) blocks of split fixed segments;
/// growable segments are excluded (their free pages can always be released).
fn inactive_split_recount(a: &CachingAllocator) -> (u64, u64) {
    let (mut n, mut bytes) = (0, 0);
    for s in a.snapshot() {
        if s.growable || s.blocks.len() < 2 {
            continue;
        }
        for b in &s.blocks {
            if b.status == BlockStatus::Free {
                n += 1;
                bytes += b.size;
            }
        }
    }
    (n, bytes)
}

#[test]
fn p3_inactive_split_counts_parked_blocks_and_excludes_growable_segments() {
    for mode in MODES {
        let (_, a) = allocator(ByteSize::mib(256), mode);
        let xs: Vec<_> = (0..6)
            .map(|i| a.allocate(1000 + i * 600, 0).unwrap())
            .collect();
        let big: Vec<_> = (0..3).map(|_| a.allocate(3 * MIB, 0).unwrap()).collect();
        for (i, x) in xs.into_iter().enumerate() {
            if i % 2 == 0 {
                a.free(x).unwrap(); // parked for quick reuse
            }
        }
        a.free(big[1]).unwrap();
        let s = a.stats();
        let (n, bytes) = inactive_split_recount(&a);
        assert_eq!(s.inactive_split.all.current, n, "{mode}");
        assert_eq!(s.inactive_split_bytes.all.current, bytes, "{mode}");
        assert_eq!(
            s.inactive_split_bytes.small.current + s.inactive_split_bytes.large.current,
            bytes
        );
        if mode.ends_with("True") {
            assert_eq!(bytes, 0, "growable segments are excluded");
        } else {
            assert!(bytes > 0, "the scenario has split free blocks");
        }
        a.check_invariants().unwrap();
        a.empty_cache().unwrap();
        let (n, bytes) = inactive_split_recount(&a);
        assert_eq!(a.stats().inactive_split.all.current, n, "{mode}");
        assert_eq!(a.stats().inactive_split_bytes.all.current, bytes, "{mode}");
    }
}

// ---- point 5: empty_cache counts a synchronisation ----

/// PyTorch's `empty_cache` calls `synchronize_and_free_events`, which counts one
/// `num_sync_all_streams` every time (whether or not anything was cached).
#[test]
fn p5_empty_cache_counts_one_synchronisation() {
    for mode in MODES {
        let (_, a) = allocator(ByteSize::mib(64), mode);
        a.empty_cache().unwrap();
        assert_eq!(a.stats().num_sync_all_streams, 1, "{mode}: empty cache");
        let x = a.allocate(3 * MIB, 0).unwrap();
        a.free(x).unwrap();
        a.empty_cache().unwrap();
        assert_eq!(
            a.stats().num_sync_all_streams,
            2,
            "{mode}: one per empty_cache"
        );
    }
}

// ---- point 6: history records requested sizes ----

/// PyTorch's `record_trace` for `alloc`, `free_requested` and `free_completed` takes the
/// requested size (`orig_size` / `block->requested_size`), not the rounded block size.
#[test]
fn p6_history_records_the_requested_size() {
    for mode in MODES {
        for cross_stream in [false, true] {
            let dev = device(ByteSize::mib(64), mode);
            dev.allocator().record_history(100, false);
            let x = dev.alloc::<u8>(1000).unwrap();
            assert_eq!(x.allocation().size, 1024);
            if cross_stream {
                x.record_stream(1).unwrap(); // freed through the pending path
            }
            drop(x);
            dev.empty_cache().unwrap();
            let h = dev.allocator().history();
            for action in [
                TraceAction::Alloc,
                TraceAction::FreeRequested,
                TraceAction::FreeCompleted,
            ] {
                let e = h.iter().find(|e| e.action == action).expect("recorded");
                assert_eq!(e.size, 1000, "{mode} {action:?}");
            }
            let json = dev.memory_snapshot().to_json().unwrap();
            assert!(json.contains("\"action\":\"alloc\""), "{json}");
            let snap = oomguard_runtime::export::MemorySnapshot::from_json(&json).unwrap();
            assert!(snap
                .device_traces
                .iter()
                .filter(|e| e.action == TraceAction::Alloc)
                .all(|e| e.size == 1000));
        }
    }
}

// ---- point 7: fraction budgets per device ----

/// A fraction budget is a share of *each* device: bytes on one device do not count against
/// another device's share (they used to share one counter checked against the allocating
/// device's limit).
#[test]
fn p7_fraction_budgets_count_each_device_against_its_own_capacity() {
    use oomguard_runtime::guard::{thread_budget_fraction, GuardSet};
    let small = device(ByteSize::mib(100), MODES[1]);
    let big = device(ByteSize::mib(1000), MODES[1]);
    {
        let budget = thread_budget_fraction(0.5).unwrap();
        let b = big.alloc::<u8>(400 << 20).unwrap(); // 400 of big's 500 MiB share
        let s = small.alloc::<u8>(40 << 20).unwrap(); // 40 of small's 50 MiB share
        assert_eq!(budget.used(), 440 << 20);
        let e = small.alloc::<u8>(20 << 20).unwrap_err(); // 60 > 50 on small
        assert!(matches!(e, Error::BudgetExceeded(_)), "{e}");
        let b2 = big.alloc::<u8>(90 << 20).unwrap(); // 490 <= 500 on big
        assert!(big.alloc::<u8>(20 << 20).unwrap_err().is_oom()); // 510 > 500
        drop((b, b2));
        // freeing on big gives big's share back, not small's
        assert!(small.alloc::<u8>(20 << 20).unwrap_err().is_oom());
        let b3 = big.alloc::<u8>(450 << 20).unwrap();
        drop((s, b3));
        assert_eq!(budget.used(), 0);
    }
    // the async form (GuardSet) counts the same way
    let set = GuardSet::new().budget_fraction(0.5).unwrap();
    let fut = set.scope(async {
        let b = big.alloc::<u8>(400 << 20)?;
        let s = small.alloc::<u8>(40 << 20)?;
        drop((b, s));
        Ok::<(), Error>(())
    });
    let waker = std::task::Waker::noop();
    let mut cx = std::task::Context::from_waker(waker);
    let mut fut = std::pin::pin!(fut);
    match fut.as_mut().poll(&mut cx) {
        std::task::Poll::Ready((leaks, r)) => {
            leaks.unwrap();
            r.unwrap()
        }
        std::task::Poll::Pending => panic!("no await inside"),
    }
}

// ---- point 8: grad guards dropped out of order ----

#[test]
fn p8_grad_guards_dropped_out_of_order_leave_a_live_guards_mode() {
    use oomguard_runtime::guard::{enable_grad, inference_mode, no_grad, GradMode};
    let g1 = no_grad();
    let g2 = enable_grad();
    drop(g1);
    assert!(
        GradMode::current().grad_enabled,
        "g2 (enable_grad) is the live guard"
    );
    drop(g2);
    assert_eq!(GradMode::current(), GradMode::DEFAULT, "no guard left");

    let a = no_grad();
    let b = inference_mode();
    let c = enable_grad();
    let c_mode = GradMode::current();
    drop(b);
    assert_eq!(GradMode::current(), c_mode);
    drop(c);
    assert!(
        !GradMode::current().grad_enabled,
        "a (no_grad) is the live guard"
    );
    assert!(!GradMode::current().inference_mode);
    drop(a);
    assert_eq!(GradMode::current(), GradMode::DEFAULT);

    // in order, as before
    {
        let _x = no_grad();
        {
            let _y = enable_grad();
            assert!(GradMode::current().grad_enabled);
        }
        assert!(!GradMode::current().grad_enabled);
    }
    assert_eq!(GradMode::current(), GradMode::DEFAULT);
}

// ---- point 9: the out-of-memory hint ----

/// Every other 1 MiB block of a full 64 MiB device freed: 30 MiB cached in split segments (or
/// half-used pages) that cannot be released, 4 MiB free on the device. A 32 MiB request fails,
/// though free plus cached memory (34 MiB) exceeds it: fragmentation. The hint says so, and
/// recommends growable segments only when they are off.
#[test]
fn p9_oom_hint_names_fragmentation_and_recommends_only_what_is_off() {
    for mode in MODES {
        let (_, a) = allocator(ByteSize::mib(64), mode);
        let xs: Vec<_> = (0..60).map(|_| a.allocate(MIB, 0).unwrap()).collect();
        let mut keep = Vec::new();
        for (i, x) in xs.into_iter().enumerate() {
            if i % 2 == 0 {
                a.free(x).unwrap();
            } else {
                keep.push(x);
            }
        }
        let e = match a.allocate(32 * MIB, 0).unwrap_err() {
            Error::Oom(e) => e,
            e => panic!("{mode}: {e}"),
        };
        assert!(
            e.device_free < e.requested && e.reserved_unallocated < e.requested,
            "{e:?}"
        );
        assert!(
            e.device_free + e.reserved_unallocated >= e.requested,
            "{e:?}"
        );
        assert!(e.likely_fragmentation(), "{mode}: {e:?}");
        let m = e.to_string();
        assert!(m.contains("fragment"), "{mode}: {m}");
        let growable = mode.ends_with("True");
        assert_eq!(e.expandable_segments, growable);
        assert_eq!(
            m.contains("expandable_segments:True"),
            !growable,
            "{mode}: recommend growable segments only when off: {m}"
        );
        for x in keep {
            a.free(x).unwrap();
        }
    }
}

// ---- point 17: huge failed requests ----

/// PyTorch's test_cuda `test_out_of_memory`: "Tried to allocate 800000000.00 GiB" (sizes in GiB
/// at most, as its format_size). A failed request leaves no address reservation behind.
#[test]
fn p17_absurd_requests_fail_like_pytorch_and_reserve_nothing() {
    for mode in MODES {
        let (sim, a) = allocator(ByteSize::gib(1), mode);
        let keep = a.allocate(600 * MIB, 0).unwrap();
        let before = (
            a.snapshot().len(),
            sim.calls().reserve - sim.calls().release,
        );
        let e = a.allocate(1024 * 1024 * 1024 * 800_000_000, 0).unwrap_err();
        assert!(e.is_oom(), "{mode}: {e}");
        let m = e.to_string();
        assert!(
            m.contains("Tried to allocate 800000000.00 GiB"),
            "{mode}: {m}"
        );
        // exactly 1 GiB is "1024.00 MiB" in PyTorch's format_size (`size <= 1 GiB`)
        assert!(m.contains("total capacity of 1024.00 MiB"), "{mode}: {m}");
        // fits the device, not its free memory; on another stream (a new address range)
        let e = a.allocate(600 * MIB, 1).unwrap_err();
        assert!(e.is_oom(), "{mode}: {e}");
        let after = (
            a.snapshot().len(),
            sim.calls().reserve - sim.calls().release,
        );
        assert_eq!(
            after, before,
            "{mode}: a failed request left a segment or reservation"
        );
        a.check_invariants().unwrap();
        a.free(keep).unwrap();
    }
}

// ---- point 10: PyTorch features users rely on ----

#[test]
fn p10_per_process_memory_fraction_key_and_getter() {
    let c = AllocatorConfig::parse("per_process_memory_fraction:0.25").unwrap();
    assert_eq!(c.per_process_memory_fraction, Some(0.25));
    assert_eq!(AllocatorConfig::parse(&c.to_string()).unwrap(), c);
    let dev = Device::new(SimDevice::new(ByteSize::gib(1)), c);
    assert_eq!(dev.memory_fraction(), 0.25);
    assert!(dev.alloc::<u8>(300 << 20).unwrap_err().is_oom());
    drop(dev.alloc::<u8>(200 << 20).unwrap());
    dev.set_memory_fraction(0.5).unwrap();
    assert_eq!(dev.memory_fraction(), 0.5);
    drop(dev.alloc::<u8>(300 << 20).unwrap());
    // 0 is "no limit", as in PyTorch's config
    let c = AllocatorConfig::parse("per_process_memory_fraction:0").unwrap();
    assert_eq!(c.per_process_memory_fraction, None);
    let dev = Device::new(SimDevice::new(ByteSize::gib(1)), c);
    assert_eq!(dev.memory_fraction(), 1.0);
    drop(dev.alloc::<u8>(900 << 20).unwrap());
    for bad in [
        "per_process_memory_fraction:1.5",
        "per_process_memory_fraction:-0.1",
    ] {
        let e = AllocatorConfig::parse(bad).unwrap_err();
        assert_eq!(e.key.as_deref(), Some("per_process_memory_fraction"), "{e}");
    }
}

#[test]
fn p10_reset_accumulated_memory_stats() {
    let (_, a) = allocator(ByteSize::mib(64), MODES[0]);
    let keep = a.allocate(4096, 0).unwrap();
    let x = a.allocate(8 * MIB, 0).unwrap();
    a.free(x).unwrap();
    let _ = a.allocate(1 << 30, 0).unwrap_err();
    a.empty_cache().unwrap();
    let before = a.stats();
    assert!(before.allocation.all.allocated >= 2 && before.num_ooms == 1);
    a.reset_accumulated_memory_stats();
    let s = a.stats();
    for p in [
        s.allocated_bytes,
        s.allocation,
        s.reserved_bytes,
        s.segment,
        s.active_bytes,
        s.active,
        s.requested_bytes,
        s.inactive_split,
        s.inactive_split_bytes,
    ] {
        for st in [p.all, p.small, p.large] {
            assert_eq!((st.allocated, st.freed), (0, 0));
        }
    }
    assert_eq!(
        (s.num_alloc_retries, s.num_ooms, s.num_sync_all_streams),
        (0, 0, 0)
    );
    assert_eq!((s.num_device_alloc, s.num_device_free), (0, 0));
    // current values and peaks stay
    assert_eq!(
        s.allocated_bytes.all.current,
        before.allocated_bytes.all.current
    );
    assert_eq!(s.allocated_bytes.all.peak, before.allocated_bytes.all.peak);
    a.free(keep).unwrap();
    a.check_invariants().unwrap();
}

/// PyTorch's `_cuda_attach_out_of_memory_observer`: called on every OOM with the device, the
/// request, what is allocated and what the device has free, outside the allocator's lock, so
/// the observer can take a snapshot.
#[test]
fn p10_out_of_memory_observer_can_snapshot() {
    use std::sync::Mutex;
    let dev = Device::new(
        SimDevice::new(ByteSize::mib(64)).with_ordinal(2),
        AllocatorConfig::default(),
    );
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (seen2, dev2) = (seen.clone(), dev.clone());
    dev.allocator().attach_oom_observer(move |e| {
        let segments = dev2.snapshot().len(); // would deadlock under the lock
        seen2
            .lock()
            .unwrap()
            .push((e.device, e.requested, e.allocated, e.device_free, segments));
    });
    let keep = dev.alloc::<u8>(10 << 20).unwrap();
    let _ = dev.alloc::<u8>(100 << 20).unwrap_err();
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 1);
    let (device, requested, allocated, free, segments) = seen[0];
    assert_eq!((device, requested, allocated), (2, 100 << 20, 10 << 20));
    assert!(free <= 54 << 20 && segments >= 1, "{free} {segments}");
    drop(keep);
}

#[test]
fn p10_leak_reports_name_the_device() {
    use oomguard_runtime::guard::{thread_leak_check, LeakAction};
    let dev = Device::new(
        SimDevice::new(ByteSize::mib(64)).with_ordinal(3),
        AllocatorConfig::default(),
    );
    let check = dev.leak_check().on_leak(LeakAction::Report);
    let kept = dev.alloc::<u8>(1000).unwrap();
    let r = check.finish().unwrap_err();
    assert_eq!(r.leaks[0].device, 3);
    assert!(r.to_string().contains("device 3"), "{r}");
    let check = thread_leak_check().on_leak(LeakAction::Report);
    let kept2 = dev.alloc::<u8>(1000).unwrap();
    let r = check.finish().unwrap_err();
    assert_eq!(r.leaks[0].device, 3);
    assert!(r.to_string().contains("device 3"), "{r}");
    drop((kept, kept2));
}

// ---- point 11: PyTorch's config keys ----

/// `roundup_power2_divisions` as PyTorch's parseRoundUpPower2Divisions reads it: 0 disables an
/// interval, `>` fills from after the last interval given (index 1 when it comes first),
/// intervals in any order, a bare value must be a power of two.
#[test]
fn p11_roundup_power2_divisions_exactly_as_pytorch() {
    let d = |s: &str| {
        AllocatorConfig::parse(&format!("roundup_power2_divisions:{s}"))
            .map(|c| c.roundup_power2_divisions)
    };
    // stored: 0 or 1 mean plain rounding (kept as 0)
    let mut want = [4u64; 16];
    want[0] = 0;
    assert_eq!(
        d("[>:4]").unwrap(),
        want,
        "[>:4] leaves the first interval alone"
    );
    let mut want = [4u64; 16];
    want[1] = 0;
    assert_eq!(d("[1:4,2:0,>:4]").unwrap(), want, "0 disables an interval");
    let mut want = [0u64; 16];
    want[..3].copy_from_slice(&[2, 8, 2]);
    assert_eq!(d("[4:2,2:8]").unwrap(), want, "intervals in any order");
    // a boundary past the last interval clamps to it; the first entry fills those before it
    assert_eq!(d("[65536:2]").unwrap(), [2; 16]);
    assert!(d("0").is_err(), "a bare value must be a power of two");
    assert!(d("[3:2]").is_err() && d("[2:3]").is_err());
    assert_eq!(d("1").unwrap(), [0; 16]);
    for s in ["[>:4]", "[1:4,2:0,>:4]", "[4:2,2:8]"] {
        let c = AllocatorConfig::parse(&format!("roundup_power2_divisions:{s}")).unwrap();
        assert_eq!(
            AllocatorConfig::parse(&c.to_string()).unwrap(),
            c,
            "{s} -> {c}"
        );
    }
}

/// Every key PyTorch's CUDA allocator accepts is honoured or accepted with a one-line warning,
/// so an existing PYTORCH_CUDA_ALLOC_CONF value does not break startup.
#[test]
fn p11_every_pytorch_key_is_accepted() {
    let ignored = [
        "release_lock_on_cudamalloc:True",
        "release_lock_on_hipmalloc:False",
        "pinned_use_cuda_host_register:True",
        "pinned_use_hip_host_register:False",
        "pinned_num_register_threads:8",
        "pinned_reserve_segment_size_mb:64",
        "pinned_use_background_threads:True",
        "graph_capture_record_stream_reuse:True",
        "pinned_free_catch_all:True",
        "throw_on_cudamalloc_oom:True",
    ];
    let s = format!("expandable_segments:False,{}", ignored.join(","));
    let (c, warnings) = AllocatorConfig::parse_with_warnings(&s).unwrap();
    assert!(!c.expandable_segments);
    assert_eq!(warnings.len(), ignored.len(), "{warnings:?}");
    for (w, k) in warnings.iter().zip(ignored) {
        let key = k.split(':').next().unwrap();
        assert!(
            w.contains(key) && w.contains("no effect") && !w.contains('\n'),
            "{w}"
        );
    }
    assert_eq!(AllocatorConfig::parse(&s).unwrap(), c);
    // still an error: unknown keys and bad values of accepted keys
    assert!(AllocatorConfig::parse("release_lock_on_cudamalloc:maybe").is_err());
    assert!(AllocatorConfig::parse("no_such_key:1").is_err());
}

/// `max_non_split_rounding_mb` is honoured: an oversize free block is reused for a request
/// within that many MiB of its size (PyTorch's default and minimum: 20).
#[test]
fn p11_max_non_split_rounding_mb_is_honoured() {
    for (cfg, reused) in [
        ("expandable_segments:False,max_split_size_mb:100", false),
        (
            "expandable_segments:False,max_split_size_mb:100,max_non_split_rounding_mb:60",
            true,
        ),
    ] {
        let (_, a) = allocator(ByteSize::mib(512), cfg);
        let x = a.allocate(200 * MIB, 0).unwrap();
        a.free(x).unwrap();
        let y = a.allocate(150 * MIB, 0).unwrap();
        assert_eq!(y.ptr == x.ptr, reused, "{cfg}");
        a.free(y).unwrap();
    }
    assert!(AllocatorConfig::parse("max_non_split_rounding_mb:10").is_err());
}

// ---- point 12: history options as PyTorch's _record_memory_history ----

#[test]
fn p12_history_free_stacks_skip_actions_metadata_and_no_clearing() {
    use oomguard_runtime::alloc::{HistoryContext, HistoryOptions};
    let (_, a) = allocator(ByteSize::mib(64), MODES[1]);
    a.record_history_with(HistoryOptions {
        max_entries: 1000,
        context: HistoryContext::All,
        skip_actions: vec![TraceAction::SegmentMap],
        stacks: true,
        clear: false,
    });
    a.set_history_metadata(Some("step 1".into()));
    let x = a.allocate(1000, 0).unwrap();
    let free_line = line!() + 1;
    a.free(x).unwrap();
    let h = a.history();
    assert!(
        h.iter().all(|e| e.action != TraceAction::SegmentMap),
        "skipped"
    );
    let alloc = h.iter().find(|e| e.action == TraceAction::Alloc).unwrap();
    let free = h
        .iter()
        .find(|e| e.action == TraceAction::FreeRequested)
        .unwrap();
    assert_eq!(alloc.user_metadata, "step 1");
    assert!(
        free.frames[0].filename.ends_with("conformance.rs"),
        "{:?}",
        free.frames
    );
    assert_eq!(free.frames[0].line, free_line, "where the block was freed");
    assert!(free.backtrace.as_deref().is_some_and(|b| !b.is_empty()));
    // buffers dropped: the free event carries a full backtrace (stacks), which names this test
    let dev = device(ByteSize::mib(64), MODES[1]);
    dev.allocator().record_history_with(HistoryOptions {
        max_entries: 100,
        context: HistoryContext::All,
        skip_actions: vec![],
        stacks: true,
        clear: false,
    });
    drop(dev.alloc::<u8>(100).unwrap());
    let h = dev.allocator().history();
    let free = h
        .iter()
        .find(|e| e.action == TraceAction::FreeRequested)
        .unwrap();
    assert!(free.backtrace.is_some());

    // changing what is captured keeps what was recorded (PyTorch's clear_history=False)
    let before = a.history().len();
    a.set_history_metadata(None);
    a.record_history_with(HistoryOptions {
        max_entries: 1000,
        context: HistoryContext::Alloc,
        skip_actions: vec![],
        stacks: false,
        clear: false,
    });
    let y = a.allocate(1000, 0).unwrap();
    a.free(y).unwrap();
    let h = a.history();
    assert!(h.len() > before, "kept and extended");
    let last_free = h
        .iter()
        .rev()
        .find(|e| e.action == TraceAction::FreeRequested)
        .unwrap();
    assert!(last_free.frames.is_empty(), "context alloc: no free stacks");
    assert_eq!(last_free.user_metadata, "");
    let last_alloc = h
        .iter()
        .rev()
        .find(|e| e.action == TraceAction::Alloc)
        .unwrap();
    assert_eq!(last_alloc.frames.len(), 1);
    // and clear does clear
    a.record_history_with(HistoryOptions {
        max_entries: 1000,
        context: HistoryContext::None,
        skip_actions: vec![],
        stacks: false,
        clear: true,
    });
    assert!(a.history().is_empty());
    let z = a.allocate(1000, 0).unwrap();
    assert!(a.history()[0].frames.is_empty(), "context none: no stacks");
    a.free(z).unwrap();
}

// ---- point 13: RMM-style nested statistics scopes ----

/// As rmm's `statistics_resource_adaptor` push_counters/pop_counters: bytes *requested*, frees
/// of blocks allocated before the scope count too (so values can go negative), a popped scope's
/// counters are folded into the one below.
#[test]
fn p13_nested_statistics_scopes_count_like_rmm() {
    let (_, a) = allocator(ByteSize::mib(64), MODES[1]);
    let before = a.allocate(3000, 0).unwrap();
    assert!(a.statistics_scope().is_none());
    assert!(a.pop_statistics_scope().is_err(), "nothing pushed");
    a.push_statistics_scope();
    let x = a.allocate(1000, 0).unwrap();
    let s = a.statistics_scope().unwrap();
    assert_eq!(
        (s.bytes.value, s.bytes.peak, s.bytes.total),
        (1000, 1000, 1000)
    );
    assert_eq!((s.allocations.value, s.allocations.total), (1, 1));
    a.free(before).unwrap(); // allocated before the scope
    let s = a.statistics_scope().unwrap();
    assert_eq!(
        (s.bytes.value, s.bytes.peak, s.bytes.total),
        (-2000, 1000, 1000)
    );
    assert_eq!(s.allocations.value, 0);
    a.push_statistics_scope();
    let y = a.allocate(500, 0).unwrap();
    let inner = a.pop_statistics_scope().unwrap();
    assert_eq!(
        (inner.bytes.value, inner.bytes.peak, inner.bytes.total),
        (500, 500, 500)
    );
    let outer = a.statistics_scope().unwrap();
    // folded in: value += inner value, peak = max(peak, value_before + inner peak), total +=
    assert_eq!(
        (outer.bytes.value, outer.bytes.peak, outer.bytes.total),
        (-1500, 1000, 1500)
    );
    assert_eq!((outer.allocations.value, outer.allocations.total), (1, 2));
    a.free(x).unwrap();
    a.free(y).unwrap();
    let outer = a.pop_statistics_scope().unwrap();
    assert_eq!(outer.bytes.value, -3000);
    assert!(a.pop_statistics_scope().is_err());
    // zero-byte allocations count as RMM counts them (an allocation of 0 bytes)
    a.push_statistics_scope();
    let z = a.allocate(0, 0).unwrap();
    a.free(z).unwrap();
    let s = a.pop_statistics_scope().unwrap();
    assert_eq!((s.bytes.total, s.allocations.value), (0, 0));
}

// ---- point 14: initial reservation ----

/// rmm's `pool_memory_resource(upstream, initial_pool_size, maximum_pool_size)` / JAX's
/// preallocation: memory taken up front and served to later requests without asking the device;
/// an initial size above the maximum is refused.
#[test]
fn p14_initial_reservation_serves_later_requests() {
    for mode in MODES {
        let (sim, a) = allocator(ByteSize::gib(1), mode);
        a.reserve_initial(512 * MIB).unwrap();
        let s = a.stats();
        assert_eq!(s.reserved_bytes.all.current, 512 * MIB, "{mode}");
        assert_eq!(s.allocated_bytes.all.current, 0);
        let calls = sim.calls();
        let xs: Vec<_> = [100 * MIB, 64 * MIB, 200 * MIB]
            .iter()
            .map(|&n| a.allocate(n, 0).unwrap())
            .collect();
        assert_eq!(sim.calls(), calls, "{mode}: served from the reservation");
        for x in xs {
            a.free(x).unwrap();
        }
        a.check_invariants().unwrap();
        // validation: initial above the maximum (the memory limit) or the device
        let (_, b) = allocator(ByteSize::gib(1), mode);
        b.set_memory_limit(Some(256 * MIB));
        let e = b.reserve_initial(512 * MIB).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        assert!(e.to_string().contains("maximum"), "{e}");
        let e = b.reserve_initial(2 << 30).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        assert_eq!(b.stats().reserved_bytes.all.current, 0);
        b.reserve_initial(0).unwrap();
    }
}

/// A reservation under 10 MiB takes what was asked (rounded up to 2 MiB), as rmm's initial pool
/// does, in both modes: native mode gave it the 20 MiB segment of an allocation under 10 MiB, so
/// 4 MiB reserved 20 MiB, and on an empty 8 MiB card it failed with the whole card free. An
/// out-of-memory at the memory limit says the limit (it said only that there was one).
#[test]
fn small_initial_reservations_take_what_was_asked() {
    for mode in MODES {
        for (asked, taken) in [(1, 2 * MIB), (4 * MIB, 4 * MIB), (5 * MIB + 1, 6 * MIB)] {
            let (sim, a) = allocator(ByteSize::gib(1), mode);
            a.reserve_initial(asked).unwrap();
            assert_eq!(
                a.stats().reserved_bytes.all.current,
                taken,
                "{mode}: {asked}"
            );
            // served from it without asking the device
            let calls = sim.calls();
            let x = a.allocate((taken - MIB).max(MIB + 1), 0).unwrap();
            assert_eq!(sim.calls(), calls, "{mode}: {asked}");
            a.free(x).unwrap();
            a.check_invariants().unwrap();
            a.empty_cache().unwrap();
            assert_eq!(a.stats().reserved_bytes.all.current, 0, "{mode}: {asked}");
        }
        let (_, small) = allocator(ByteSize::mib(8), mode);
        small.reserve_initial(4 * MIB).unwrap();
        assert_eq!(small.stats().reserved_bytes.all.current, 4 * MIB, "{mode}");
        // under a limit that is not a multiple of 2 MiB, up to the limit (512-byte blocks)
        let (_, limited) = allocator(ByteSize::gib(1), mode);
        limited.set_memory_limit(Some(5 * MIB));
        if mode.ends_with("False") {
            limited.reserve_initial(5 * MIB).unwrap();
            assert_eq!(limited.stats().reserved_bytes.all.current, 5 * MIB);
        }
        // an out-of-memory at the limit names the limit and what is reserved against it
        let (_, capped) = allocator(ByteSize::gib(1), mode);
        capped.set_memory_limit(Some(5 * MIB));
        let e = capped.allocate(6 * MIB, 0).unwrap_err().to_string();
        assert!(
            e.contains("memory limit of 5.00 MiB") && e.contains("(0 bytes reserved"),
            "{mode}: {e}"
        );
    }
}

// ---- point 19: tests that can fail ----

/// With events that stay pending until their stream is synchronised, delayed reuse after
/// `record_stream` is observable: the block is not handed out again until stream 2's work is
/// done (the simulated device used to complete every event at once).
#[test]
fn p19_recorded_stream_delays_reuse_until_the_stream_is_synchronised() {
    for mode in MODES {
        let sim = SimDevice::address_only(ByteSize::mib(64)).with_pending_events();
        let a = CachingAllocator::new(Arc::new(sim.clone()), AllocatorConfig::parse(mode).unwrap());
        let x = a.allocate(4096, 1).unwrap();
        a.record_stream(&x, 2).unwrap();
        a.free(x).unwrap();
        assert_eq!(sim.pending_events(), 1);
        let mut held = Vec::new();
        for _ in 0..4 {
            let y = a.allocate(4096, 1).unwrap();
            assert_ne!(
                y.ptr, x.ptr,
                "{mode}: reused while stream 2 may still use it"
            );
            held.push(y);
        }
        assert_eq!(a.stats().active.all.current, 5, "{mode}: x is still active");
        sim.synchronize_stream(2);
        let z = a.allocate(4096, 1).unwrap();
        assert_eq!(z.ptr, x.ptr, "{mode}: reused once stream 2 is done");
        // empty_cache waits for pending events
        a.record_stream(&z, 3).unwrap();
        a.free(z).unwrap();
        assert_eq!(sim.pending_events(), 1);
        a.empty_cache().unwrap();
        assert_eq!(sim.pending_events(), 0);
        for y in held {
            a.free(y).unwrap();
        }
        a.check_invariants().unwrap();
    }
}

/// A training-step-like workload on a fresh device with an out-of-memory injected at every
/// backend call where the allocator acts (segment allocation, address reservation, page
/// mapping): each run recovers (the allocator releases its cache and retries) with the
/// fault-free result, or fails with a clean OOM; nothing leaks, invariants hold, the device's
/// usage equals the allocator's reserved bytes.
#[test]
fn p19_faults_at_segment_allocation_reservation_and_mapping() {
    use oomguard_runtime::backend::sim::SimOp;
    fn step(dev: &Device) -> Result<f32, Error> {
        let weights = dev.from_slice(&vec![0.5f32; 1 << 14])?;
        let mut acc = 0.0f32;
        let mut keep = Vec::new();
        for layer in 0..6usize {
            let act = dev.zeros::<f32>((layer + 1) << 18)?; // 1..6 MiB
            let tmp = dev.from_slice(&vec![layer as f32; 1 << 10])?;
            acc += tmp.to_vec()?.iter().sum::<f32>() + act.len() as f32;
            keep.push(act);
        }
        let big = dev.zeros::<u8>(30 << 20)?;
        acc += big.len() as f32 + weights.to_vec()?[0];
        Ok(acc)
    }
    for (mode, ops) in [
        (MODES[0], vec![SimOp::AllocSegment]),
        (MODES[1], vec![SimOp::Reserve, SimOp::Map]),
    ] {
        let fresh = || {
            let sim = SimDevice::new(ByteSize::mib(256));
            let dev = Device::new(sim.clone(), AllocatorConfig::parse(mode).unwrap());
            (sim, dev)
        };
        let (sim, dev) = fresh();
        let expected = step(&dev).unwrap();
        for op in ops {
            let n = sim.faults().op_calls(op);
            assert!(n >= 2, "{mode}: {op:?} called {n} times");
            let (mut recovered, mut failed) = (0, 0);
            // once (the allocator's retry succeeds) and from then on (it cannot)
            for (k, persistent) in (0..n).flat_map(|k| [(k, false), (k, true)]) {
                let (sim, dev) = fresh();
                if persistent {
                    sim.faults().fail_ops_from(op, k);
                } else {
                    sim.faults().fail_nth_op(op, k);
                }
                match step(&dev) {
                    Ok(v) => {
                        assert_eq!(v, expected, "{mode} {op:?} #{k}");
                        assert!(dev.stats().num_alloc_retries >= 1, "{mode} {op:?} #{k}");
                        recovered += 1;
                    }
                    Err(e) => {
                        assert!(e.is_oom(), "{mode} {op:?} #{k}: {e}");
                        failed += 1;
                    }
                }
                if persistent {
                    sim.faults().clear();
                }
                assert!(
                    sim.faults().op_calls(op) > k,
                    "{mode} {op:?} #{k}: fault never fired"
                );
                let s = dev.stats();
                assert_eq!(s.allocated_bytes.all.current, 0, "{mode} {op:?} #{k}: leak");
                assert_eq!(
                    s.reserved_bytes.all.current,
                    sim.used(),
                    "{mode} {op:?} #{k}"
                );
                dev.allocator().check_invariants().unwrap();
                dev.empty_cache().unwrap();
                assert_eq!(sim.used(), 0, "{mode} {op:?} #{k}");
                assert_eq!(
                    step(&dev).unwrap(),
                    expected,
                    "{mode} {op:?} #{k}: next run"
                );
            }
            println!(
                "{mode} {op:?}: {n} injection points x 2, {recovered} recovered, {failed} failed"
            );
            assert!(
                recovered >= n as usize && failed >= 1,
                "{mode} {op:?}: both outcomes seen"
            );
        }
    }
}

/// The capacity check of point 16/17 re-reads the device's capacity: a simulated device that
/// grew serves a request larger than its start-up capacity.
#[test]
fn p17_capacity_check_follows_a_grown_device() {
    let sim = SimDevice::address_only(ByteSize::mib(64));
    let a = CachingAllocator::new(Arc::new(sim.clone()), AllocatorConfig::default());
    assert!(a.allocate(100 * MIB, 0).unwrap_err().is_oom());
    sim.set_capacity(ByteSize::mib(128));
    let x = a.allocate(100 * MIB, 0).unwrap();
    a.free(x).unwrap();
}

/// Statistics scopes of absurd sizes saturate instead of overflowing (debug builds panicked).
#[test]
fn p13_statistics_scopes_saturate() {
    let sim = SimDevice::address_only(ByteSize(u64::MAX));
    let a = CachingAllocator::new(Arc::new(sim), AllocatorConfig::native());
    a.push_statistics_scope();
    // (requests stay below 1 EB since issue 26: nine of them pass i64::MAX)
    let live: Vec<_> = (0..9)
        .map(|_| a.allocate((1 << 60) - 1, 0).unwrap())
        .collect();
    let s = a.statistics_scope().unwrap();
    assert_eq!(
        (s.bytes.value, s.bytes.total),
        (i64::MAX, i64::MAX),
        "{s:?}"
    );
    for x in live {
        a.free(x).unwrap();
    }
    let s = a.pop_statistics_scope().unwrap();
    assert!(s.bytes.value < 0, "{s:?}");
}

/// Cumulative totals of the statistics (`allocated`, `freed`) wrap instead of overflowing after
/// 2^64 bytes (a panic in debug builds, reachable with absurd sizes on a huge simulated device).
#[test]
fn p16_cumulative_statistics_do_not_overflow() {
    let sim = SimDevice::address_only(ByteSize(u64::MAX));
    let a = CachingAllocator::new(Arc::new(sim), AllocatorConfig::default());
    let size = (1 << 60) - 512; // requests stay below 1 EB since issue 26
    for _ in 0..20 {
        // served from the cache after the first round: the totals grow by ~2^60 each time
        let x = a.allocate(size, 0).unwrap();
        a.free(x).unwrap();
    }
    let s = a.stats();
    assert_eq!(s.allocated_bytes.all.current, 0);
    assert_eq!(s.allocated_bytes.all.peak, size);
    assert_eq!(
        s.allocated_bytes.all.allocated,
        size.wrapping_mul(20),
        "wrapped"
    );
    a.check_invariants().unwrap();
}

// ---- issue 26 point 13: conformance leftovers ----

/// PyTorch's `set_per_process_memory_fraction(0.0)` is accepted, and nothing may be allocated
/// then (a zero-byte request still is: it takes no memory).
#[test]
fn i26_memory_fraction_zero_is_accepted_and_allows_nothing() {
    for mode in MODES {
        let dev = device(ByteSize::gib(1), mode);
        dev.set_memory_fraction(0.0).unwrap();
        assert_eq!(dev.memory_fraction(), 0.0, "{mode}");
        assert_eq!(dev.allocator().memory_limit(), Some(0), "{mode}");
        for n in [1, 512, 3 << 20] {
            let e = dev.alloc::<u8>(n).unwrap_err();
            assert!(e.is_oom(), "{mode} {n}: {e}");
        }
        assert_eq!(dev.stats().reserved_bytes.all.current, 0, "{mode}");
        drop(dev.alloc::<u8>(0).unwrap());
        dev.set_memory_fraction(1.0).unwrap();
        drop(dev.alloc::<u8>(3 << 20).unwrap());
        let e = dev.set_memory_fraction(-0.0001).unwrap_err();
        assert!(e.to_string().contains("[0, 1]"), "{e}");
    }
}

/// PyTorch refuses a request of 1 EB (2^60 bytes) or more with "Tried to allocate more than
/// 1EB memory", an out-of-memory error, before anything else.
#[test]
fn i26_requests_of_1_eb_or_more_say_so_like_pytorch() {
    for mode in MODES.iter().copied().chain(["backend:cudaMallocAsync"]) {
        let (_, a) = allocator(ByteSize::gib(1), mode);
        for size in [1u64 << 60, (1 << 60) + 1, u64::MAX / 2, u64::MAX] {
            let e = a.allocate(size, 0).unwrap_err();
            assert!(e.is_oom(), "{mode} {size}: {e}");
            let m = e.to_string();
            assert!(
                m.contains("Tried to allocate more than 1EB memory."),
                "{mode} {size}: {m}"
            );
        }
        // just below: the ordinary message, with the size
        let e = a.allocate((1 << 60) - 512, 0).unwrap_err();
        assert!(!e.to_string().contains("1EB"), "{mode}: {e}");
        assert!(
            e.to_string()
                .contains("Tried to allocate 1073741824.00 GiB"),
            "{mode}: {e}"
        );
        assert_eq!(a.stats().reserved_bytes.all.current, 0, "{mode}");
        a.check_invariants().unwrap();
    }
}

/// PyTorch's `pinned_num_register_threads` must be a power of two and at most 128; the error
/// names the key.
#[test]
fn i26_pinned_num_register_threads_follows_pytorchs_rule() {
    for good in [1, 2, 8, 64, 128] {
        let s = format!("pinned_num_register_threads:{good}");
        let (_, warnings) = AllocatorConfig::parse_with_warnings(&s).unwrap();
        assert_eq!(warnings.len(), 1, "{s}: ignored with a warning");
    }
    for (bad, why) in [
        (0, "power of 2"),
        (3, "power of 2"),
        (96, "power of 2"),
        (256, "at most 128"),
        (1u64 << 40, "at most 128"),
    ] {
        let e = AllocatorConfig::parse(&format!("pinned_num_register_threads:{bad}")).unwrap_err();
        assert_eq!(
            e.key.as_deref(),
            Some("pinned_num_register_threads"),
            "{bad}: {e}"
        );
        assert!(e.to_string().contains(why), "{bad}: {e}");
    }
}

/// RMM's `statistics_resource_adaptor` counts every allocation, one of zero bytes included (it
/// adds `{0 bytes, 1 allocation}` and subtracts them on the free).
#[test]
fn i26_statistics_scopes_count_zero_byte_allocations() {
    for mode in MODES {
        let (_, a) = allocator(ByteSize::mib(64), mode);
        a.push_statistics_scope();
        let z = a.allocate(0, 0).unwrap();
        let s = a.statistics_scope().unwrap();
        assert_eq!(
            (s.allocations.value, s.allocations.peak, s.allocations.total),
            (1, 1, 1),
            "{mode}"
        );
        assert_eq!((s.bytes.value, s.bytes.total), (0, 0), "{mode}");
        let x = a.allocate(100, 0).unwrap();
        a.free(z).unwrap();
        a.free(x).unwrap();
        let s = a.pop_statistics_scope().unwrap();
        assert_eq!(
            (s.allocations.value, s.allocations.peak, s.allocations.total),
            (0, 2, 2),
            "{mode}"
        );
        assert_eq!(
            (s.bytes.value, s.bytes.peak, s.bytes.total),
            (0, 100, 100),
            "{mode}"
        );
        // with no scope open, a zero-byte allocation still takes nothing
        let z = a.allocate(0, 0).unwrap();
        a.free(z).unwrap();
        assert_eq!(a.stats().allocation.all.allocated, 1, "{mode}: only x");
    }
}

/// With a memory limit of 8 MiB, a request of 8 MiB − 1 is served in fixed-segment mode: its
/// rounded segment (20 MiB) would pass the limit, so it gets a segment of exactly its size, as
/// RMM's pool with that maximum serves it (it used to fail). Rounded segments are still used
/// whenever they fit.
#[test]
fn i26_a_request_under_the_limit_is_served_when_its_segment_would_not_fit() {
    let (sim, a) = allocator(ByteSize::gib(1), MODES[0]);
    a.set_memory_limit(Some(8 * MIB));
    let x = a.allocate(8 * MIB - 1, 0).unwrap();
    assert_eq!(x.size, 8 * MIB);
    assert_eq!(a.stats().reserved_bytes.all.current, 8 * MIB);
    assert!(a.allocate(1, 0).unwrap_err().is_oom(), "the limit holds");
    a.free(x).unwrap();
    a.check_invariants().unwrap();
    // the cached 8 MiB segment is reused, split for a smaller request
    let y = a.allocate(MIB + 1, 0).unwrap();
    a.free(y).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(sim.used(), 0);
    // small requests alike: 512 KiB under a 1 MiB limit (the small pool's segment is 2 MiB)
    a.set_memory_limit(Some(MIB));
    let s = a.allocate(512 << 10, 0).unwrap();
    assert_eq!(a.stats().reserved_bytes.all.current, 512 << 10);
    a.free(s).unwrap();
    // a rounded segment that fits is still rounded
    a.empty_cache().unwrap();
    a.set_memory_limit(Some(64 * MIB));
    let t = a.allocate(3 * MIB, 0).unwrap();
    assert_eq!(a.stats().reserved_bytes.all.current, 20 * MIB);
    a.free(t).unwrap();
    a.check_invariants().unwrap();
}

/// A configuration built by setting fields was used as it was (found by a hostile pass of the
/// API): a NaN memory fraction made `memory_fraction()` NaN, and a 3 MiB `max_split_size`
/// printed as `max_split_size_mb:3` in summaries and snapshots, a configuration `parse`
/// refuses. `check` says what is wrong, and a device does not use such a configuration.
#[test]
fn a_configuration_set_by_hand_is_checked() {
    let nan = AllocatorConfig {
        per_process_memory_fraction: Some(f64::NAN),
        ..AllocatorConfig::default()
    };
    assert!(nan.check().is_err());
    let dev = Device::new(SimDevice::new(ByteSize::mib(64)), nan);
    assert_eq!(dev.allocator().memory_fraction(), 1.0);
    assert_eq!(dev.allocator().config(), AllocatorConfig::default());

    let mut split = AllocatorConfig::native();
    split.max_split_size = 3 << 20;
    let e = split.check().unwrap_err();
    assert!(e.to_string().contains("below the minimum of 20 MiB"), "{e}");
    split.max_split_size = (25 << 20) + 1;
    let e = split.check().unwrap_err();
    assert!(e.to_string().contains("a value its key cannot say"), "{e}");

    let fine = AllocatorConfig {
        max_split_size: 64 << 20,
        per_process_memory_fraction: Some(0.5),
        ..AllocatorConfig::native()
    };
    fine.check().unwrap();
    let dev = Device::new(SimDevice::new(ByteSize::mib(64)), fine.clone());
    assert_eq!(dev.allocator().config(), fine);
    assert_eq!(dev.allocator().memory_fraction(), 0.5);
}
