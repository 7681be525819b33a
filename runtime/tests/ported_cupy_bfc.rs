//! The semantics of CuPy's memory-pool tests (`tests/cupy_tests/cuda_tests/test_memory.py`:
//! `SingleDeviceMemoryPool`, `MemoryPool`, `set_limit`, streams, threads, `malloc_async`) and of
//! TensorFlow's BFC allocator tests (`gpu_bfc_allocator_test.cc`, xla's
//! `tsl/framework/bfc_allocator_test.cc`), ported onto oomguard's public API on the simulated
//! device. Names start with `cupy_` or `tf_` and the original test's name.
//!
//! Mapping: CuPy `used_bytes` = `allocated_bytes.all.current`, `total_bytes` =
//! `reserved_bytes.all.current`, `free_bytes` = their difference, `n_free_blocks` = free blocks
//! in the snapshot, `free_all_blocks` = `empty_cache`, `set_limit(size)` = `set_memory_limit`,
//! `set_limit(fraction)` = `set_memory_fraction`, `get_limit` = `memory_limit`. TF `num_allocs` =
//! `allocation.all.allocated`, `bytes_in_use` = `allocated_bytes.all.current`,
//! `peak_bytes_in_use` = `allocated_bytes.all.peak`, `bytes_limit` = `memory_limit`,
//! `RequestedSize`/`AllocatedSize` = `Allocation::{requested, size}`, `ClearStats` =
//! `reset_peak_stats` + `reset_accumulated_memory_stats`.

use std::sync::Arc;

use oomguard_runtime::alloc::{BlockStatus, CachingAllocator};
use oomguard_runtime::backend::sim::{SimDevice, SimOp};
use oomguard_runtime::{Allocation, AllocatorConfig, ByteSize, Device, Error};

const MIB: u64 = 1 << 20;
const UNIT: u64 = 512; // CuPy's _allocation_unit_size, and oomguard's rounding
const NATIVE: &str = "expandable_segments:False";
const GROWABLE: &str = "expandable_segments:True";
const MODES: [&str; 2] = [NATIVE, GROWABLE];

fn device(cap: ByteSize, cfg: &str) -> Device {
    Device::new(SimDevice::new(cap), AllocatorConfig::parse(cfg).unwrap())
}

fn addr_device(cap: ByteSize, cfg: &str) -> Device {
    Device::new(
        SimDevice::address_only(cap),
        AllocatorConfig::parse(cfg).unwrap(),
    )
}

fn used(d: &Device) -> u64 {
    d.stats().allocated_bytes.all.current
}
fn total(d: &Device) -> u64 {
    d.stats().reserved_bytes.all.current
}
fn free_bytes(d: &Device) -> u64 {
    let s = d.stats();
    s.reserved_bytes.all.current - s.allocated_bytes.all.current
}
fn n_free_blocks(d: &Device) -> usize {
    d.snapshot()
        .iter()
        .flat_map(|s| s.blocks.iter())
        .filter(|b| b.status == BlockStatus::Free)
        .count()
}
fn a(d: &Device, bytes: u64) -> Allocation {
    d.alloc_raw(bytes, 0).unwrap()
}
fn f(d: &Device, x: Allocation) {
    d.free_raw(x).unwrap()
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = (self.next() % (i as u64 + 1)) as usize;
            v.swap(i, j);
        }
    }
}

/// Sorted by address, no two live allocations overlap (TF's NoDups check, with the requested
/// size as TF uses it, and also with the block size).
fn assert_no_overlap(mut v: Vec<Allocation>, what: &str) {
    v.sort_by_key(|x| x.ptr);
    for w in v.windows(2) {
        assert_ne!(w[0].ptr, w[1].ptr, "{what}: duplicate pointer");
        assert!(w[0].requested > 0, "{what}");
        assert!(
            w[1].ptr - w[0].ptr >= w[0].size,
            "{what}: {:?} overlaps {:?}",
            w[0],
            w[1]
        );
    }
}

// ======================================================================================
// CuPy: SingleDeviceMemoryPool
// ======================================================================================

/// test_round_size: unit-1 -> unit, unit -> unit, unit+1 -> 2 units.
#[test]
fn cupy_round_size() {
    for mode in MODES {
        let d = device(ByteSize::mib(64), mode);
        for (req, want) in [(UNIT - 1, UNIT), (UNIT, UNIT), (UNIT + 1, 2 * UNIT)] {
            let x = a(&d, req);
            assert_eq!(x.size, want, "{mode}: {req}");
            assert_eq!(x.requested, req, "{mode}");
            f(&d, x);
        }
    }
}

/// test_alloc: three live allocations have distinct, non-overlapping pointers.
#[test]
fn cupy_alloc() {
    for mode in MODES {
        let d = device(ByteSize::mib(64), mode);
        let v = vec![a(&d, UNIT * 4), a(&d, UNIT * 4), a(&d, UNIT * 8)];
        assert_no_overlap(v.clone(), mode);
        for x in v {
            f(&d, x);
        }
    }
}

/// test_alloc_split, adapted: the two halves come from the cached segment (no device call),
/// side by side; the freed block is still served at its exact size.
#[test]
fn cupy_alloc_split() {
    for mode in MODES {
        let d = device(ByteSize::mib(64), mode);
        let p = a(&d, UNIT * 4);
        let ptr = p.ptr;
        f(&d, p);
        let before = d.stats().num_device_alloc;
        let head = a(&d, UNIT * 2);
        let tail = a(&d, UNIT * 2);
        assert_eq!(tail.ptr, head.ptr + UNIT * 2, "{mode}");
        let whole = a(&d, UNIT * 4);
        assert_eq!(whole.ptr, ptr, "{mode}");
        assert_eq!(d.stats().num_device_alloc, before, "{mode}");
        assert_eq!(d.stats().segment.all.current, 1, "{mode}");
    }
}

/// test_free: a freed block is reused by a request of its size.
#[test]
fn cupy_free() {
    for mode in MODES {
        let d = device(ByteSize::mib(64), mode);
        let p1 = a(&d, UNIT * 4);
        let ptr1 = p1.ptr;
        f(&d, p1);
        let p2 = a(&d, UNIT * 4);
        assert_eq!(p2.ptr, ptr1, "{mode}");
        let before = d.stats().num_device_alloc;
        let p3 = a(&d, UNIT * 4);
        f(&d, p3);
        assert_eq!(
            d.stats().num_device_alloc,
            before,
            "{mode}: cache hit reached the device"
        );
    }
}

