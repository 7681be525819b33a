//! Fragmentation benchmark: every real trace of `traces/` (and generated varying-shape traces)
//! replayed with `expandable_segments:False` and `:True`, our ratio and smallest capacity printed
//! beside PyTorch's own figures (read from `pytorch_figures.json` at run time).
//!
//! `cargo bench -p oomguard-cli --bench fragmentation` (reads the repository's `traces/`; set
//! `OOMGUARD_TRACES_DIR` to read other traces with a `pytorch_figures.json`).
//!
//! Columns: `res/live` = peak reserved / peak live bytes; `res/alloc` = peak reserved / peak
//! allocated (rounded) bytes, PyTorch's `reserved_over_allocated`; `mincap/live` = smallest
//! capacity that completes / peak live, PyTorch's `min_capacity_over_peak_live`; `seg+`, `map`:
//! backend calls; `Mev/s`: replay speed.

use std::path::PathBuf;

use oomguard_cli::gen::{generate, GenKind, GenSpec};
use oomguard_cli::mincap::min_capacity;
use oomguard_cli::replay::{replay, ReplayOptions};
use oomguard_cli::{detect, Trace};
use oomguard_runtime::AllocatorConfig;

fn traces_dir() -> Option<PathBuf> {
    if let Ok(d) = std::env::var("OOMGUARD_TRACES_DIR") {
        return Some(PathBuf::from(d));
    }
    let d = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../traces");
    d.join("pytorch_figures.json").exists().then_some(d)
}

fn row(name: &str, trace: &Trace, conf: &str, pytorch: Option<&serde_json::Value>) {
    let config = AllocatorConfig::parse(conf).expect("valid config");
    let opts = ReplayOptions {
        config: config.clone(),
        ..Default::default()
    };
    // Best of 3 for the speed column.
    let mut best = f64::MAX;
    let mut report = None;
    for _ in 0..3 {
        let (r, _) = replay(trace, &opts, &mut |_| {});
        best = best.min(r.seconds);
        report = Some(r);
    }
    let r = report.expect("replayed");
    let m = min_capacity(trace, &config, 0.001);
    let mincap = m
        .as_ref()
        .map(|m| format!("{:.4}", m.ratio))
        .unwrap_or_else(|e| format!("({e})"));
    let (pt_ratio, pt_mincap) = match pytorch {
        Some(p) => (
            format!(
                "{:.4}",
                p["reserved_over_allocated"].as_f64().unwrap_or(f64::NAN)
            ),
            format!(
                "{:.4}",
                p["min_capacity_over_peak_live"]
                    .as_f64()
                    .unwrap_or(f64::NAN)
            ),
        ),
        None => ("-".into(), "-".into()),
    };
    let b = r.backend_calls;
    println!(
        "{:<22} {:<6} {:>9.4} {:>9.4} {:>10} | {:>9} {:>10} | {:>6} {:>6} {:>6} {:>6} {:>4} | {:>7.2}{}",
        name,
        if config.expandable_segments { "True" } else { "False" },
        r.ratio,
        r.peak_reserved_bytes as f64 / r.peak_allocated_bytes.max(1) as f64,
        mincap,
        pt_ratio,
        pt_mincap,
        b.alloc_segment,
        b.free_segment,
        b.map,
        b.unmap,
        b.reserve,
        r.events as f64 / best / 1e6,
        if r.completed { "" } else { "  FAILED" },
    );
}

fn main() {
    println!(
        "{:<22} {:<6} {:>9} {:>9} {:>10} | {:>9} {:>10} | {:>6} {:>6} {:>6} {:>6} {:>4} | {:>7}",
        "trace",
        "expand",
        "res/live",
        "res/alloc",
        "mincap/liv",
        "pt r/a",
        "pt mincap",
        "seg+",
        "seg-",
        "map",
        "unmap",
        "rsv",
        "Mev/s"
    );
    match traces_dir() {
        Some(dir) => {
            let figs: serde_json::Value = serde_json::from_str(
                &std::fs::read_to_string(dir.join("pytorch_figures.json"))
                    .expect("read pytorch_figures.json"),
            )
            .expect("parse pytorch_figures.json");
            let traces = figs["traces"].as_object().cloned().unwrap_or_default();
            for (name, f) in &traces {
                let t = detect::read_trace(&dir.join(format!("{name}.trace.csv")))
                    .expect("read the trace");
                for (conf, key) in [
                    ("expandable_segments:False", "pytorch_native"),
                    ("expandable_segments:True", "pytorch_expandable_segments"),
                ] {
                    row(name, &t, conf, f.get(key));
                }
            }
            // This project's own capture (traces/README.md), with PyTorch's figures beside it.
            if let (Ok(t), Ok(text)) = (
                detect::read_trace(&dir.join("bert_infer.trace.csv")),
                std::fs::read_to_string(dir.join("bert_infer.figures.json")),
            ) {
                let f: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
                for (conf, key) in [
                    ("expandable_segments:False", "pytorch_native"),
                    ("expandable_segments:True", "pytorch_expandable_segments"),
                ] {
                    row("bert_infer", &t, conf, f.get(key));
                }
            }
            let snap = dir.join("resnet50.snapshot.pickle");
            if let Ok(t) = detect::read_trace(&snap) {
                let f = traces.get("resnet50");
                row(
                    "resnet50 (pickle)",
                    &t,
                    "expandable_segments:False",
                    f.map(|f| &f["pytorch_native"]),
                );
            }
        }
        None => {
            eprintln!("traces/pytorch_figures.json not found (set OOMGUARD_TRACES_DIR): generated traces only")
        }
    }
    for kind in [GenKind::Training, GenKind::Inference] {
        for seed in [1, 2] {
            let t = generate(&GenSpec::standard(kind, seed));
            let name = format!("gen {kind:?} s{seed}").to_lowercase();
            for conf in ["expandable_segments:False", "expandable_segments:True"] {
                row(&name, &t, conf, None);
            }
        }
    }
}
