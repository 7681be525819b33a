//! Allocation latency: alloc+free pairs on a cache hit (512 B, 1 MiB, 64 MiB), the mixed workload
//! of ../shared/REFERENCE.md, and the same from 1, 2, 4, 8 and 16 threads at once (each thread
//! on its own stream, and all on one stream); beside the backend's own segment alloc+free
//! measured in the same run. Prints tables of ns per pair and ratios.
//!
//! With a CUDA driver present (the `cuda` feature, on by default) it also measures oomguard on GPU
//! 0 beside the driver's cuMemAlloc/cuMemFree and cuMemAllocAsync/cuMemFreeAsync (default memory
//! pool, release threshold raised to the maximum as in ../shared/REFERENCE.md), in the same run;
//! the thread table then has cuMemAllocAsync/cuMemFreeAsync from the same number of threads,
//! each on its own stream, as its baseline.
//!
//! `cargo bench -p oomguard-runtime --bench alloc` (`-- --single`: the single-thread tables only,
//! for alternating runs of two builds)

use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::time::Instant;

use oomguard_runtime::backend::StreamId;

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

/// What each thread of the scaling table does.
#[derive(Clone, Copy, Debug)]
enum Work {
    /// Alloc+free pairs of one size (cache hits after the first).
    Pair(u64),
    /// The mixed loop: 64 live blocks of 8 sizes, one freed and another allocated per pair.
    Mixed,
}

const WORKS: [(&str, Work); 4] = [
    ("512 B", Work::Pair(512)),
    ("1 MiB", Work::Pair(1 << 20)),
    ("64 MiB", Work::Pair(64 << 20)),
    ("mixed", Work::Mixed),
];

const THREADS: [usize; 5] = [1, 2, 4, 8, 16];

/// Runs `body(thread, stream)` on `threads` threads started together; wall nanoseconds from
/// the start until all are done, divided by `iters` (per pair per thread), best of 3 runs.
/// `setup` runs on each thread before the start (warm-up, live blocks) and hands its state to
/// `body`.
fn wall_per_pair<S>(
    threads: usize,
    iters: u64,
    setup: impl Fn(usize) -> S + Sync,
    body: impl Fn(&mut S, u64) + Sync,
    teardown: impl Fn(S) + Sync,
) -> f64 {
    (0..3)
        .map(|_| {
            let start = Barrier::new(threads + 1);
            let end = Barrier::new(threads + 1);
            std::thread::scope(|s| {
                for t in 0..threads {
                    let (start, end, setup, body, teardown) =
                        (&start, &end, &setup, &body, &teardown);
                    s.spawn(move || {
                        let mut state = setup(t);
                        start.wait();
                        for i in 0..iters {
                            body(&mut state, i);
                        }
                        end.wait();
                        teardown(state);
                    });
                }
                start.wait();
                let t0 = Instant::now();
                end.wait();
                t0.elapsed().as_nanos() as f64 / iters as f64
            })
        })
        .fold(f64::INFINITY, f64::min)
}

/// oomguard from `threads` threads: thread `t` on stream `streams[t]` (`streams` of length 1:
/// all on that stream).
fn scaling(
    a: &CachingAllocator,
    threads: usize,
    streams: &[StreamId],
    work: Work,
    iters: u64,
) -> f64 {
    let stream = |t: usize| streams[t % streams.len()];
    match work {
        Work::Pair(size) => wall_per_pair(
            threads,
            iters,
            |t| {
                let x = a.allocate(size, stream(t)).unwrap();
                a.free(x).unwrap();
                stream(t)
            },
            |&mut st, _| {
                let x = a.allocate(black_box(size), st).unwrap();
                a.free(black_box(x)).unwrap();
            },
            |_| {},
        ),
        Work::Mixed => wall_per_pair(
            threads,
            iters,
            |t| {
                let live: Vec<_> = (0..64)
                    .map(|k| a.allocate(SIZES[k % 8], stream(t)).unwrap())
                    .collect();
                (live, stream(t))
            },
            |(live, st), i| {
                let k = ((i * 37) % 64) as usize;
                a.free(live[k]).unwrap();
                live[k] = a.allocate(SIZES[(i as usize + k) % 8], *st).unwrap();
            },
            |(live, _)| {
                for x in live {
                    a.free(x).unwrap();
                }
            },
        ),
    }
}