/// test_free_stream: a block freed on one stream is not handed to another stream.
#[test]
fn cupy_free_stream() {
    for mode in MODES {
        let d = device(ByteSize::mib(64), mode);
        let p1 = a(&d, UNIT * 4);
        let ptr1 = p1.ptr;
        f(&d, p1);
        let p2 = d.alloc_raw(UNIT * 4, 7).unwrap();
        assert_ne!(p2.ptr, ptr1, "{mode}");
        assert_eq!(p2.stream, 7);
    }
}

/// test_free_merge, adapted: on a small segment with no other free room, the freed halves merge
/// back and serve the 4-unit request at the first half's address, in either order of the
/// frees, without a device call. (The segment is filled first: a parked block merges only when
/// nothing else fits.)
#[test]
fn cupy_free_merge() {
    for mode in MODES {
        for tail_first in [true, false] {
            let d = device(ByteSize::mib(64), mode);
            let head = a(&d, UNIT * 2);
            let tail = a(&d, UNIT * 2);
            let ptr = head.ptr;
            assert_eq!(tail.ptr, ptr + UNIT * 2, "{mode}");
            let fill1 = a(&d, MIB);
            let fill2 = a(&d, MIB - 4 * UNIT);
            assert_eq!(
                d.stats().segment.all.current,
                1,
                "{mode}: not one small segment"
            );
            assert_eq!(free_bytes(&d), 0, "{mode}: the small segment is not full");
            if tail_first {
                f(&d, tail);
                f(&d, head);
            } else {
                f(&d, head);
                f(&d, tail);
            }
            let before = d.stats().num_device_alloc;
            let p = a(&d, UNIT * 4);
            assert_eq!(p.ptr, ptr, "{mode} tail_first={tail_first}");
            assert_eq!(d.stats().num_device_alloc, before, "{mode}");
            for x in [p, fill1, fill2] {
                f(&d, x);
            }
            d.allocator().check_invariants().unwrap();
        }
    }
}

/// test_free_different_size: a freed block smaller than the request is not handed out. In
/// native mode a request above 10 MiB gets a segment of its own size (rounded to 2 MiB), so the
/// freed 12 MiB block cannot hold 14 MiB.
#[test]
fn cupy_free_different_size_native() {
    let d = device(ByteSize::mib(256), NATIVE);
    let p1 = a(&d, 12 * MIB);
    let ptr1 = p1.ptr;
    f(&d, p1);
    let p2 = a(&d, 14 * MIB);
    assert_ne!(p2.ptr, ptr1);
    assert!(p2.size >= 14 * MIB);
}

/// test_free_all_blocks: after free_all_blocks, the next request takes fresh device memory.
#[test]
fn cupy_free_all_blocks() {
    for mode in MODES {
        let d = device(ByteSize::mib(64), mode);
        let p1 = a(&d, UNIT * 4);
        f(&d, p1);
        d.empty_cache().unwrap();
        assert_eq!(total(&d), 0, "{mode}");
        assert_eq!(n_free_blocks(&d), 0, "{mode}");
        let before = d.stats().num_device_alloc;
        let p2 = a(&d, UNIT * 4);
        assert!(
            d.stats().num_device_alloc > before,
            "{mode}: served from a released block"
        );
        f(&d, p2);
    }
}

/// test_free_all_blocks_split: free_all_blocks does not free a segment that is split with a
/// live part; the cached free part still serves requests afterwards, with no device call.
/// (CuPy asserts the request lands on the freed tail; here the parked blocks are merged by
/// `empty_cache` and best fit may pick another free block of the same segment.)
#[test]
fn cupy_free_all_blocks_split() {
    for mode in MODES {
        let d = device(ByteSize::mib(64), mode);
        let p = a(&d, UNIT * 4);
        f(&d, p);
        let head = a(&d, UNIT * 2);
        let tail = a(&d, UNIT * 2);
        let reserved = total(&d);
        f(&d, tail);
        d.empty_cache().unwrap();
        assert_eq!(total(&d), reserved, "{mode}: a split segment was released");
        assert_eq!(d.stats().segment.all.current, 1, "{mode}");
        let before = d.stats().num_device_alloc;
        let p = a(&d, UNIT * 2);
        assert_eq!(d.stats().num_device_alloc, before, "{mode}");
        let seg = &d.snapshot()[0];
        assert!(
            p.ptr >= seg.base && p.ptr + p.size <= seg.base + seg.size,
            "{mode}"
        );
        f(&d, p);
        f(&d, head);
    }
}

/// test_free_all_blocks_all_streams: free_all_blocks releases the free blocks of every stream.
#[test]
fn cupy_free_all_blocks_all_streams() {
    for mode in MODES {
        let d = device(ByteSize::mib(64), mode);
        let p1 = a(&d, UNIT * 4);
        f(&d, p1);
        let p2 = d.alloc_raw(UNIT * 4, 7).unwrap();
        f(&d, p2);
        assert_eq!(
            d.stats().segment.all.current,
            2,
            "{mode}: one segment per stream"
        );
        d.empty_cache().unwrap();
        assert_eq!(total(&d), 0, "{mode}");
        assert_eq!(d.stats().segment.all.current, 0, "{mode}");
        let before = d.stats().num_device_alloc;
        let p3 = a(&d, UNIT * 4);
        let p4 = d.alloc_raw(UNIT * 4, 7).unwrap();
        assert!(d.stats().num_device_alloc >= before + 2, "{mode}");
        assert_ne!(p3.ptr, p4.ptr);
    }
}

/// test_used_bytes: exactly the rounded bytes of live allocations.
#[test]
fn cupy_used_bytes() {
    for mode in MODES {
        let d = device(ByteSize::mib(64), mode);
        let p1 = a(&d, UNIT * 2);
        assert_eq!(used(&d), UNIT * 2, "{mode}");
        let p2 = a(&d, UNIT * 4);
        assert_eq!(used(&d), UNIT * 6, "{mode}");
        f(&d, p2);
        assert_eq!(used(&d), UNIT * 2, "{mode}");
        f(&d, p1);
        assert_eq!(used(&d), 0, "{mode}");
        let p3 = a(&d, UNIT);
        assert_eq!(used(&d), UNIT, "{mode}");
        f(&d, p3);
    }
}

