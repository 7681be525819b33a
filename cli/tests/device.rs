//! `replay --device`: the simulated device run the way a GPU is (capacity as a memory limit)
//! agrees with the plain simulated device; without a driver `--device cuda:0` is one line and
//! exit 2; on a GPU (ignored here: `../shared/gpu/stage --test device`, then `bash .gpu/run`)
//! peak reserved and the smallest capacity of the three real traces agree with the simulated
//! device's within 1%.

mod common;

use std::process::Command;

use oomguard_cli::device::DeviceSpec;
use oomguard_cli::mincap::min_capacity_on;
use oomguard_cli::replay::{replay, ReplayOptions};
use oomguard_cli::{detect, Trace};
use oomguard_runtime::AllocatorConfig;

const TRACES: [&str; 3] = ["resnet50", "gpt2", "vit_b16"];
const CONFIGS: [&str; 2] = ["expandable_segments:False", "expandable_segments:True"];

fn load(name: &str) -> Trace {
    detect::read_trace(&common::traces_dir().join(format!("{name}.trace.csv"))).unwrap()
}

struct Figures {
    peak_reserved: u64,
    mincap: u64,
    calls: u64,
    device: String,
}

fn figures(trace: &Trace, config: &str, device: &DeviceSpec) -> Figures {
    let config = AllocatorConfig::parse(config).unwrap();
    let opts = ReplayOptions {
        config: config.clone(),
        device: device.clone(),
        ..Default::default()
    };
    let (r, _) = replay(trace, &opts, &mut |_| {});
    assert!(
        r.completed,
        "{device} {}: {:?}",
        r.config,
        r.failures.first()
    );
    let m = min_capacity_on(trace, &config, device, 0.001, &mut |_| {}).unwrap();
    Figures {
        peak_reserved: r.peak_reserved_bytes,
        mincap: m.min_capacity_bytes,
        calls: r.backend_calls.total(),
        device: r.device,
    }
}

fn rel(a: u64, b: u64) -> f64 {
    (a as f64 - b as f64).abs() / b as f64
}

/// Compares `device` with the simulated device on every trace and configuration; prints a table.
fn agree_with_sim(device: &DeviceSpec) {
    println!(
        "{:<9} {:<26} {:>15} {:>15} {:>8} {:>15} {:>15} {:>8} {:>7} {:>7}",
        "trace",
        "config",
        "reserved sim",
        "reserved dev",
        "diff",
        "mincap sim",
        "mincap dev",
        "diff",
        "calls s",
        "calls d"
    );
    let mut name = String::new();
    for t in TRACES {
        let trace = load(t);
        for c in CONFIGS {
            let s = figures(&trace, c, &DeviceSpec::Sim);
            let d = figures(&trace, c, device);
            name = d.device.clone();
            let (dr, dm) = (
                rel(d.peak_reserved, s.peak_reserved),
                rel(d.mincap, s.mincap),
            );
            println!(
                "{t:<9} {c:<26} {:>15} {:>15} {:>7.3}% {:>15} {:>15} {:>7.3}% {:>7} {:>7}",
                s.peak_reserved,
                d.peak_reserved,
                100.0 * dr,
                s.mincap,
                d.mincap,
                100.0 * dm,
                s.calls,
                d.calls
            );
            assert!(dr <= 0.01, "{t} {c}: peak reserved differs by {dr}");
            assert!(dm <= 0.01, "{t} {c}: smallest capacity differs by {dm}");
        }
    }
    println!("device: {name}");
}

#[test]
fn sim_run_the_gpu_way_agrees_with_sim() {
    agree_with_sim(&DeviceSpec::SimLimit);
}

#[test]
fn cuda_without_a_driver_is_one_line_and_exit_2() {
    if oomguard_runtime::backend::cuda::driver_available() {
        eprintln!("a CUDA driver is present: see gpu_replay_agrees_with_the_simulated_device");
        return;
    }
    let trace = common::traces_dir().join("gpt2.trace.csv");
    for sub in ["replay", "mincap"] {
        let o = Command::new(env!("CARGO_BIN_EXE_oomguard"))
            .args([sub, &trace.display().to_string(), "--device", "cuda:0"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
        assert!(err.starts_with("oomguard: cuda:0: "), "{err}");
        assert!(err.contains("driver"), "{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_replay_agrees_with_the_simulated_device() {
    agree_with_sim(&DeviceSpec::Cuda(0));
}
