//! `oom`: a batch of `--oom-factor` × the largest batch of a plain step (`max`), which a plain
//! step cannot run, through `train_step` from a fresh engine: step 1 meets a real out-of-memory
//! and survives it as micro-batches (its attempts are printed); steps 2 to 4 start from the
//! plan remembered, with no retry. Every step trains every row; the losses and the parameters
//! stay finite.

use std::time::Instant;

use oomguard::retry::RetryEngine;
use tch::Kind;

use crate::guarded_step::{attempts_str, plan_str};
use crate::report::Line;
use crate::{Ctx, Outcome, PhaseResult};

impl Ctx {
    /// The phase (see the module's doc).
    pub fn oom(&mut self) -> PhaseResult {
        let max = self.known_max()?;
        self.source.empty_cache().map_err(|e| e.to_string())?;
        let batch = ((max as f64 * self.args.oom_factor).round() as i64).max(max + 1);
        let (vs, model) = self.model().map_err(|e| e.to_string())?;
        let mut opt = self.adamw(&vs).map_err(|e| e.to_string())?;
        let engine = RetryEngine::new();
        let mut reports = Vec::new();
        let mut losses = Vec::new();
        let mut all_rows = true;
        for s in 0..4 {
            let tokens = self
                .tokens(batch, 700 + s as u64)
                .map_err(|e| e.to_string())?;
            self.source.reset_peak().map_err(|e| e.to_string())?;
            let t = Instant::now();
            let done = self
                .guarded_step(&engine, &vs, &model, &mut opt, &tokens)
                .map_err(|e| format!("train_step, step {} of batch {batch}: {e}", s + 1))?;
            let secs = t.elapsed().as_secs_f64();
            let r = &done.report;
            let u = self.source.usage().map_err(|e| e.to_string())?;
            self.emit(
                Line::step("oom")
                    .int("step", s + 1)
                    .int("batch", batch)
                    .int("rows", done.rows as i64)
                    .float("loss", done.loss, 5)
                    .int("retries", r.retries() as i64)
                    .text("initial_plan", plan_str(&r.initial_plan))
                    .text("final_plan", plan_str(&r.final_plan))
                    .flag("from_memory", r.from_memory)
                    .text("attempts", attempts_str(r))
                    .float("secs", secs, 2)
                    .int("peak_used", u.used_peak as i64)
                    .int("peak_reserved", u.reserved_peak as i64),
            );
            if s == 0 {
                println!("{r}");
            }
            all_rows &= done.rows as i64 == batch;
            losses.push(done.loss);
            reports.push(done.report);
        }
        let first = &reports[0];
        let later_clean = reports[1..]
            .iter()
            .all(|r| r.retries() == 0 && r.from_memory && r.initial_plan == first.final_plan);
        let mut non_finite = 0i64;
        for (_, v) in vs.variables() {
            let ok = v
                .f_isfinite()
                .and_then(|t| t.f_logical_not())
                .and_then(|t| t.f_sum(Kind::Int64))
                .and_then(|t| t.f_int64_value(&[]))
                .map_err(|e| e.to_string())?;
            non_finite += ok;
        }
        let finite_losses = losses.iter().all(|l| l.is_finite());
        let pass = first.retries() >= 1
            && first.final_plan.num_chunks() > 1
            && later_clean
            && all_rows
            && non_finite == 0
            && finite_losses;
        self.emit(
            Line::result("oom")
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
                .flag("pass", pass),
        );
        Ok(if pass { Outcome::Pass } else { Outcome::Fail })
    }
}
