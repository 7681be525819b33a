//! Allocation latency: alloc+free pairs on a cache hit (512 B, 1 MiB, 64 MiB), the mixed workload
//! of ../shared/REFERENCE.md, and 8 threads at once; beside the backend's own segment alloc+free
//! measured in the same run. Prints a table of ns per pair and ratios.
//!
//! With a CUDA driver present (the `cuda` feature, on by default) it also measures oomguard on GPU
//! 0 beside the driver's cuMemAlloc/cuMemFree and cuMemAllocAsync/cuMemFreeAsync (default memory
//! pool, release threshold raised to the maximum as in ../shared/REFERENCE.md), in the same run.
//!
//! `cargo bench -p oomguard-runtime --bench alloc`

use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use oomguard_runtime::backend::sim::SimDevice;
use oomguard_runtime::backend::Backend;
use oomguard_runtime::{AllocatorConfig, ByteSize, CachingAllocator};

const SIZES: [u64; 8] = [
    512,
    4096,
    65536,
    1 << 20,
    3 << 20,
    8 << 20,
    24 << 20,
    100 << 10,
];

fn time_per_iter(iters: u64, mut f: impl FnMut(u64)) -> f64 {
    // best of 5 runs, to damp noise from the other builds on a shared machine
    (0..5)
        .map(|_| {
            let t = Instant::now();
            for i in 0..iters {
                f(i);
            }
            t.elapsed().as_nanos() as f64 / iters as f64
        })
        .fold(f64::INFINITY, f64::min)
}

fn pair(a: &CachingAllocator, size: u64) -> f64 {
    let warm = a.allocate(size, 0).unwrap();
    a.free(warm).unwrap();
    time_per_iter(200_000, |_| {
        let x = a.allocate(black_box(size), 0).unwrap();
        a.free(black_box(x)).unwrap();
    })
}

fn mixed(a: &CachingAllocator) -> f64 {
    let mut live: Vec<_> = (0..64)
        .map(|k| a.allocate(SIZES[k % 8], 0).unwrap())
        .collect();
    let t = time_per_iter(200_000, |i| {
        let k = ((i * 37) % 64) as usize;
        a.free(live[k]).unwrap();
        live[k] = a.allocate(SIZES[(i as usize + k) % 8], 0).unwrap();
    });
    for x in live {
        a.free(x).unwrap();
    }
    t
}

fn threaded(a: &Arc<CachingAllocator>, threads: usize) -> f64 {
    let iters = 100_000u64;
    let t = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                for i in 0..iters {
                    let x = a.allocate(SIZES[(i % 8) as usize], 0).unwrap();
                    a.free(black_box(x)).unwrap();
                }
            });
        }
    });
    // wall time per pair per thread
    t.elapsed().as_nanos() as f64 / iters as f64
}

#[cfg(feature = "cuda")]
mod cuda {
    //! The GPU half of the benchmark.
    #![allow(unsafe_code)]
    use super::*;
    use oomguard_runtime::cudarc::driver::{result, sys};
    use oomguard_runtime::Device;

    fn raw_sync(size: u64, iters: u64) -> f64 {
        time_per_iter(iters, |_| {
            // SAFETY: the context is current on this thread (bound in `run`); the pointer is
            // freed right after, never used.
            unsafe {
                let p = result::malloc_sync(size as usize).unwrap();
                result::free_sync(p).unwrap();
            }
        })
    }

    fn raw_async(stream: sys::CUstream, size: u64, iters: u64) -> f64 {
        time_per_iter(iters, |_| {
            // SAFETY: as above; allocation and free are ordered on the same live stream.
            unsafe {
                let p = result::malloc_async(stream, size as usize).unwrap();
                result::free_async(p, stream).unwrap();
            }
        })
    }

    fn raw_async_mixed(stream: sys::CUstream) -> f64 {
        // SAFETY: as above; every pointer is freed once, on the stream it was allocated on.
        unsafe {
            let mut live: Vec<_> = (0..64)
                .map(|k| result::malloc_async(stream, SIZES[k % 8] as usize).unwrap())
                .collect();
            let t = time_per_iter(100_000, |i| {
                let k = ((i * 37) % 64) as usize;
                result::free_async(live[k], stream).unwrap();
                live[k] =
                    result::malloc_async(stream, SIZES[(i as usize + k) % 8] as usize).unwrap();
            });
            for p in live {
                result::free_async(p, stream).unwrap();
            }
            t
        }
    }

    /// Raises the default pool's release threshold so freed memory stays cached in the pool.
    fn keep_pool_memory(ctx: &oomguard_runtime::cudarc::driver::CudaContext) {
        let mut pool = std::mem::MaybeUninit::uninit();
        let mut threshold = u64::MAX;
        // SAFETY: plain driver calls with valid out-pointers, on the current context's device.
        unsafe {
            sys::cuDeviceGetDefaultMemPool(pool.as_mut_ptr(), ctx.cu_device())
                .result()
                .unwrap();
            sys::cuMemPoolSetAttribute(
                pool.assume_init(),
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                &mut threshold as *mut u64 as *mut std::ffi::c_void,
            )
            .result()
            .unwrap();
        }
    }