/// The scaling table of a fresh allocator per cell: ns per pair per thread, each thread on its
/// own stream (`own`) and all on one stream, with the ratio to one thread. Returns the cells
/// (work, threads, own, one) for the GPU table's baseline ratios.
fn scaling_table(
    make: &dyn Fn() -> CachingAllocator,
    own_streams: &[StreamId],
    iters: u64,
) -> Vec<(usize, usize, f64, f64)> {
    println!(
        "{:<8} {:>8} {:>12} {:>10} {:>12} {:>10}",
        "workload", "threads", "own stream", "vs 1", "one stream", "vs 1"
    );
    let mut cells = Vec::new();
    for (w, (name, work)) in WORKS.iter().enumerate() {
        let (mut own1, mut one1) = (0.0, 0.0);
        for &n in &THREADS {
            let a = make();
            let own = scaling(&a, n, &own_streams[..n], *work, iters);
            drop(a);
            let a = make();
            let one = scaling(&a, n, &own_streams[..1], *work, iters);
            drop(a);
            if n == 1 {
                (own1, one1) = (own, one);
            }
            println!(
                "{name:<8} {n:>8} {own:>12.1} {:>9.2}x {one:>12.1} {:>9.2}x",
                own / own1,
                one / one1
            );
            cells.push((w, n, own, one));
        }
    }
    cells
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

    pub fn run(single_only: bool) {
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
        native.empty_cache().unwrap();
        expand.empty_cache().unwrap();
        growth(&native, &expand);
        if single_only {
            return;
        }

        // one stream per thread, registered with the backend (oomguard) and used raw (baseline)
        let backend = expand.cuda_backend().unwrap();
        let streams: Vec<_> = (0..16).map(|_| ctx.new_stream().unwrap()).collect();
        let ids: Vec<StreamId> = streams
            .iter()
            .map(|s| backend.register_stream(s).unwrap())
            .collect();
        let raw: Vec<usize> = streams.iter().map(|s| s.cu_stream() as usize).collect();
        println!(
            "\nThreads on {} (default configuration; ns per pair per thread, wall time; {} host cores)",
            expand.name(),
            std::thread::available_parallelism().map_or(1, |n| n.get())
        );
        let make = || CachingAllocator::new(expand.backend().clone(), AllocatorConfig::default());
        let cells = scaling_table(&make, &ids, 100_000);
        println!(
            "\n{:<8} {:>8} {:>16} {:>12} {:>14}",
            "workload", "threads", "cuMemAllocAsync", "own stream", "async/own"
        );
        for (w, n, own, _) in cells {
            let base = async_scaling(&ctx, n, &raw, WORKS[w].1);
            println!(
                "{:<8} {n:>8} {base:>16.1} {own:>12.1} {:>13.1}x",
                WORKS[w].0,
                base / own
            );
        }
        for s in &streams {
            s.synchronize().unwrap();
        }
    }

    /// What growing costs: 16 GiB taken from the device as one block and given back
    /// (`empty_cache`), under the native configuration (one cuMemAlloc / cuMemFree) and the
    /// default (a growable segment: a physical handle mapped per page, then unmapped): ms per
    /// round trip, best of 3, and the pages the default mapped.
    fn growth(native: &Device, expand: &Device) {
        const BYTES: u64 = 16 << 30;
        let round = |d: &Device| {
            (0..3)
                .map(|_| {
                    let t = Instant::now();
                    let a = d.allocator().allocate(BYTES, 0).unwrap();
                    let grown = t.elapsed().as_secs_f64() * 1e3;
                    d.allocator().free(a).unwrap();
                    let t = Instant::now();
                    d.empty_cache().unwrap();
                    (grown, t.elapsed().as_secs_f64() * 1e3)
                })
                .fold((f64::INFINITY, f64::INFINITY), |m, x| {
                    (m.0.min(x.0), m.1.min(x.1))
                })
        };
        let maps0 = expand.allocator().stats().num_map;
        let (n_take, n_give) = round(native);
        let (e_take, e_give) = round(expand);
        let pages = (expand.allocator().stats().num_map - maps0) / 3;
        println!(
            "\nGrowth by {} (ms, best of 3): native take {n_take:.2} give {n_give:.2}; \
             expandable take {e_take:.2} give {e_give:.2} ({pages} maps per round); \
             expandable/native take {:.1}x",
            ByteSize(BYTES),
            e_take / n_take
        );
    }

    /// cuMemAllocAsync/cuMemFreeAsync from `threads` threads, thread `t` on raw stream
    /// `streams[t]`: ns per pair per thread (wall).
    fn async_scaling(
        ctx: &std::sync::Arc<oomguard_runtime::cudarc::driver::CudaContext>,
        threads: usize,
        streams: &[usize],
        work: Work,
    ) -> f64 {
        let iters = 20_000;
        let stream = |t: usize| streams[t] as sys::CUstream;
        match work {
            Work::Pair(size) => wall_per_pair(
                threads,
                iters,
                |t| {
                    ctx.bind_to_thread().unwrap();
                    t
                },
                |&mut t, _| {
                    // SAFETY: the context is bound on this thread (setup); the pointer is freed
                    // right after on the same live stream, never used.
                    unsafe {
                        let p = result::malloc_async(stream(t), size as usize).unwrap();
                        result::free_async(p, stream(t)).unwrap();
                    }
                },
                |_| {},
            ),
            Work::Mixed => wall_per_pair(
                threads,
                iters,
                |t| {
                    ctx.bind_to_thread().unwrap();
                    // SAFETY: as above; every pointer is freed once, on its own stream.
                    let live: Vec<_> = (0..64)
                        .map(|k| unsafe {
                            result::malloc_async(stream(t), SIZES[k % 8] as usize).unwrap()
                        })
                        .collect();
                    (live, t)
                },
                |(live, t), i| {
                    let k = ((i * 37) % 64) as usize;
                    // SAFETY: as above.
                    unsafe {
                        result::free_async(live[k], stream(*t)).unwrap();
                        live[k] =
                            result::malloc_async(stream(*t), SIZES[(i as usize + k) % 8] as usize)
                                .unwrap();
                    }
                },
                |(live, t)| {
                    for p in live {
                        // SAFETY: as above.
                        unsafe { result::free_async(p, stream(t)).unwrap() };
                    }
                },
            ),
        }
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
    drop((native, expand));
    let single_only = std::env::args().any(|a| a == "--single");
    if !single_only {
        threads_sim(&sim);
    }
    #[cfg(feature = "cuda")]
    cuda::run(single_only);
}

/// The thread table on the simulated device.
fn threads_sim(sim: &SimDevice) {
    println!(
        "\nThreads, simulated device (default configuration; ns per pair per thread, wall time; \
         {} cores)",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    let streams: Vec<StreamId> = (1..=16).collect();
    let make = || CachingAllocator::new(Arc::new(sim.clone()), AllocatorConfig::default());
    scaling_table(&make, &streams, 50_000);
}
