//! `oom`: a batch of `--oom-factor` × the largest batch of a plain step (`max`), or
//! `--oom-batch`, which a plain step cannot run, through the guarded step from a fresh engine: step 1 meets a real
//! out-of-memory and survives it as micro-batches (its attempts are printed); steps 2 to
//! `--oom-steps` (4) start from the plan remembered, with no retry. Every step trains every row;
//! the losses and the parameters stay finite. A `STEP` line per step tells what the source did
//! in it (`MemorySource::churn`: allocator retries, unmap calls, bytes unmapped,
//! synchronisations; a step plan installed at the step's mark counts in its step), and the
//! `RESULT` line has the first step's seconds and the later steps' median.

use std::time::Instant;

use oomguard_runtime::retry::RetryEngine;

use crate::bench::{attempts_str, plan_str, Bench, Optim};
use crate::report::{median, Line};
use crate::runner::{Outcome, PhaseResult, Runner};

impl<B: Bench> Runner<B> {
    /// The phase (see the module's doc).
    pub fn oom(&mut self) -> PhaseResult {
        let (max, batch) = match self.args.oom_batch {
            // Not measured: `max` is the batch less one, as far as this phase knows.
            Some(b) => (self.max.unwrap_or(b - 1), b),
            None => {
                let max = self.known_max()?;
                (
                    max,
                    ((max as f64 * self.args.oom_factor).round() as i64).max(max + 1),
                )
            }
        };
        let source = self.bench.source().clone();
        source.empty_cache().map_err(|e| e.to_string())?;
        let mut s = self
            .bench
            .session(Optim::AdamW)
            .map_err(|e| e.to_string())?;
        let engine = RetryEngine::new();
        let mut reports = Vec::new();
        let mut losses = Vec::new();
        let mut all_rows = true;
        let mut secs_all = Vec::with_capacity(self.args.oom_steps);
        for step in 0..self.args.oom_steps as i64 {
            let b = self
                .bench
                .batch(batch, 700 + step as u64)
                .map_err(|e| e.to_string())?;
            source.reset_peak().map_err(|e| e.to_string())?;
            let c0 = source.churn();
            let t = Instant::now();
            let done = self
                .bench
                .guarded_step(&engine, &mut s, &b)
                .map_err(|e| format!("train_step, step {} of batch {batch}: {e}", step + 1))?;
            let secs = t.elapsed().as_secs_f64();
            let c = source.churn();
            secs_all.push(secs);
            let r = &done.report;
            let u = source.usage().map_err(|e| e.to_string())?;
            self.emit(
                Line::step("oom")
                    .int("step", step + 1)
                    .int("batch", batch)
                    .int("rows", done.rows as i64)
                    .float("loss", done.loss, 5)
                    .int("retries", r.retries() as i64)
                    .text("initial_plan", plan_str(&r.initial_plan))
                    .text("final_plan", plan_str(&r.final_plan))
                    .flag("from_memory", r.from_memory)
                    .text("attempts", attempts_str(r))
                    .float("secs", secs, 2)
                    .int("alloc_retries", (c.alloc_retries - c0.alloc_retries) as i64)
                    .int("unmaps", (c.unmaps - c0.unmaps) as i64)
                    .int("unmapped", (c.unmapped_bytes - c0.unmapped_bytes) as i64)
                    .int("syncs", (c.syncs - c0.syncs) as i64)
                    .int("peak_used", u.used_peak as i64)
                    .int("peak_reserved", u.reserved_peak as i64),
            );
            if step == 0 {
                self.print(r.to_string());
            }
            all_rows &= done.rows as i64 == batch;
            losses.push(done.loss);
            reports.push(done.report);
        }
        // what the source's allocator did with the steps (oomguard's: its step plans)
        for l in source
            .memory_summary()
            .lines()
            .filter(|l| l.contains("step plans"))
        {
            self.print(l.trim().to_string());
        }
        let first = &reports[0];
        let later_clean = reports[1..]
            .iter()
            .all(|r| r.retries() == 0 && r.from_memory && r.initial_plan == first.final_plan);
        let non_finite = self.bench.non_finite_params(&s)?;
        let finite_losses = losses.iter().all(|l| l.is_finite());
        let pass = first.retries() >= 1
            && first.final_plan.num_chunks() > 1
            && later_clean
            && all_rows
            && non_finite == 0
            && finite_losses;
        let line = Line::result("oom")
            .int("max", max)
            .int("batch", batch)
            .int("step1_retries", first.retries() as i64)
            .text("step1_final_plan", plan_str(&first.final_plan))
            .flag("later_steps_from_plan_no_retry", later_clean)
            .flag("every_row_trained", all_rows)
            .int("non_finite_params", non_finite)
            .text(
                "losses",
                losses
                    .iter()
                    .map(|l| format!("{l:.4}"))
                    .collect::<Vec<_>>()
                    .join(","),
            )
            .float("step1_secs", secs_all[0], 2)
            .float("later_median_secs", median(&mut secs_all[1..].to_vec()), 2)
            .flag("pass", pass);
        self.emit(line);
        Ok(if pass { Outcome::Pass } else { Outcome::Fail })
    }
}