/// test_free_bytes / test_total_bytes: total never drops on a free, used + free == total at
/// every step, free grows by what is freed, total is 0 after free_all_blocks. (CuPy's figures
/// themselves are in 512-byte chunks taken from the device one by one; oomguard takes 2 MiB
/// segments, PyTorch's rule.)
#[test]
fn cupy_free_bytes_and_total_bytes() {
    for mode in MODES {
        let d = device(ByteSize::mib(64), mode);
        let check = |d: &Device| assert_eq!(used(d) + free_bytes(d), total(d), "{mode}");
        let p1 = a(&d, UNIT * 2);
        check(&d);
        let t1 = total(&d);
        assert!(t1 >= UNIT * 2, "{mode}");
        let p2 = a(&d, UNIT * 4);
        check(&d);
        let t2 = total(&d);
        let fb = free_bytes(&d);
        f(&d, p1);
        check(&d);
        assert_eq!(total(&d), t2, "{mode}: total dropped on a free");
        assert_eq!(free_bytes(&d), fb + UNIT * 2, "{mode}");
        f(&d, p2);
        assert_eq!(total(&d), t2, "{mode}");
        assert_eq!(free_bytes(&d), t2, "{mode}");
        let p3 = a(&d, UNIT);
        assert_eq!(total(&d), t2, "{mode}: a cached block was not reused");
        assert_eq!(free_bytes(&d), t2 - UNIT, "{mode}");
        check(&d);
        f(&d, p3);
        d.empty_cache().unwrap();
        assert_eq!(total(&d), 0, "{mode}");
        assert_eq!(free_bytes(&d), 0, "{mode}");
    }
}

/// test_used_bytes_stream / test_free_bytes_stream / test_total_bytes_stream: a request on
/// another stream does not reuse the free block of stream 0, so the pool grows and the free
/// block stays free.
#[test]
fn cupy_bytes_per_stream() {
    for mode in MODES {
        let d = device(ByteSize::mib(64), mode);
        let p1 = a(&d, UNIT * 4);
        f(&d, p1);
        let t0 = total(&d);
        let p2 = d.alloc_raw(UNIT * 2, 7).unwrap();
        assert_eq!(used(&d), UNIT * 2, "{mode}");
        assert!(total(&d) > t0, "{mode}: stream 7 reused stream 0's memory");
        assert_eq!(free_bytes(&d), total(&d) - UNIT * 2, "{mode}");
        f(&d, p2);
    }
}

/// test_get_limit / test_set_limit_size: no limit by default; the limit set is the limit read.
/// CuPy's `set_limit(size=0)` means "no limit", which is `set_memory_limit(None)` here.
#[test]
fn cupy_set_limit_size() {
    let d = device(ByteSize::gib(1), NATIVE);
    let al = d.allocator();
    assert_eq!(al.memory_limit(), None);
    assert_eq!(al.memory_fraction(), 1.0);
    al.set_memory_limit(Some(1024));
    assert_eq!(al.memory_limit(), Some(1024));
    al.set_memory_limit(Some(1 << 33));
    assert_eq!(al.memory_limit(), Some(1 << 33));
    al.set_memory_limit(None);
    assert_eq!(al.memory_limit(), None);
    // and with no limit, a request near the capacity is served
    let x = a(&d, 900 * MIB);
    f(&d, x);
}

/// test_set_limit_fraction: fraction 0.5 -> half the capacity, 1.0 -> the capacity; -1 and
/// 1.1 are refused (ValueError there, Err here) and leave the limit as it was.
#[test]
fn cupy_set_limit_fraction() {
    let d = device(ByteSize::gib(1), NATIVE);
    let al = d.allocator();
    let tot = d.mem_info().unwrap().total;
    al.set_memory_fraction(0.5).unwrap();
    assert_eq!(al.memory_limit(), Some(tot / 2));
    assert_eq!(al.memory_fraction(), 0.5);
    al.set_memory_fraction(1.0).unwrap();
    assert_eq!(al.memory_limit(), Some(tot));
    for bad in [-1.0, 1.1, f64::NAN] {
        let e = al.set_memory_fraction(bad).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{bad}: {e}");
        assert_eq!(
            al.memory_limit(),
            Some(tot),
            "a refused fraction changed the limit"
        );
    }
}

/// test_alloc_limit: under a limit the allocation that would pass it raises out-of-memory; after
/// the limit is raised the same request succeeds. Sizes are in MiB here, since the limit caps
/// reserved memory (segments, pages), not 512-byte chunks.
#[test]
fn cupy_alloc_limit() {
    // native: a request under the limit whose segment would pass it gets a segment of its own
    // size, so 5 MiB + 1 MiB fill a 6 MiB limit exactly (CuPy: 5 units + 1 unit of 6).
    // growable: pages of 2 MiB: 4 MiB + 2 MiB fill it.
    for (mode, first, second, third) in [
        (NATIVE, 5 * MIB, MIB, MIB),
        (GROWABLE, 4 * MIB, 2 * MIB, 2 * MIB),
    ] {
        let d = device(ByteSize::mib(64), mode);
        d.allocator().set_memory_limit(Some(6 * MIB));
        let p1 = a(&d, first);
        let p2 = a(&d, second);
        assert!(total(&d) <= 6 * MIB, "{mode}");
        let e = d.alloc_raw(third, 0).unwrap_err();
        assert!(e.is_oom(), "{mode}: {e}");
        let text = e.to_string();
        assert!(
            text.contains("limit"),
            "{mode}: the error does not name the limit: {text}"
        );
        assert!(
            text.contains("6.00 MiB"),
            "{mode}: the error does not give the limit: {text}"
        );
        // and succeeds once something is freed (CuPy: OutOfMemoryError, then fine after a free)
        f(&d, p2);
        let p2 = d.alloc_raw(second, 0).unwrap();
        d.allocator().set_memory_limit(Some(6 * MIB + third));
        let p3 = d.alloc_raw(third, 0).unwrap();
        assert!(total(&d) <= 6 * MIB + third, "{mode}");
        f(&d, p1);
        f(&d, p2);
        f(&d, p3);
        d.allocator().check_invariants().unwrap();
    }
}

// ======================================================================================
// CuPy: MemoryPool
// ======================================================================================

/// test_zero_size_alloc: malloc(0) is not pooled memory: a null handle, nothing taken.
#[test]
fn cupy_zero_size_alloc() {
    for mode in MODES {
        let d = device(ByteSize::mib(64), mode);
        let x = a(&d, 0);
        assert_eq!((x.ptr, x.size), (0, 0), "{mode}");
        assert_eq!(total(&d), 0, "{mode}");
        assert_eq!(d.stats().allocation.all.allocated, 0, "{mode}");
        f(&d, x);
        let b = d.alloc::<f32>(0).unwrap();
        assert!(b.is_empty());
        drop(b);
        assert_eq!(total(&d), 0, "{mode}");
    }
}

/// test_double_free: CuPy's `mem.free()` twice is harmless. oomguard refuses the second free
/// (a stale handle) with an error, and changes nothing.
#[test]
fn cupy_double_free() {
    for mode in MODES {
        let d = device(ByteSize::mib(64), mode);
        let x = a(&d, 1);
        f(&d, x);
        let before = d.stats();
        let e = d.free_raw(x).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{mode}: {e}");
        assert_eq!(d.stats(), before, "{mode}");
        d.allocator().check_invariants().unwrap();
    }
}

