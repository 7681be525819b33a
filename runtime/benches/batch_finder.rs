//! Batch-size search strategies on simulated models whose memory is linear in the batch.
//!
//! Compares oomguard's predictive `find_max_batch` with the anchors' strategies:
//! - halve from a start (toma),
//! - ×0.9 from a start (Accelerate `find_executable_batch_size`),
//! - double then bisect (Lightning `scale_batch_size(mode="binsearch")`, one step per trial),
//!
//! counting step runs (failed ones included) and the batch found over the true maximum.
//! Then `find_max_batch` and power + bisect on steps whose memory is monotone but not affine in
//! the batch (the shapes of tests/retry_finder_shapes.rs).
//! Run: `cargo bench -p oomguard-runtime --bench batch_finder`.

use oomguard_runtime::backend::sim::SimDevice;
use oomguard_runtime::retry::FinderReport;
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

type Shape = Box<dyn Fn(&Device, usize) -> Result<(), Error>>;

/// `rows × per_row`, plus a workspace of `small` bytes up to `at` rows and `large` above.
fn jump(per_row: usize, at: usize, small: usize, large: usize) -> Shape {
    Box::new(move |dev, rows| {
        let _a = dev.alloc::<u8>(rows * per_row)?;
        let _ws = dev.alloc::<u8>(if rows > at { large } else { small })?;
        Ok(())
    })
}

fn shapes() -> Vec<(String, Shape, u64)> {
    const M: usize = MIB as usize;
    let mut v: Vec<(String, Shape, u64)> = vec![
        (
            "quadratic, 2 GiB".into(),
            Box::new(|d, r| {
                let _l = d.alloc::<u8>(r * M)?;
                let _q = d.alloc::<u8>(r * r * 4096)?;
                Ok(())
            }),
            2048,
        ),
        (
            "quadratic small rows, 4 GiB".into(),
            Box::new(|d, r| {
                let _l = d.alloc::<u8>(r * 64 * 1024)?;
                let _q = d.alloc::<u8>(r * r * 512)?;
                Ok(())
            }),
            4096,
        ),
        (
            "bucketed by 64, 1000 MiB".into(),
            Box::new(|d, r| {
                let _a = d.alloc::<u8>(r.div_ceil(64) * 64 * M)?;
                Ok(())
            }),
            1000,
        ),
        (
            "bucketed by 256, 4000 MiB".into(),
            Box::new(|d, r| {
                let _a = d.alloc::<u8>(r.div_ceil(256) * 256 * M / 8)?;
                let _w = d.alloc::<u8>(100 * M)?;
                Ok(())
            }),
            4000,
        ),
        (
            "bucketed by 2^k, 4000 MiB".into(),
            Box::new(|d, r| {
                let _a = d.alloc::<u8>(r.next_power_of_two() * M / 4)?;
                Ok(())
            }),
            4000,
        ),
        (
            "concave (sqrt), 4000 MiB".into(),
            Box::new(|d, r| {
                let _a = d.alloc::<u8>(((r as f64).sqrt() * 16.0 * M as f64) as usize)?;
                Ok(())
            }),
            4000,
        ),
        (
            "staircase of workspaces, 4000 MiB".into(),
            Box::new(|d, r| {
                let _a = d.alloc::<u8>(r * M / 2)?;
                let _w = d.alloc::<u8>((r / 500 + 1) * 300 * M)?;
                Ok(())
            }),
            4000,
        ),
    ];
    for at in [10, 300] {
        v.push((
            format!("jump +25% at {at}, 1 GiB"),
            jump(M / 4, at, M, 256 * M),
            1024,
        ));
    }
    for at in [64, 150, 300, 450] {
        v.push((
            format!("jump +900 MiB at {at}, 1 GiB"),
            jump(M, at, M, 900 * M),
            1024,
        ));
    }
    for at in [10, 64, 400, 1600] {
        v.push((
            format!("jump +2000 MiB at {at}, 1 GiB"),
            jump(M / 4, at, M, 2000 * M),
            1024,
        ));
    }
    v
}

/// The largest batch that runs (binary search, not counted).
fn shape_max(dev: &Device, step: &Shape) -> usize {
    let ok = |rows: usize| {
        let r = step(dev, rows).is_ok();
        dev.empty_cache().expect("empty_cache");
        r
    };
    let (mut lo, mut hi) = (0usize, 1usize);
    while ok(hi) {
        lo = hi;
        hi *= 2;
    }
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if ok(mid) {
            lo = mid
        } else {
            hi = mid
        }
    }
    lo
}

fn shapes_table() {
    println!(
        "{:<34} {:>6}  {:>14}  {:>14}",
        "monotone step", "max", "find_max_batch", "power+bisect"
    );
    for (name, step, mib) in shapes() {
        let dev = Device::new(
            SimDevice::address_only(ByteSize::mib(mib)),
            AllocatorConfig::default(),
        );
        let truth = shape_max(&dev, &step);
        let r: FinderReport =
            find_max_batch(&dev, FinderOptions::default(), |rows| step(&dev, rows))
                .expect("finder");
        // Lightning's doubling then bisection, step runs counted.
        let (mut runs, mut low, mut high, mut size) = (0usize, 0usize, usize::MAX, 2usize);
        for _ in 0..25 {
            runs += 1;
            let ok = step(&dev, size).is_ok();
            dev.empty_cache().expect("empty_cache");
            if ok {
                low = size;
            } else {
                high = size;
            }
            if high != usize::MAX && high - low <= 1 {
                break;
            }
            size = if high == usize::MAX {
                size * 2
            } else {
                (low + high) / 2
            };
        }
        println!(
            "{name:<34} {truth:>6}  {:>5} / {:.3}  {:>5} / {:.3}",
            r.runs(),
            r.max_batch as f64 / truth as f64,
            runs,
            low as f64 / truth as f64
        );
    }
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
    shapes_table();
}
