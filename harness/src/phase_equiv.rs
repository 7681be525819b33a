//! `equiv`: from the same initial weights, `--equiv-steps` steps of `--equiv-batch` rows as one
//! pass (1 × B) and as 4 micro-batches (4 × B/4), with SGD and then AdamW: the relative
//! difference of the parameters after them, ‖a − b‖ / ‖a‖ over every parameter (the bench's
//! `compare`). The goal: SGD ≤ 1e-5.
//!
//! Both run through the guarded step: the whole batch from a fresh engine (which must run it in
//! one pass), the micro-batches from an engine started at B/4 rows (`RetryEngine::start_from`,
//! as after an out-of-memory; it must run that plan with no retry). The step weights each
//! chunk's mean loss by its share of the rows, the framework's backward adds the gradients up,
//! and the optimizer steps once per batch.

use oomguard_runtime::retry::{BatchPlan, RetryEngine};

use crate::bench::{plan_str, Bench, Optim};
use crate::report::Line;
use crate::runner::{Outcome, PhaseResult, Runner};

impl<B: Bench> Runner<B> {
    /// The phase (see the module's doc).
    pub fn equiv(&mut self) -> PhaseResult {
        let sgd = self.equiv_with(Optim::Sgd)?;
        let adamw = self.equiv_with(Optim::AdamW)?;
        Ok(if sgd <= 1e-5 && adamw.is_finite() {
            Outcome::Pass
        } else {
            Outcome::Fail
        })
    }

    /// Runs the steps whole and as 4 micro-batches; the relative difference.
    fn equiv_with(&mut self, optim: Optim) -> Result<f64, String> {
        let opt_name = optim.name();
        let batch = self.args.equiv_batch;
        let micro = batch / 4;
        let steps = self.args.equiv_steps;
        let batches = (0..steps)
            .map(|s| self.bench.batch(batch, 300 + s as u64))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| e.to_string())?;
        let mut results = Vec::new();
        let mut init: Option<B::Params> = None;
        for rows in [batch, micro] {
            let mut sess = self.bench.session(optim).map_err(|e| e.to_string())?;
            let w0 = self.bench.params(&sess)?;
            let engine = if rows == batch {
                RetryEngine::new()
            } else {
                let plan = BatchPlan::with_micro_batch(batch as usize, rows as usize)
                    .map_err(|e| e.to_string())?;
                RetryEngine::new().start_from(plan)
            };
            let want = format!("{}x{rows}", batch / rows);
            let mut last = f64::NAN;
            for (s, tokens) in batches.iter().enumerate() {
                let done = self
                    .bench
                    .guarded_step(&engine, &mut sess, tokens)
                    .map_err(|e| format!("{opt_name} {want} step {}: {e}", s + 1))?;
                let ran = plan_str(&done.report.final_plan);
                self.emit(
                    Line::step("equiv")
                        .text("opt", opt_name)
                        .text("plan", &ran)
                        .int("step", s as i64 + 1)
                        .float("loss", done.loss, 6)
                        .int("retries", done.report.retries() as i64),
                );
                if ran != want || done.report.retries() != 0 {
                    return Err(format!(
                        "{opt_name}: train_step ran {ran} with {} retries, not {want} with none",
                        done.report.retries()
                    ));
                }
                last = done.loss;
            }
            results.push((self.bench.params(&sess)?, last));
            match &init {
                // Both runs must start from the same weights (the seeded initialisation).
                Some(first) => {
                    let (d, _) = self.bench.compare(first, &w0)?;
                    if d != 0.0 {
                        return Err(format!(
                            "the two models started from different weights (relative difference {d:e})"
                        ));
                    }
                }
                None => init = Some(w0),
            }
        }
        let (whole, parts) = (&results[0], &results[1]);
        let (rel, max_abs) = self.bench.compare(&whole.0, &parts.0)?;
        let (moved, _) = self
            .bench
            .compare(init.as_ref().ok_or("no model")?, &whole.0)?;
        let lr = match optim {
            Optim::Sgd => self.args.sgd_lr,
            Optim::AdamW => self.args.lr,
        };
        let line = Line::result("equiv")
            .text("opt", opt_name)
            .float("lr", lr, 0)
            .int("batch", batch)
            .text("plans", format!("1x{batch}_vs_4x{micro}"))
            .int("steps", steps as i64)
            .text("via", "train_step")
            .float("rel_diff", rel, 0)
            .float("max_abs_diff", max_abs, 0)
            .float("params_moved_rel", moved, 0)
            .float("last_loss_whole", whole.1, 6)
            .float("last_loss_micro", parts.1, 6);
        self.emit(line);
        Ok(rel)
    }
}