/// test_free_all_blocks (MemoryPool): after the free every byte of the pool is free and the
/// pool holds free blocks; free_all_blocks leaves none. (CuPy counts 0 free blocks while the
/// 1-byte allocation is live and 1 after its free; here the segment's remainder is one free
/// block while it is live, and after the free the parked 512-byte block is listed beside it: 2.)
#[test]
fn cupy_n_free_blocks() {
    for mode in MODES {
        let d = device(ByteSize::mib(64), mode);
        assert_eq!(n_free_blocks(&d), 0, "{mode}");
        let x = a(&d, 1);
        assert_eq!(n_free_blocks(&d), 1, "{mode}");
        f(&d, x);
        assert!(n_free_blocks(&d) >= 1, "{mode}");
        assert_eq!(free_bytes(&d), total(&d), "{mode}");
        d.empty_cache().unwrap();
        assert_eq!(n_free_blocks(&d), 0, "{mode}");
        assert_eq!(total(&d), 0, "{mode}");
    }
}

/// test_free_all_blocks_without_malloc, test_n_free_blocks_without_malloc, test_used_bytes,
/// test_free_bytes, test_total_bytes (MemoryPool): a fresh pool is empty.
#[test]
fn cupy_fresh_pool() {
    for mode in MODES {
        let d = device(ByteSize::mib(64), mode);
        d.empty_cache().unwrap();
        assert_eq!(n_free_blocks(&d), 0);
        assert_eq!((used(&d), free_bytes(&d), total(&d)), (0, 0, 0), "{mode}");
    }
}

/// TestAllocator.test_set_allocator: `arange(128, int64)` takes 1024 bytes, all of them used.
#[test]
fn cupy_set_allocator() {
    for mode in MODES {
        let d = device(ByteSize::mib(64), mode);
        let data: Vec<i64> = (0..128).collect();
        let arr = d.from_slice(&data).unwrap();
        assert_eq!(arr.allocation().size, 1024);
        assert_eq!(used(&d), 1024);
        assert_eq!(arr.to_vec().unwrap(), data);
        drop(arr);
        assert_eq!(used(&d), 0);
    }
}

/// test_reuse_between_thread / _same_stream / _different_stream: a block freed on one thread
/// is reused by another thread on the same stream, not on a different stream.
#[test]
fn cupy_reuse_between_thread() {
    for mode in MODES {
        for (s_main, s_sub, same) in [(0u64, 0u64, true), (5, 5, true), (5, 6, false)] {
            let d = device(ByteSize::mib(64), mode);
            let job = |d: &Device, s: u64| {
                let x = d.alloc_on::<i64>(16, s).unwrap();
                x.device_ptr()
            };
            let main_ptr = job(&d, s_main);
            let d2 = d.clone();
            let sub_ptr = std::thread::spawn(move || job(&d2, s_sub)).join().unwrap();
            assert_eq!(main_ptr == sub_ptr, same, "{mode} {s_main}/{s_sub}");
            // and back on the main thread, after the other thread exited
            let again = job(&d, s_sub);
            assert_eq!(again, sub_ptr, "{mode}: the exited thread's block was lost");
            assert_eq!(used(&d), 0);
            d.allocator().check_invariants().unwrap();
        }
    }
}

/// TestMallocAsync / TestMemoryAsyncPool: with `backend:cudaMallocAsync` the pool keeps
/// nothing: reserved follows allocated, a stream's allocation belongs to that stream.
#[test]
fn cupy_malloc_async_keeps_nothing() {
    let d = device(ByteSize::mib(64), "backend:cudaMallocAsync");
    let x = d.alloc_raw(100, 9).unwrap();
    assert_eq!(x.stream, 9);
    assert_eq!(total(&d), used(&d));
    f(&d, x);
    assert_eq!(total(&d), 0);
    let z = a(&d, 0);
    assert_eq!(z.ptr, 0);
    f(&d, z);
}

/// TestMemoryAsyncPool.test_free_all_blocks_large_chunk / test_interaction_with_CuPy_default_pool:
/// one pool caches 70 % of the device; another pool's 30 % request raises out-of-memory until the
/// first pool frees its blocks, then succeeds.
#[test]
fn cupy_two_pools_on_one_device() {
    for mode in MODES {
        let sim = Arc::new(SimDevice::address_only(ByteSize::mib(1000)));
        let cfg = AllocatorConfig::parse(mode).unwrap();
        let p1 = Device::from_arc(sim.clone(), cfg.clone());
        let p2 = Device::from_arc(sim.clone(), cfg);
        let x = a(&p1, 700 * MIB);
        f(&p1, x);
        let e = p2.alloc_raw(301 * MIB, 0).unwrap_err();
        assert!(e.is_oom(), "{mode}: {e}");
        let Error::Oom(o) = &e else { panic!() };
        assert!(o.device_free < 301 * MIB, "{mode}: {e}");
        assert_eq!(p2.stats().num_ooms, 1, "{mode}");
        p1.empty_cache().unwrap();
        let y = p2.alloc_raw(301 * MIB, 0).unwrap();
        f(&p2, y);
    }
}

// ======================================================================================
// TensorFlow BFC
// ======================================================================================

/// GPUBFCAllocatorTest.NoDups: 1023 allocations of 1..1023 bytes: no duplicates, no overlap;
/// num_allocs 1023, bytes in use = peak = the rounded sum; after freeing, in use 0, peak kept.
/// (TF rounds to 256 bytes: 654336; oomguard to 512: 785408.)
#[test]
fn tf_no_dups() {
    for mode in MODES {
        let d = device(ByteSize::gib(1), mode);
        let s = d.stats();
        assert_eq!(
            (
                s.allocation.all.allocated,
                used(&d),
                s.allocated_bytes.all.peak
            ),
            (0, 0, 0)
        );
        let ptrs: Vec<Allocation> = (1..1024).map(|s| a(&d, s)).collect();
        let want: u64 = (1..1024u64).map(|s| s.div_ceil(UNIT) * UNIT).sum();
        assert_eq!(want, 785408);
        let s = d.stats();
        assert_eq!(s.allocation.all.allocated, 1023, "{mode}");
        assert_eq!(s.allocated_bytes.all.current, want, "{mode}");
        assert_eq!(s.allocated_bytes.all.peak, want, "{mode}");
        assert_eq!(
            s.requested_bytes.all.current,
            (1..1024u64).sum::<u64>(),
            "{mode}"
        );
        assert_no_overlap(ptrs.clone(), mode);
        for x in ptrs {
            f(&d, x);
        }
        let s = d.stats();
        assert_eq!(s.allocation.all.allocated, 1023, "{mode}");
        assert_eq!(s.allocated_bytes.all.current, 0, "{mode}");
        assert_eq!(s.allocated_bytes.all.peak, want, "{mode}");
    }
}

