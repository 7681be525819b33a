//! `equiv`: from the same initial weights, `--equiv-steps` steps of `--equiv-batch` rows as one
//! pass (1 × B) and as 4 micro-batches (4 × B/4), with SGD and then AdamW: the relative
//! difference of the parameters after them, ‖a − b‖ / ‖a‖ over every parameter (f64 sums).
//! The goal: SGD ≤ 1e-5.
//!
//! Both run through `oomguard_tch::train_step`: the whole batch from a fresh engine (which must
//! run it in one pass), the micro-batches from an engine started at B/4 rows
//! (`RetryEngine::start_from`, as after an out-of-memory; it must run that plan with no retry).
//! `train_step` weights each chunk's mean loss by its share of the rows, libtorch's `backward`
//! adds the gradients up, and the optimizer steps once per batch.

use oomguard::retry::{BatchPlan, RetryEngine};
use tch::nn::{self, OptimizerConfig};
use tch::{Kind, TchError, Tensor};

use crate::guarded_step::plan_str;
use crate::report::Line;
use crate::{Ctx, Outcome, PhaseResult};

/// The parameters of `vs`, sorted by name, as f64 copies.
fn params(vs: &nn::VarStore) -> Result<Vec<(String, Tensor)>, TchError> {
    let mut v: Vec<_> = vs.variables().into_iter().collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v.into_iter()
        .map(|(n, t)| Ok((n, t.f_detach()?.f_to_kind(Kind::Double)?)))
        .collect()
}

/// `‖a − b‖ / ‖a‖` and the largest `|a − b|` over every parameter.
fn compare(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> Result<(f64, f64), String> {
    if a.len() != b.len() || a.iter().zip(b).any(|(x, y)| x.0 != y.0) {
        return Err("the two models have different parameters".into());
    }
    let (mut d2, mut n2, mut max) = (0f64, 0f64, 0f64);
    for ((_, x), (_, y)) in a.iter().zip(b) {
        let d = x.f_sub(y).map_err(|e| e.to_string())?;
        let sq = |t: &Tensor| -> Result<f64, TchError> {
            t.f_square()?.f_sum(Kind::Double)?.f_double_value(&[])
        };
        d2 += sq(&d).map_err(|e| e.to_string())?;
        n2 += sq(x).map_err(|e| e.to_string())?;
        let m = d
            .f_abs()
            .and_then(|t| t.f_max())
            .and_then(|t| t.f_double_value(&[]))
            .map_err(|e| e.to_string())?;
        max = max.max(m);
    }
    Ok(((d2 / n2.max(f64::MIN_POSITIVE)).sqrt(), max))
}

impl Ctx {
    /// The phase (see the module's doc).
    pub fn equiv(&mut self) -> PhaseResult {
        let sgd = self.equiv_with("sgd")?;
        let adamw = self.equiv_with("adamw")?;
        Ok(if sgd <= 1e-5 && adamw.is_finite() {
            Outcome::Pass
        } else {
            Outcome::Fail
        })
    }

    /// Runs the steps whole and as 4 micro-batches; the relative difference.
    fn equiv_with(&mut self, opt_name: &str) -> Result<f64, String> {
        let batch = self.args.equiv_batch;
        let micro = batch / 4;
        let steps = self.args.equiv_steps;
        let batches = (0..steps)
            .map(|s| self.tokens(batch, 300 + s as u64))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| e.to_string())?;
        let mut results = Vec::new();
        let mut init: Option<Vec<(String, Tensor)>> = None;
        for rows in [batch, micro] {
            let (vs, model) = self.model().map_err(|e| e.to_string())?;
            let w0 = params(&vs).map_err(|e| e.to_string())?;
            let mut opt = match opt_name {
                "sgd" => nn::Sgd::default().build(&vs, self.args.sgd_lr),
                _ => self.adamw(&vs),
            }
            .map_err(|e| e.to_string())?;
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
                    .guarded_step(&engine, &vs, &model, &mut opt, tokens)
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
            results.push((params(&vs).map_err(|e| e.to_string())?, last));
            match &init {
                // Both runs must start from the same weights (the seeded initialisation).
                Some(first) => {
                    let (d, _) = compare(first, &w0)?;
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
        let (rel, max_abs) = compare(&whole.0, &parts.0)?;
        let (moved, _) = compare(init.as_ref().ok_or("no model")?, &whole.0)?;
        let lr = if opt_name == "sgd" {
            self.args.sgd_lr
        } else {
            self.args.lr
        };
        self.emit(
            Line::result("equiv")
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
                .float("last_loss_micro", parts.1, 6),
        );
        Ok(rel)
    }
}