    pub fn run() {
        if !oomguard_runtime::cuda::driver_available() {
            println!("\n(no CUDA driver: GPU rows skipped)");
            return;
        }
        let native = Device::cuda_with_config(0, AllocatorConfig::native()).unwrap();
        let expand = Device::cuda_with_config(0, AllocatorConfig::default()).unwrap();
        let ctx = native.cuda_context().unwrap();
        ctx.bind_to_thread().unwrap();
        keep_pool_memory(&ctx);
        let stream = ctx.new_stream().unwrap();
        let s = stream.cu_stream();
        println!(
            "\nGPU: {} (ns per alloc+free pair; lower is better)",
            native.name()
        );
        println!(
            "{:<10} {:>12} {:>14} {:>12} {:>12} {:>14} {:>14}",
            "workload",
            "cuMemAlloc",
            "cuMemAllocAsync",
            "native",
            "expandable",
            "async/native",
            "async/expand"
        );
        for (name, size) in [("512 B", 512u64), ("1 MiB", 1 << 20), ("64 MiB", 64 << 20)] {
            let sync = raw_sync(size, 2_000);
            let asy = raw_async(s, size, 100_000);
            let n = pair(native.allocator(), size);
            let e = pair(expand.allocator(), size);
            println!(
                "{name:<10} {sync:>12.1} {asy:>14.1} {n:>12.1} {e:>12.1} {:>13.1}x {:>13.1}x",
                asy / n,
                asy / e
            );
        }
        let asy = raw_async_mixed(s);
        let n = mixed(native.allocator());
        let e = mixed(expand.allocator());
        println!(
            "{:<10} {:>12} {asy:>14.1} {n:>12.1} {e:>12.1} {:>13.1}x {:>13.1}x",
            "mixed",
            "-",
            asy / n,
            asy / e
        );
        let na = std::sync::Arc::new(CachingAllocator::new(
            native.backend().clone(),
            AllocatorConfig::native(),
        ));
        let ea = std::sync::Arc::new(CachingAllocator::new(
            expand.backend().clone(),
            AllocatorConfig::default(),
        ));
        let (n8, e8) = (threaded(&na, 8), threaded(&ea, 8));
        println!(
            "{:<10} {:>12} {:>14} {n8:>12.1} {e8:>12.1}",
            "8 threads", "-", "-"
        );
        drop((na, ea));
        native.empty_cache().unwrap();
        expand.empty_cache().unwrap();
    }
}

fn main() {
    let sim = SimDevice::address_only(ByteSize::gib(80));
    let raw = |size: u64| {
        let size = size.next_multiple_of(512);
        time_per_iter(50_000, |_| {
            let p = sim.alloc_segment(black_box(size), 0).unwrap();
            sim.free_segment(p, size).unwrap();
        })
    };
    println!("oomguard allocator, simulated device (ns per alloc+free pair; lower is better)");
    println!(
        "{:<14} {:>12} {:>14} {:>14} {:>10}",
        "workload", "sim raw seg", "native", "expandable", "raw/exp"
    );
    let native = CachingAllocator::new(Arc::new(sim.clone()), AllocatorConfig::native());
    let expand = CachingAllocator::new(Arc::new(sim.clone()), AllocatorConfig::default());
    for (name, size) in [("512 B", 512u64), ("1 MiB", 1 << 20), ("64 MiB", 64 << 20)] {
        let r = raw(size);
        let n = pair(&native, size);
        let e = pair(&expand, size);
        println!("{name:<14} {r:>12.1} {n:>14.1} {e:>14.1} {:>9.1}x", r / e);
    }
    let n = mixed(&native);
    let e = mixed(&expand);
    println!(
        "{:<14} {:>12} {n:>14.1} {e:>14.1} {:>10}",
        "mixed", "-", "-"
    );
    let native = Arc::new(native);
    let expand = Arc::new(expand);
    let n1 = threaded(&native, 1);
    let e1 = threaded(&expand, 1);
    let n8 = threaded(&native, 8);
    let e8 = threaded(&expand, 8);
    println!(
        "{:<14} {:>12} {n1:>14.1} {e1:>14.1} {:>10}",
        "1 thread", "-", "-"
    );
    println!(
        "{:<14} {:>12} {n8:>14.1} {e8:>14.1} {:>10}",
        "8 threads", "-", "-"
    );
    println!(
        "(8 threads: wall time per pair per thread; machine has {} cores)",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    #[cfg(feature = "cuda")]
    cuda::run();
}
