//! `plain`: the framework's plain training loop at `--batch` (forward, backward, AdamW step),
//! each step timed from its first op to the device synchronised after it: `--warmup` steps
//! untimed, then the median (and min, max, mean) of `--steps` steps. Each step trains on its own
//! seeded batch, made before its clock starts. The memory source's peaks over the timed steps:
//! bytes in use and reserved (on CUDA the framework allocator's, as
//! `torch.cuda.max_memory_allocated` / `max_memory_reserved`; on the CPU the simulated card's
//! charge).
//!
//! Each step starts with the source's `mark_step` (oomguard's allocator lays out a step that
//! repeats the one before; other sources ignore it), counted inside the step's time. A `STEP`
//! line per step tells what the source did in it (`MemorySource::churn`: allocator retries,
//! unmap calls, bytes unmapped, synchronisations) and its reserved bytes after it; the `RESULT`
//! line sums the timed steps' churn.

use std::time::Instant;

use crate::bench::{Bench, Optim};
use crate::report::{median, Line};
use crate::runner::{Outcome, PhaseResult, Runner};

impl<B: Bench> Runner<B> {
    /// The phase (see the module's doc).
    pub fn plain(&mut self) -> PhaseResult {
        let batch = self.args.batch;
        let source = self.bench.source().clone();
        let mut sess = self
            .bench
            .session(Optim::AdamW)
            .map_err(|e| e.to_string())?;
        let (warmup, steps) = (self.args.warmup, self.args.steps);
        let mut times = Vec::with_capacity(steps);
        let mut losses = Vec::with_capacity(steps);
        let mut timed_churn = (0u64, 0u64, 0u64, 0u64);
        for s in 0..warmup + steps {
            if s == warmup {
                source.reset_peak().map_err(|e| e.to_string())?;
            }
            let tokens = self
                .bench
                .batch(batch, 100 + s as u64)
                .map_err(|e| e.to_string())?;
            let c0 = source.churn();
            let t = Instant::now();
            source.mark_step();
            let loss = self
                .bench
                .plain_step(&mut sess, &tokens)
                .map_err(|e| format!("plain step {} of batch {batch}: {e}", s + 1))?;
            let secs = t.elapsed().as_secs_f64();
            let c = source.churn();
            let moved = (
                c.alloc_retries - c0.alloc_retries,
                c.unmaps - c0.unmaps,
                c.unmapped_bytes - c0.unmapped_bytes,
                c.syncs - c0.syncs,
            );
            let reserved = source.usage().map_err(|e| e.to_string())?.reserved;
            self.emit(
                Line::step("plain")
                    .int("step", (s + 1) as i64)
                    .float("ms", secs * 1e3, 1)
                    .int("retries", moved.0 as i64)
                    .int("unmaps", moved.1 as i64)
                    .int("unmapped", moved.2 as i64)
                    .int("syncs", moved.3 as i64)
                    .int("reserved", reserved as i64),
            );
            if s >= warmup {
                times.push(secs);
                losses.push(loss);
                timed_churn.0 += moved.0;
                timed_churn.1 += moved.1;
                timed_churn.2 += moved.2;
                timed_churn.3 += moved.3;
            }
        }
        let mean = times.iter().sum::<f64>() / times.len() as f64;
        let (min, max) = times
            .iter()
            .fold((f64::INFINITY, 0f64), |(lo, hi), &t| (lo.min(t), hi.max(t)));
        let med = median(&mut times);
        let finite = losses.iter().all(|l| l.is_finite());
        let u = source.usage().map_err(|e| e.to_string())?;
        let line = Line::result("plain")
            .int("batch", batch)
            .int("warmup", warmup as i64)
            .int("steps", steps as i64)
            .float("median_ms", med * 1e3, 2)
            .float("min_ms", min * 1e3, 2)
            .float("max_ms", max * 1e3, 2)
            .float("mean_ms", mean * 1e3, 2)
            .float(
                "tokens_per_s",
                (batch * self.bench.row_len()) as f64 / med,
                1,
            )
            .float("loss_first", losses[0], 5)
            .float("loss_last", losses[losses.len() - 1], 5)
            .flag("losses_finite", finite)
            .int("timed_retries", timed_churn.0 as i64)
            .int("timed_unmaps", timed_churn.1 as i64)
            .int("timed_unmapped", timed_churn.2 as i64)
            .int("timed_syncs", timed_churn.3 as i64)
            .int("peak_used", u.used_peak as i64)
            .int("peak_reserved", u.reserved_peak as i64)
            .float(
                "reserved_over_used",
                u.reserved_peak as f64 / u.used_peak.max(1) as f64,
                4,
            )
            .text("source", source.info().to_string());
        self.emit(line);
        Ok(if finite { Outcome::Pass } else { Outcome::Fail })
    }
}
