//! Cost of the guards' accounting on the allocation path: a 512 B alloc+free pair on a cache hit
//! through the allocator directly, through `Device` with no guard open (the fast path: one
//! relaxed atomic load each way), with a guard open on another thread only, and inside a peak
//! scope and a budget (the recorded path). Prints ns per pair.
//!
//! `cargo bench -p oomguard-runtime --bench guards`

use std::hint::black_box;
use std::sync::mpsc;
use std::time::Instant;

use oomguard_runtime::{ByteSize, Device};

fn ns_per_pair(iters: u64, mut f: impl FnMut()) -> f64 {
    // best of 5 runs, to damp noise from other work on a shared machine
    (0..5)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..iters {
                f();
            }
            t.elapsed().as_nanos() as f64 / iters as f64
        })
        .fold(f64::INFINITY, f64::min)
}

fn main() {
    const N: u64 = 200_000;
    let dev = Device::sim(ByteSize::gib(8));
    let warm = dev.alloc_raw(512, 0).unwrap(); // warm the cache
    dev.free_raw(warm).unwrap();
    let a = dev.allocator();
    let direct = ns_per_pair(N, || {
        let x = a.allocate(black_box(512), 0).unwrap();
        a.free(black_box(x)).unwrap();
    });
    let pair = || {
        let x = dev.alloc_raw(black_box(512), 0).unwrap();
        dev.free_raw(black_box(x)).unwrap();
    };
    let no_guard = ns_per_pair(N, pair);
    let (tx, rx) = mpsc::channel::<()>();
    let (ready_tx, ready_rx) = mpsc::channel::<()>();
    let d2 = dev.clone();
    let other = std::thread::spawn(move || {
        let _p = d2.peak_scope();
        ready_tx.send(()).unwrap();
        let _ = rx.recv();
    });
    ready_rx.recv().unwrap();
    let other_thread = ns_per_pair(N, pair);
    drop(tx);
    other.join().unwrap();
    let in_peak = {
        let _p = dev.peak_scope();
        ns_per_pair(N, pair)
    };
    let in_budget = {
        let _b = dev.thread_budget(ByteSize::gib(1));
        ns_per_pair(N, pair)
    };
    println!("512 B alloc+free pair, cache hit (ns per pair)");
    println!("  allocator directly                  {direct:8.1}");
    println!("  Device, no guard open               {no_guard:8.1}");
    println!("  Device, a guard on another thread   {other_thread:8.1}");
    println!("  Device, inside a peak scope         {in_peak:8.1}");
    println!("  Device, inside a budget             {in_budget:8.1}");
}