/// GPUBFCAllocatorTest.AllocationsAndDeallocations: 255 random sizes in [100, 1 MiB], free
/// every other one, an out-of-memory request of limit + 1 that must not prevent later
/// allocations, 255 more; no duplicates, no overlap, and (added) every live buffer's data intact.
#[test]
fn tf_allocations_and_deallocations() {
    for mode in MODES {
        let d = device(ByteSize::gib(2), mode);
        d.allocator().set_memory_limit(Some(1 << 30));
        let mut rng = Rng(123 << 17 | 17);
        let size = |rng: &mut Rng| (rng.next() % MIB).clamp(100, MIB) as usize;
        let mut live = Vec::new();
        let mut tag = 0u8;
        for i in 1..256 {
            let n = size(&mut rng);
            tag = tag.wrapping_add(1);
            let b = d.from_slice(&vec![tag; n]).unwrap();
            if i % 2 == 0 {
                live.push((tag, b));
            }
        }
        let e = d.alloc_raw((1 << 30) + 1, 0).unwrap_err();
        assert!(e.is_oom(), "{mode}: {e}");
        for _ in 1..256 {
            let n = size(&mut rng);
            tag = tag.wrapping_add(1);
            live.push((tag, d.from_slice(&vec![tag; n]).unwrap()));
        }
        assert_no_overlap(live.iter().map(|(_, b)| *b.allocation()).collect(), mode);
        for (t, b) in &live {
            assert!(
                b.to_vec().unwrap().iter().all(|x| x == t),
                "{mode}: data overwritten"
            );
        }
        drop(live);
        assert_eq!(used(&d), 0);
        d.allocator().check_invariants().unwrap();
    }
}

/// GPUBFCAllocatorTest.ExerciseCoalescing: 1024 rounds of 4 KiB, 8 MiB, 16 KiB, 40 MiB allocated
/// and freed: no growth, num_allocs 4097, in use 0, peak the sum; afterwards the first request
/// lands where the very first one did.
#[test]
fn tf_exercise_coalescing() {
    for mode in MODES {
        let d = addr_device(ByteSize::gib(1), mode);
        let first = a(&d, 4096);
        f(&d, first);
        let s = d.stats();
        assert_eq!(s.allocation.all.allocated, 1, "{mode}");
        assert_eq!(
            (s.allocated_bytes.all.current, s.allocated_bytes.all.peak),
            (0, 4096)
        );
        let mut reserved_after_first = 0;
        for i in 0..1024 {
            let t1 = a(&d, 1024 * 4);
            let t2 = a(&d, 1048576 * 8);
            let t3 = a(&d, 2048 * 8);
            let t4 = a(&d, 10485760 * 4);
            for x in [t1, t2, t3, t4] {
                f(&d, x);
            }
            if i == 0 {
                reserved_after_first = total(&d);
            }
            assert_eq!(total(&d), reserved_after_first, "{mode}: grew in round {i}");
        }
        let s = d.stats();
        assert_eq!(s.allocation.all.allocated, 4097, "{mode}");
        assert_eq!(s.allocated_bytes.all.current, 0, "{mode}");
        assert_eq!(
            s.allocated_bytes.all.peak,
            1024 * 4 + 1048576 * 8 + 2048 * 8 + 10485760 * 4,
            "{mode}"
        );
        let after = a(&d, 4096);
        assert_eq!(after.ptr, first.ptr, "{mode}");
        f(&d, after);
    }
}

/// GPUBFCAllocatorTest.AllocateZeroBufSize: a zero-length allocation is null.
#[test]
fn tf_allocate_zero_buf_size() {
    for mode in MODES {
        let d = device(ByteSize::gib(1), mode);
        let b = d.alloc::<f32>(0).unwrap();
        assert_eq!(b.device_ptr(), 0, "{mode}");
        assert_eq!(d.stats().allocation.all.allocated, 0);
    }
}

/// GPUBFCAllocatorTest.AllocatedVsRequested: one f32: requested 4, allocated the rounded block
/// (256 in TF, 512 here).
#[test]
fn tf_allocated_vs_requested() {
    for mode in MODES {
        let d = device(ByteSize::gib(1), mode);
        let b = d.alloc::<f32>(1).unwrap();
        assert_eq!(b.allocation().requested, 4);
        assert_eq!(b.allocation().size, 512);
        let s = d.stats();
        assert_eq!(s.requested_bytes.all.current, 4);
        assert_eq!(s.allocated_bytes.all.current, 512);
        let snap = d.snapshot();
        let blk = snap
            .iter()
            .flat_map(|s| &s.blocks)
            .find(|x| x.addr == b.device_ptr())
            .unwrap();
        assert_eq!((blk.requested, blk.size), (4, 512), "{mode}");
    }
}

/// GPUBFCAllocatorTest.TestCustomMemoryLimit: with a 2 MiB limit, 64 floats succeed and 2 Mi
/// floats (8 MiB) fail; `bytes_limit` reads the limit.
#[test]
fn tf_custom_memory_limit() {
    for mode in MODES {
        let d = device(ByteSize::gib(1), mode);
        d.allocator().set_memory_limit(Some(2 * MIB));
        assert_eq!(d.allocator().memory_limit(), Some(2 * MIB));
        let first = d.alloc::<f32>(1 << 6).unwrap();
        let Err(e) = d.alloc::<f32>(2 << 20) else {
            panic!("{mode}: 8 MiB passed a 2 MiB limit");
        };
        assert!(e.is_oom(), "{mode}: {e}");
        assert!(e.to_string().contains("limit of 2.00 MiB"), "{mode}: {e}");
        assert!(total(&d) <= 2 * MIB, "{mode}");
        drop(first);
    }
}

/// GPUBFCAllocatorTest.AllocationsAndDeallocationsWithGrowth: 2 GiB limit, sizes up to 128 MiB
/// then up to 64 MiB, half freed in between: no duplicates, no overlap.
#[test]
fn tf_allocations_and_deallocations_with_growth() {
    for mode in MODES {
        let d = addr_device(ByteSize::gib(4), mode);
        d.allocator().set_memory_limit(Some(1 << 31));
        let mut rng = Rng(0x9E3779B97F4A7C15);
        let mut existing = Vec::new();
        for s in 1..10 {
            let n = (rng.next() % (1 << 27)).clamp(100, 1 << 27);
            let x = a(&d, n);
            if s % 2 == 0 {
                f(&d, x)
            } else {
                existing.push(x)
            }
        }
        for _ in 1..10 {
            let n = (rng.next() % (1 << 26)).clamp(100, 1 << 26);
            existing.push(a(&d, n));
        }
        assert_no_overlap(existing.clone(), mode);
        for x in existing {
            f(&d, x);
        }
        assert!(total(&d) <= 1 << 31);
        d.allocator().check_invariants().unwrap();
    }
}

