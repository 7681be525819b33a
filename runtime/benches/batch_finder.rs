//! Batch-size search strategies on simulated models whose memory is linear in the batch.
//!
//! Compares oomguard's predictive `find_max_batch` with the anchors' strategies:
//! - halve from a start (toma),
//! - ×0.9 from a start (Accelerate `find_executable_batch_size`),
//! - double then bisect (Lightning `scale_batch_size(mode="binsearch")`, one step per trial),
//!
//! counting step runs (failed ones included) and the batch found over the true maximum.
//! Run: `cargo bench -p oomguard-runtime --bench batch_finder`.

use oomguard_runtime::backend::sim::SimDevice;
use oomguard_runtime::retry::{find_max_batch, FinderOptions};
use oomguard_runtime::{AllocatorConfig, ByteSize, Device, DeviceBuffer, Error};

const MIB: u64 = 1 << 20;

struct Model {
    name: &'static str,
    capacity: ByteSize,
    params: u64,
    layers: usize,
    act_per_row: u64,
    workspace: u64,
}

impl Model {
    fn device(&self) -> (Device, DeviceBuffer<u8>) {
        let dev = Device::new(
            SimDevice::address_only(self.capacity),
            AllocatorConfig::default(),
        );
        let weights = dev.alloc::<u8>(self.params as usize).expect("weights fit");
        (dev, weights)
    }
    fn step(&self, dev: &Device, rows: usize) -> Result<(), Error> {
        let mut acts = Vec::with_capacity(self.layers);
        for _ in 0..self.layers {
            acts.push(dev.alloc::<u8>((self.act_per_row * rows as u64) as usize)?);
        }
        let _grads = dev.alloc::<u8>(self.params as usize)?;
        let _ws = dev.alloc::<u8>(self.workspace as usize)?;
        Ok(())
    }
}

/// Counts step runs.
struct Counter<'a> {
    model: &'a Model,
    dev: &'a Device,
    runs: usize,
}

impl Counter<'_> {
    fn ok(&mut self, rows: usize) -> bool {
        self.runs += 1;
        let ok = self.model.step(self.dev, rows).is_ok();
        self.dev.empty_cache().expect("empty_cache");
        ok
    }
}

fn true_max(c: &mut Counter<'_>) -> usize {
    let (mut lo, mut hi) = (0usize, 1usize);
    while c.ok(hi) {
        lo = hi;
        hi *= 2;
    }
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if c.ok(mid) {
            lo = mid
        } else {
            hi = mid
        }
    }
    lo
}

fn halve(c: &mut Counter<'_>, start: usize) -> usize {
    let mut b = start;
    while b > 0 && !c.ok(b) {
        b /= 2;
    }
    b
}

fn times_09(c: &mut Counter<'_>, start: usize) -> usize {
    let mut b = start;
    while b > 0 && !c.ok(b) {
        b = (b as f64 * 0.9) as usize;
    }
    b
}

fn power_then_bisect(c: &mut Counter<'_>, init: usize, max_trials: usize) -> usize {
    // Lightning's _run_binary_scaling: double while it fits, then bisect.
    let (mut low, mut high) = (0usize, usize::MAX);
    let mut size = init;
    for _ in 0..max_trials {
        if c.ok(size) {
            low = size;
            if high == usize::MAX {
                size *= 2;
            } else {
                if high - low <= 1 {
                    break;
                }
                size = (low + high) / 2;
            }
        } else {
            high = size;
            if high - low <= 1 {
                break;
            }
            size = (low + high) / 2;
        }
    }
    low
}

fn main() {
    let models = [
        Model {
            name: "gpt2-like 80G",
            capacity: ByteSize::gib(80),
            params: 1024 * MIB,
            layers: 12,
            act_per_row: 60 * MIB,
            workspace: 512 * MIB,
        },
        Model {
            name: "resnet-like 24G",
            capacity: ByteSize::gib(24),
            params: 100 * MIB,
            layers: 50,
            act_per_row: 600 << 10,
            workspace: 64 * MIB,
        },
        Model {
            name: "mlp-like 8G",
            capacity: ByteSize::gib(8),
            params: 200 * MIB,
            layers: 4,
            act_per_row: 400 << 10,
            workspace: 8 * MIB,
        },
        Model {
            name: "bert-like 16G",
            capacity: ByteSize::gib(16),
            params: 1400 * MIB,
            layers: 24,
            act_per_row: 12 * MIB,
            workspace: 256 * MIB,
        },
    ];
    println!(
        "{:<16} {:>6}  {:<28} {:>5} {:>7} {:>9} {:>10}",
        "model", "max", "strategy", "runs", "found", "found/max", "time"
    );
    for m in &models {
        let (dev, _weights) = m.device();
        let truth = true_max(&mut Counter {
            model: m,
            dev: &dev,
            runs: 0,
        });
        let row = |name: &str, f: &mut dyn FnMut(&mut Counter<'_>) -> usize| {
            let mut c = Counter {
                model: m,
                dev: &dev,
                runs: 0,
            };
            let t0 = std::time::Instant::now();
            let found = f(&mut c);
            println!(
                "{:<16} {:>6}  {:<28} {:>5} {:>7} {:>9.3} {:>10.2?}",
                m.name,
                truth,
                name,
                c.runs,
                found,
                found as f64 / truth as f64,
                t0.elapsed()
            );
        };
        row("halve from 1024 (toma)", &mut |c| halve(c, 1024));
        row("x0.9 from 1024 (Accelerate)", &mut |c| times_09(c, 1024));
        row("power+bisect (Lightning)", &mut |c| {
            power_then_bisect(c, 2, 25)
        });
        row("find_max_batch (oomguard)", &mut |c| {
            let report = find_max_batch(c.dev, FinderOptions::default(), |rows| {
                c.runs += 1;
                c.model.step(c.dev, rows)
            })
            .expect("finder");
            report.max_batch
        });
        println!();
    }
}
