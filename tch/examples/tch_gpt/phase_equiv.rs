//! `equiv`: from the same initial weights, `--equiv-steps` steps of `--equiv-batch` rows as one
//! pass (1 × B) and as 4 micro-batches (4 × B/4), with SGD and then AdamW: the relative
//! difference of the parameters after them, ‖a − b‖ / ‖a‖ over every parameter (f64 sums).
//! The goal: SGD ≤ 1e-5.
//!
//! The micro-batches accumulate by libtorch's own `backward` (gradients add up in `.grad`),
//! each chunk's mean loss weighted by its share of the rows; the optimizer steps once per batch.

use tch::nn::{self, OptimizerConfig};
use tch::{Kind, TchError, Tensor};

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
        let mut init = None;
        for rows in [batch, micro] {
            let (vs, model) = self.model().map_err(|e| e.to_string())?;
            let w0 = params(&vs).map_err(|e| e.to_string())?;
            let mut opt = match opt_name {
                "sgd" => nn::Sgd::default().build(&vs, self.args.sgd_lr),
                _ => self.adamw(&vs),
            }
            .map_err(|e| e.to_string())?;
            let mut last = f64::NAN;
            for (s, tokens) in batches.iter().enumerate() {
                let mut step_loss = 0.0;
                for start in (0..batch).step_by(rows as usize) {
                    let n = rows.min(batch - start);
                    let chunk = tokens.f_narrow(0, start, n).map_err(|e| e.to_string())?;
                    let loss = model.loss(&chunk).map_err(|e| e.to_string())?;
                    let share = n as f64 / batch as f64;
                    let weighted = loss.f_mul_scalar(share).map_err(|e| e.to_string())?;
                    weighted.f_backward().map_err(|e| e.to_string())?;
                    step_loss += weighted.f_double_value(&[]).map_err(|e| e.to_string())?;
                }
                opt.step();
                opt.zero_grad();
                self.emit(
                    Line::step("equiv")
                        .text("opt", opt_name)
                        .text("plan", format!("{}x{rows}", batch / rows))
                        .int("step", s as i64 + 1)
                        .float("loss", step_loss, 6),
                );
                last = step_loss;
            }
            results.push((params(&vs).map_err(|e| e.to_string())?, last));
            init.get_or_insert(w0);
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
                .text("via", "manual_accumulation")
                .float("rel_diff", rel, 0)
                .float("max_abs_diff", max_abs, 0)
                .float("params_moved_rel", moved, 0)
                .float("last_loss_whole", whole.1, 6)
                .float("last_loss_micro", parts.1, 6),
        );
        Ok(rel)
    }
}