/// GPUBFCAllocatorTest_SubAllocatorSpecific.VirtualAllocatorPromotesReuse (virtual memory) and
/// PhysicalAllocatorOomsFragmentation (plain device memory): under a 512 MiB limit, 128 × 4 MiB,
/// all but the last freed, then 508 MiB. TF's virtual-memory allocator serves it; TF's physical
/// one runs out of memory (the last block pins its region). oomguard serves it in both modes:
/// growable segments move pages, native mode releases every free cached segment on
/// out-of-memory and retries (PyTorch's rule), and the last block's segment is small.
#[test]
fn tf_allocator_promotes_reuse_under_a_limit() {
    for mode in MODES {
        let d = addr_device(ByteSize::gib(2), mode);
        d.allocator().set_memory_limit(Some(512 * MIB));
        let ptrs: Vec<Allocation> = (0..128).map(|_| a(&d, 4 * MIB)).collect();
        assert!(total(&d) <= 512 * MIB, "{mode}");
        let mut ptrs = ptrs.into_iter();
        for x in ptrs.by_ref().take(127) {
            f(&d, x);
        }
        let big = d.alloc_raw(512 * MIB - 4 * MIB, 0);
        assert!(big.is_ok(), "{mode}: {}", big.unwrap_err());
        assert!(total(&d) <= 512 * MIB, "{mode}");
    }
}

/// TestRegionDeallocation (physical): 128 × 4 MiB in several regions, all but the last freed,
/// DeallocateFreeRegions leaves one region and one free chunk. TestNoRegionDeallocation
/// (virtual): one region before and after.
#[test]
fn tf_region_deallocation() {
    for mode in MODES {
        let d = addr_device(ByteSize::gib(4), mode);
        d.allocator().set_memory_limit(Some(1 << 31));
        let ptrs: Vec<Allocation> = (0..128).map(|_| a(&d, 4 * MIB)).collect();
        let segs = d.stats().segment.all.current;
        if mode == NATIVE {
            assert!(segs > 1, "{mode}");
        } else {
            assert_eq!(segs, 1, "{mode}: one address range");
        }
        let last = *ptrs.last().unwrap();
        for x in ptrs.into_iter().take(127) {
            f(&d, x);
        }
        d.empty_cache().unwrap();
        assert_eq!(d.stats().segment.all.current, 1, "{mode}");
        let snap = d.snapshot();
        assert_eq!(snap.len(), 1, "{mode}");
        assert!(snap[0].blocks.iter().any(|b| b.addr == last.ptr), "{mode}");
        if mode == NATIVE {
            assert_eq!(total(&d), 20 * MIB, "{mode}: the last block's segment");
        } else {
            assert_eq!(total(&d), 4 * MIB, "{mode}: the last block's pages");
        }
        assert_eq!(used(&d), 4 * MIB);
        f(&d, last);
    }
}

/// tsl BFCAllocatorTest.GetAndClearMemoryStats: in use and peak after 1 KiB, 2 KiB, a free, and
/// ClearStats (the peak drops to what is in use).
#[test]
fn tf_get_and_clear_memory_stats() {
    for mode in MODES {
        let d = device(ByteSize::mib(256), mode);
        let cur_peak = |d: &Device| {
            let s = d.stats();
            (s.allocated_bytes.all.current, s.allocated_bytes.all.peak)
        };
        assert_eq!(cur_peak(&d), (0, 0));
        let p1 = a(&d, 1024);
        assert_eq!(cur_peak(&d), (1024, 1024));
        let p2 = a(&d, 2048);
        assert_eq!(cur_peak(&d), (3072, 3072));
        f(&d, p2);
        assert_eq!(cur_peak(&d), (1024, 3072));
        d.reset_peak_stats();
        assert_eq!(cur_peak(&d), (1024, 1024), "{mode}");
        f(&d, p1);
    }
}

/// BFCAllocator::ClearStats also zeroes num_allocs: reset_accumulated_memory_stats does that
/// for the totals, and keeps what is in use.
#[test]
fn tf_clear_stats_num_allocs() {
    for mode in MODES {
        let d = device(ByteSize::mib(256), mode);
        let keep = a(&d, 1024);
        for _ in 0..10 {
            let x = a(&d, 4096);
            f(&d, x);
        }
        assert_eq!(d.stats().allocation.all.allocated, 11);
        d.reset_accumulated_memory_stats();
        d.reset_peak_stats();
        let s = d.stats();
        assert_eq!(s.allocation.all.allocated, 0, "{mode}");
        assert_eq!(s.allocation.all.current, 1, "{mode}");
        assert_eq!(s.allocated_bytes.all.current, 1024, "{mode}");
        assert_eq!(s.allocated_bytes.all.peak, 1024, "{mode}");
        let x = a(&d, 8192);
        assert_eq!(d.stats().allocation.all.allocated, 1);
        assert_eq!(d.stats().allocated_bytes.all.peak, 1024 + 8192);
        f(&d, x);
        f(&d, keep);
    }
}

/// GPUBFCAllocatorPrivateMethodsTest.BinDebugInfo, through the snapshot: two allocations each
/// of 256 << i (i < 5): the allocated blocks, their requested and allocated sizes; after
/// freeing one of each pair, what is in use.
#[test]
fn tf_bin_debug_info() {
    for mode in MODES {
        let d = device(ByteSize::gib(1), mode);
        let mut ptrs = Vec::new();
        for i in 0..5 {
            for _ in 0..2 {
                ptrs.push(a(&d, 256 << i));
            }
        }
        let allocated = |d: &Device| {
            let mut v: Vec<(u64, u64, u64)> = d
                .snapshot()
                .iter()
                .flat_map(|s| s.blocks.iter())
                .filter(|b| b.status == BlockStatus::Allocated)
                .map(|b| (b.addr, b.size, b.requested))
                .collect();
            v.sort();
            v
        };
        let mut want: Vec<(u64, u64, u64)> =
            ptrs.iter().map(|x| (x.ptr, x.size, x.requested)).collect();
        want.sort();
        assert_eq!(allocated(&d), want, "{mode}");
        let s = d.stats();
        assert_eq!(
            s.requested_bytes.all.current,
            (0..5).map(|i| 2 * (256u64 << i)).sum::<u64>()
        );
        let mut keep = Vec::new();
        for (k, x) in ptrs.into_iter().enumerate() {
            if k % 2 == 1 {
                f(&d, x)
            } else {
                keep.push(x)
            }
        }
        let mut want: Vec<(u64, u64, u64)> =
            keep.iter().map(|x| (x.ptr, x.size, x.requested)).collect();
        want.sort();
        assert_eq!(allocated(&d), want, "{mode}");
        assert_eq!(
            d.stats().requested_bytes.all.current,
            (0..5).map(|i| 256u64 << i).sum::<u64>()
        );
    }
}

