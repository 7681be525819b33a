//! Overhead of the attribute macros when nothing fails: a plain function against the same
//! function under each attribute and under all four stacked, measured in the same run.
//!
//! `cargo bench --bench macros`

use std::hint::black_box;
use std::time::Instant;

use oomguard::{leak_check, memory_budget, no_grad, oom_retry, ByteSize, Device, Error};

fn plain(dev: &Device, n: usize) -> Result<usize, Error> {
    let b = dev.alloc::<u8>(black_box(n))?;
    Ok(b.len())
}

#[no_grad]
fn with_no_grad(dev: &Device, n: usize) -> Result<usize, Error> {
    let b = dev.alloc::<u8>(black_box(n))?;
    Ok(b.len())
}

#[memory_budget("1 GiB")]
fn with_budget(dev: &Device, n: usize) -> Result<usize, Error> {
    let b = dev.alloc::<u8>(black_box(n))?;
    Ok(b.len())
}

#[leak_check]
fn with_leak_check(dev: &Device, n: usize) -> Result<usize, Error> {
    let b = dev.alloc::<u8>(black_box(n))?;
    Ok(b.len())
}

#[oom_retry]
fn with_retry(dev: &Device, n: usize) -> Result<usize, Error> {
    let b = dev.alloc::<u8>(black_box(n))?;
    Ok(b.len())
}

#[oom_retry(batch = n)]
#[memory_budget("1 GiB")]
#[leak_check]
#[no_grad]
fn all_four(dev: &Device, n: usize) -> Result<usize, Error> {
    let b = dev.alloc::<u8>(black_box(n))?;
    Ok(b.len())
}

/// A benchmarked call.
type Call<'a> = &'a dyn Fn() -> Result<usize, Error>;

fn per_call(f: Call<'_>) -> f64 {
    let iters = 200_000;
    (0..5)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..iters {
                black_box(f().unwrap());
            }
            t.elapsed().as_nanos() as f64 / iters as f64
        })
        .fold(f64::INFINITY, f64::min)
}

fn main() {
    let dev = Device::sim(ByteSize::gib(8));
    let base = per_call(&|| plain(&dev, 512));
    println!("attribute overhead, simulated device, body = one 512 B alloc+free (ns per call)");
    println!("{:<24} {:>10} {:>12}", "function", "ns/call", "overhead");
    println!("{:<24} {base:>10.1} {:>12}", "plain", "-");
    let rows: [(&str, Call<'_>); 5] = [
        ("#[no_grad]", &|| with_no_grad(&dev, 512)),
        ("#[memory_budget]", &|| with_budget(&dev, 512)),
        ("#[leak_check]", &|| with_leak_check(&dev, 512)),
        ("#[oom_retry]", &|| with_retry(&dev, 512)),
        ("all four stacked", &|| all_four(&dev, 512)),
    ];
    for (name, f) in rows {
        let t = per_call(f);
        println!("{name:<24} {t:>10.1} {:>11.1} ", t - base);
    }
}
