//! `alloc`: the same model under libtorch's native caching allocator, under expandable
//! segments, and under oomguard's allocator (installed under libtorch). libtorch reads
//! `PYTORCH_ALLOC_CONF` once, when CUDA starts, and the allocator can be changed only before,
//! so each configuration needs its own process: `alloc` runs this program three times as a
//! child process with `--phase alloc-one` and the same options: with `PYTORCH_ALLOC_CONF` (and
//! the older `PYTORCH_CUDA_ALLOC_CONF`) removed, with
//! `PYTORCH_ALLOC_CONF=expandable_segments:True`, and with `--allocator oomguard` (oomguard's
//! default configuration; `OOMGUARD_ALLOC_CONF` is passed through); the children's lines are
//! printed as they come.
//!
//! `alloc-one` measures the allocator the process has, as its environment configured it (run it
//! by hand for another configuration): `--steps` timed plain steps at `--batch` (median
//! ms/step; peak reserved / peak used of the memory source), then the largest batch of a plain
//! step (bisection, as `max`, never taken from `--max`). On CUDA the line also says what
//! libtorch's allocator reports it runs (`allocator_info`: name, expandable segments, the
//! settings it parsed), so a variable that did not take effect shows.

use std::process::Command;
use std::time::Instant;

use oomguard_harness::{median, Line, Outcome, PhaseResult, Runner};
use oomguard_tch::cuda_allocator;

use crate::bench::TchBench;
use crate::plain_step::plain_step;

/// The configurations `alloc` compares: libtorch's `PYTORCH_ALLOC_CONF` (`None`: unset), and
/// whether oomguard's allocator serves instead.
const CONFIGS: [(Option<&str>, bool); 3] = [
    (None, false),
    (Some("expandable_segments:True"), false),
    (None, true),
];

/// The phase (see the module's doc): the child processes.
pub fn alloc(r: &mut Runner<TchBench>) -> PhaseResult {
    let exe = std::env::current_exe().map_err(|e| format!("this program's path: {e}"))?;
    // The same options, `--phase alloc-one` instead of the phases.
    let mut child_args = Vec::new();
    let mut raw = std::env::args().skip(1);
    while let Some(a) = raw.next() {
        if a == "--phase" || a == "--allocator" {
            raw.next();
        } else if !a.starts_with("--phase=") && !a.starts_with("--allocator=") {
            child_args.push(a);
        }
    }
    child_args.extend(["--phase".to_string(), "alloc-one".to_string()]);
    let mut pass = true;
    for (conf, oomguard) in CONFIGS {
        if oomguard && !r.bench.dev.is_cuda() {
            // oomguard's allocator serves libtorch's CUDA tensors only.
            r.emit(
                Line::step("alloc")
                    .text("alloc_conf", "oomguard")
                    .text("skipped", "cpu"),
            );
            continue;
        }
        let mut cmd = Command::new(&exe);
        if oomguard {
            cmd.args(["--allocator", "oomguard"]);
        }
        cmd.args(&child_args)
            .env_remove("PYTORCH_ALLOC_CONF")
            .env_remove("PYTORCH_CUDA_ALLOC_CONF");
        if let Some(c) = conf {
            cmd.env("PYTORCH_ALLOC_CONF", c);
        }
        let status = cmd
            .status()
            .map_err(|e| format!("starting {}: {e}", exe.display()))?;
        r.emit(
            Line::step("alloc")
                .text(
                    "alloc_conf",
                    if oomguard {
                        "oomguard"
                    } else {
                        conf.unwrap_or("native")
                    },
                )
                .text("child_exit", status.to_string()),
        );
        pass &= status.success();
    }
    Ok(if pass { Outcome::Pass } else { Outcome::Fail })
}

/// The child's measurement (see the module's doc).
pub fn alloc_one(r: &mut Runner<TchBench>) -> PhaseResult {
    let conf = if r.args.allocator == "oomguard" {
        format!(
            "oomguard:{}",
            std::env::var("OOMGUARD_ALLOC_CONF").unwrap_or_else(|_| "default".into())
        )
    } else {
        std::env::var("PYTORCH_ALLOC_CONF")
            .or_else(|_| std::env::var("PYTORCH_CUDA_ALLOC_CONF"))
            .unwrap_or_else(|_| "unset".into())
    };
    let source = r.bench.source.clone();
    let batch = r.args.batch;
    let b = &r.bench;
    let (vs, model) = b.model().map_err(|e| e.to_string())?;
    let mut opt = b.adamw(&vs).map_err(|e| e.to_string())?;
    let (warmup, steps) = (r.args.warmup, r.args.steps);
    let mut times = Vec::with_capacity(steps);
    for s in 0..warmup + steps {
        if s == warmup {
            source.reset_peak().map_err(|e| e.to_string())?;
        }
        let tokens = b.tokens(batch, 100 + s as u64).map_err(|e| e.to_string())?;
        let t = Instant::now();
        plain_step(&model, &mut opt, &tokens, b.dev, &b.charge)
            .map_err(|e| format!("plain step {} of batch {batch}: {e}", s + 1))?;
        if s >= warmup {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    let u = source.usage().map_err(|e| e.to_string())?;
    drop((opt, model, vs));
    source.empty_cache().map_err(|e| e.to_string())?;
    r.max = None;
    let max = r.known_max()?;
    let mut line = Line::result("alloc").text("alloc_conf", conf);
    let cuda = r.bench.dev.is_cuda();
    if cuda && r.args.allocator != "oomguard" {
        // What libtorch's allocator says it runs (the proof the variable took effect).
        let a = cuda_allocator::allocator_info().map_err(|e| e.to_string())?;
        line = line
            .text("allocator", a.name)
            .flag("expandable_segments", a.expandable_segments)
            .text(
                "settings",
                if a.settings.is_empty() {
                    "-".into()
                } else {
                    a.settings
                },
            );
    }
    r.emit(
        line.int("batch", batch)
            .int("steps", steps as i64)
            .float("median_ms", median(&mut times) * 1e3, 2)
            .int("peak_used", u.used_peak as i64)
            .int("peak_reserved", u.reserved_peak as i64)
            .float(
                "reserved_over_used",
                u.reserved_peak as f64 / u.used_peak.max(1) as f64,
                4,
            )
            .int("max_batch", max)
            // On the CPU the variable configures nothing: the figures are the simulated card's.
            .flag("cuda", cuda)
            .text("source", source.info().to_string()),
    );
    Ok(Outcome::Pass)
}