/// tsl BFCAllocatorTest.ExtendTerminatesWhenSubAllocatorAlwaysFails: a device that refuses
/// every request gives out-of-memory after a bounded number of calls (no endless retry), and
/// allocations work again once it stops refusing.
#[test]
fn tf_extend_terminates_when_device_always_fails() {
    for mode in MODES {
        let sim = SimDevice::new(ByteSize::mib(64));
        let faults = sim.faults();
        let d = Device::new(sim.clone(), AllocatorConfig::parse(mode).unwrap());
        for op in [SimOp::AllocSegment, SimOp::Reserve, SimOp::Map] {
            faults.fail_ops_from(op, 0);
        }
        for bytes in [100, 4 * MIB, 30 * MIB] {
            let e = d.alloc_raw(bytes, 0).unwrap_err();
            assert!(e.is_oom(), "{mode}: {e}");
        }
        let calls: u64 = [SimOp::AllocSegment, SimOp::Reserve, SimOp::Map]
            .iter()
            .map(|&op| faults.op_calls(op))
            .sum();
        assert!(
            calls <= 3 * 4,
            "{mode}: {calls} device calls for 3 requests"
        );
        assert_eq!(d.stats().num_ooms, 3);
        faults.clear();
        let x = a(&d, 100);
        f(&d, x);
    }
}

/// tsl BFCAllocatorTest.DefaultAlignment / RespectsRequestedAlignment: every pointer is aligned
/// (oomguard takes no alignment argument; its blocks are 512-byte aligned).
#[test]
fn tf_alignment() {
    for mode in MODES {
        let d = device(ByteSize::mib(256), mode);
        let filler = a(&d, 256);
        let v: Vec<Allocation> = (0..64).map(|i| a(&d, 1 + i * 37)).collect();
        for x in &v {
            assert_eq!(x.ptr % 512, 0, "{mode}: {:#x}", x.ptr);
        }
        for x in v {
            f(&d, x);
        }
        f(&d, filler);
    }
}

/// tsl BFCAllocatorTest.StressAllocFree: 350 allocations of sizes {1 .. 8192} in random order,
/// freed in random order, 20 rounds; (added) each buffer's data checked before its free, and no
/// growth after the first round.
#[test]
fn tf_stress_alloc_free() {
    for mode in MODES {
        let d = device(ByteSize::mib(16), mode);
        let sizes = [1usize, 128, 256, 700, 1024, 4096, 8192];
        let mut specs: Vec<usize> = (0..50).flat_map(|_| sizes).collect();
        let mut rng = Rng(42);
        let mut reserved = 0;
        for iter in 0..20 {
            rng.shuffle(&mut specs);
            let mut bufs: Vec<(u8, oomguard_runtime::DeviceBuffer<u8>)> = specs
                .iter()
                .enumerate()
                .map(|(k, &n)| {
                    let t = (k as u8) ^ (iter as u8);
                    (t, d.from_slice(&vec![t; n]).unwrap())
                })
                .collect();
            rng.shuffle(&mut bufs);
            for (t, b) in bufs {
                assert!(
                    b.to_vec().unwrap().iter().all(|&x| x == t),
                    "{mode}: iter {iter}"
                );
            }
            if iter == 0 {
                reserved = total(&d);
            }
            assert_eq!(total(&d), reserved, "{mode}: grew in iteration {iter}");
        }
        assert_eq!(used(&d), 0);
        d.allocator().check_invariants().unwrap();
    }
}

/// tsl BFCAllocatorTest.SpatialUnderContention / BM_AllocationThreaded: 8 threads, 1000 rounds
/// of alloc + free each, never a failure; afterwards nothing in use and the state consistent.
#[test]
fn tf_contention() {
    for mode in MODES {
        let d = device(ByteSize::mib(64), mode);
        let sizes = [256u64, 4096, 16384, 524288, 512, 1048576];
        std::thread::scope(|s| {
            for t in 0..8 {
                let d = d.clone();
                s.spawn(move || {
                    for i in 0..1000 {
                        let x = d.alloc_raw(sizes[(i + t) % sizes.len()], 0).unwrap();
                        let y = d.alloc_raw(1024, 0).unwrap();
                        assert_eq!(x.ptr % 512, 0);
                        d.free_raw(x).unwrap();
                        d.free_raw(y).unwrap();
                    }
                });
            }
        });
        let s = d.stats();
        assert_eq!(s.allocated_bytes.all.current, 0, "{mode}");
        assert_eq!(s.allocation.all.allocated, 16000, "{mode}");
        assert_eq!(s.allocation.all.freed, 16000, "{mode}");
        assert_eq!(s.num_ooms, 0, "{mode}");
        d.allocator().check_invariants().unwrap();
        d.empty_cache().unwrap();
        assert_eq!(total(&d), 0, "{mode}");
    }
}

/// The same fragmentation under a memory limit (TF's test: a 20 MiB limit) on a card with room
/// to spare: the limit, not the device, is what is full, so the error compares the request with
/// the room the limit leaves (none), says the memory is fragmented, and names the limit as
/// PyTorch does ("20.00 MiB allowed;"). Before, it compared with the device's 44 MiB free and
/// said nothing of fragmentation.
#[test]
fn tf_fragmentation_under_a_memory_limit_is_fragmentation() {
    let d = addr_device(ByteSize::mib(64), NATIVE);
    d.allocator().set_memory_limit(Some(20 * MIB));
    let v: Vec<Allocation> = (0..5).map(|_| a(&d, 4 * MIB)).collect();
    assert_eq!(total(&d), 20 * MIB);
    f(&d, v[1]);
    f(&d, v[3]);
    let e = d.alloc_raw(6 * MIB, 0).unwrap_err();
    let Error::Oom(o) = &e else { panic!("{e}") };
    assert_eq!(o.memory_limit, Some(20 * MIB), "{e}");
    assert_eq!(o.device_free, 44 * MIB, "{e}");
    assert_eq!(o.room_to_grow(), 0, "{e}");
    assert_eq!(o.reserved_unallocated, 8 * MIB, "{e}");
    assert!(o.likely_fragmentation(), "{e}");
    let text = e.to_string();
    assert!(
        text.contains("of which 44.00 MiB is free. 20.00 MiB allowed;"),
        "{text}"
    );
    assert!(
        text.contains("The room under the memory limit and reserved"),
        "{text}"
    );
    assert!(text.contains("memory is fragmented"), "{text}");
    // a request larger than the limit's room and every free byte is not fragmentation
    let big = d.alloc_raw(9 * MIB, 0).unwrap_err();
    let Error::Oom(o) = &big else { panic!("{big}") };
    assert!(!o.likely_fragmentation(), "{big}");
    assert!(!big.to_string().contains("fragmented"), "{big}");
    for i in [0, 2, 4] {
        f(&d, v[i]);
    }
    d.allocator().check_invariants().unwrap();
}

