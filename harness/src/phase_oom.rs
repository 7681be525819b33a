//! `oom`: a batch of `--oom-factor` × the largest batch of a plain step (`max`), or
//! `--oom-batch`, which a plain step cannot run, through the guarded step from a fresh engine:
//! step 1 meets a real out-of-memory and survives it as micro-batches (its attempts are
//! printed); steps 2 to `--oom-steps` (4) start from the plan remembered, with no retry. Every
//! step trains every row; the losses and the parameters stay finite. A `STEP` line per step
//! tells what the source did in it (`MemorySource::churn`: allocator retries, unmap calls, bytes
//! unmapped, synchronisations; a step plan installed at the step's mark counts in its step), and
//! the `RESULT` line has the first step's seconds and the later steps' median.
//!
//! Then the candidate splits by hand, in the same run: for the settled plan's micro-batch, the
//! next coarser one (twice its rows, at most the batch) and the next finer one (half its rows),
//! plain steps at that many rows (the cache emptied first; [`SPLIT_WARMUP`] untimed, the median
//! of [`SPLIT_STEPS`]), times the plan's micro-batches (a `TRIAL` line each; `split_ms`: an upper
//! bound of the split run by hand when the last micro-batch is smaller; each has its own
//! optimizer step, which the guarded step runs once). `settled_over_fastest_split` is the median
//! of the later half of the guarded steps over the fastest split (NaN when none ran).
use std::time::Instant;

use oomguard_runtime::retry::{BatchPlan, RetryEngine};
use oomguard_runtime::IsOom;

use crate::bench::{attempts_str, plan_str, Bench, Optim};
use crate::report::{median, Line};
use crate::runner::{Outcome, PhaseResult, Runner};

/// Untimed plain steps before a split's timed ones.
pub const SPLIT_WARMUP: usize = 2;
/// Timed plain steps of a split (their median counts).
pub const SPLIT_STEPS: usize = 3;

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
        let settled_secs = median(&mut secs_all[secs_all.len() / 2..].to_vec());
        let splits = self.time_splits(&mut s, batch, &reports[reports.len() - 1].final_plan)?;
        let fastest = splits
            .iter()
            .filter_map(|&(_, ms)| ms)
            .fold(f64::INFINITY, f64::min);
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
            .float("settled_secs", settled_secs, 2)
            .text(
                "split_ms",
                splits
                    .iter()
                    .map(|(p, ms)| match ms {
                        Some(ms) => format!("{}:{ms:.1}", plan_str(p)),
                        None => format!("{}:oom", plan_str(p)),
                    })
                    .collect::<Vec<_>>()
                    .join(","),
            )
            // NaN when no split ran as plain steps (no fastest to compare with)
            .float(
                "settled_over_fastest_split",
                if fastest.is_finite() {
                    settled_secs * 1e3 / fastest
                } else {
                    f64::NAN
                },
                3,
            )
            .flag("pass", pass);
        self.emit(line);
        Ok(if pass { Outcome::Pass } else { Outcome::Fail })
    }

    /// The settled plan's split and its coarser and finer neighbours, timed by hand (see the
    /// module's doc): each plan with the milliseconds of its micro-batches as plain steps,
    /// `None` where a plain step of that many rows ran out of memory.
    fn time_splits(
        &mut self,
        s: &mut B::Session,
        batch: i64,
        settled: &BatchPlan,
    ) -> Result<Vec<(BatchPlan, Option<f64>)>, String> {
        let micro = settled.micro_batch();
        // the next coarser split (it may not fit: then it says so), the settled one, the next
        // finer one
        let mut rows = Vec::with_capacity(3);
        if micro < batch as usize {
            rows.push((2 * micro).min(batch as usize));
        }
        rows.push(micro);
        if micro > 1 {
            rows.push(micro.div_ceil(2));
        }
        let source = self.bench.source().clone();
        let mut out = Vec::with_capacity(rows.len());
        for m in rows {
            let plan = BatchPlan::with_micro_batch(batch as usize, m).map_err(|e| e.to_string())?;
            source.empty_cache().map_err(|e| e.to_string())?;
            let mut times = Vec::with_capacity(SPLIT_STEPS);
            let mut ran_out = false;
            for k in 0..SPLIT_WARMUP + SPLIT_STEPS {
                let b = self
                    .bench
                    .batch(m as i64, 900 + k as u64)
                    .map_err(|e| e.to_string())?;
                let t = Instant::now();
                match self.bench.plain_step(s, &b) {
                    Ok(_) if k >= SPLIT_WARMUP => times.push(t.elapsed().as_secs_f64() * 1e3),
                    Ok(_) => {}
                    Err(e) if e.is_oom() => {
                        ran_out = true;
                        break;
                    }
                    Err(e) => return Err(format!("a plain step of {m} rows: {e}")),
                }
            }
            let ms = (!ran_out).then(|| median(&mut times) * plan.num_chunks() as f64);
            let step = Line::trial("oom")
                .text("split", plan_str(&plan))
                .int("micro_batch", m as i64)
                .int("chunks", plan.num_chunks() as i64);
            self.emit(match ms {
                Some(ms) => step.float("ms", ms, 1),
                None => step.flag("out_of_memory", true),
            });
            out.push((plan, ms));
        }
        Ok(out)
    }
}