/// A fragmentation experiment (the idea of PhysicalAllocatorOomsFragmentation, on a full card):
/// a 20 MiB card holding five 4 MiB blocks in one segment, two of them freed (8 MiB free, in
/// two holes). A 6 MiB request: native mode runs out of memory and the error says the memory is
/// fragmented; growable segments move the holes' pages and serve it. Freeing the rest serves it
/// in both.
#[test]
fn tf_fragmentation_experiment() {
    for mode in MODES {
        let d = addr_device(ByteSize::mib(20), mode);
        let v: Vec<Allocation> = (0..5).map(|_| a(&d, 4 * MIB)).collect();
        assert_eq!(total(&d), 20 * MIB, "{mode}");
        f(&d, v[1]);
        f(&d, v[3]);
        let r = d.alloc_raw(6 * MIB, 0);
        if mode == NATIVE {
            let e = r.unwrap_err();
            let Error::Oom(o) = &e else { panic!("{e}") };
            assert!(o.likely_fragmentation(), "{e}");
            assert_eq!(o.reserved_unallocated, 8 * MIB, "{e}");
            assert_eq!(o.largest_free_block, 4 * MIB, "{e}");
            assert!(e.to_string().contains("fragmented"), "{e}");
            for &i in &[0, 2, 4] {
                f(&d, v[i]);
            }
            let x = d.alloc_raw(6 * MIB, 0).unwrap();
            f(&d, x);
        } else {
            let x = r.unwrap_or_else(|e| panic!("{mode}: {e}"));
            f(&d, x);
            for &i in &[0, 2, 4] {
                f(&d, v[i]);
            }
        }
        d.allocator().check_invariants().unwrap();
    }
}

/// AllocationsAndDeallocations' out-of-memory, without a limit: a request larger than the card
/// fails, says so, counts one OOM, and later allocations succeed; the allocator state is sound.
#[test]
fn tf_huge_request_then_allocations_work() {
    for mode in MODES {
        let d = device(ByteSize::mib(256), mode);
        let keep = a(&d, 3 * MIB);
        for huge in [257 * MIB, 1 << 40, u64::MAX / 2] {
            let e = d.alloc_raw(huge, 0).unwrap_err();
            assert!(e.is_oom(), "{mode} {huge}: {e}");
        }
        assert_eq!(d.stats().num_ooms, 3, "{mode}");
        let x = a(&d, 100 * MIB);
        f(&d, x);
        f(&d, keep);
        d.allocator().check_invariants().unwrap();
    }
}

/// CachingAllocator directly (the API under Device): CuPy's test_free and test_used_bytes.
#[test]
fn cupy_basics_on_the_caching_allocator() {
    let al = CachingAllocator::new(
        Arc::new(SimDevice::address_only(ByteSize::mib(64))),
        AllocatorConfig::native(),
    );
    let p = al.allocate(UNIT * 4, 0).unwrap();
    let ptr = p.ptr;
    al.free(p).unwrap();
    let q = al.allocate(UNIT * 4, 0).unwrap();
    assert_eq!(q.ptr, ptr);
    let r = al.allocate(UNIT * 2, 0).unwrap();
    assert_eq!(al.stats().allocated_bytes.all.current, UNIT * 6);
    al.free(q).unwrap();
    al.free(r).unwrap();
    assert_eq!(al.stats().allocated_bytes.all.current, 0);
}

/// TF's BFC with allow_growth=false takes its whole region up front (ForceAllowGrowth's
/// `curr_region_allocation_bytes_`); oomguard's counterpart is `reserve_initial`, whose doc
/// says "the cache is emptied and the segment tried again if the device refuses it". After
/// blocks were allocated and freed (cached, nothing live), a reservation of what the device
/// holds must succeed, as it does after an explicit `empty_cache`.
#[test]
fn tf_preallocation_after_cached_frees() {
    let cases: [(&str, u64, u64); 2] = [
        // a small block freed: its 2 MiB segment is cached, the block parked
        ("small", 1, 4 * MIB),
        // a 20 MiB block freed: its segment is whole, the block parked (large_parked)
        ("large", 20 * MIB, 30 * MIB),
    ];
    for (what, block, cap) in cases {
        for explicit_empty in [true, false] {
            let d = Device::new(SimDevice::new(ByteSize(cap)), AllocatorConfig::native());
            let x = a(&d, block);
            f(&d, x);
            assert_eq!(used(&d), 0);
            if explicit_empty {
                d.empty_cache().unwrap();
            }
            let r = d.allocator().reserve_initial(cap);
            assert!(
                r.is_ok(),
                "{what}, empty_cache first: {explicit_empty}: {}",
                r.unwrap_err()
            );
        }
    }
}

/// The same with a block parked in a thread's cache (a second thread allocated once).
#[test]
fn tf_preallocation_after_cached_frees_two_threads() {
    let d = Device::new(SimDevice::new(ByteSize::mib(30)), AllocatorConfig::native());
    let d2 = d.clone();
    std::thread::spawn(move || {
        let y = d2.alloc_raw(512, 0).unwrap();
        d2.free_raw(y).unwrap();
    })
    .join()
    .unwrap();
    let x = a(&d, 12 * MIB);
    f(&d, x);
    assert_eq!(used(&d), 0);
    let r = d.allocator().reserve_initial(20 * MIB);
    assert!(r.is_ok(), "{}", r.unwrap_err());
}

/// AllocationsAndDeallocations' huge request, after a free: the out-of-memory error's figures
/// agree with the statistics at that moment (its "largest free block" is what `stats()` says).
#[test]
fn tf_huge_request_error_figures() {
    for mode in MODES {
        let d = device(ByteSize::mib(30), mode);
        let x = a(&d, 20 * MIB);
        f(&d, x);
        let s = d.stats();
        let e = d.alloc_raw(1 << 61, 0).unwrap_err();
        let Error::Oom(o) = &e else { panic!("{e}") };
        assert_eq!(
            o.reserved_unallocated, s.reserved_bytes.all.current,
            "{mode}"
        );
        assert_eq!(o.largest_free_block, s.largest_free_block, "{mode}: {e}");
    }
}
