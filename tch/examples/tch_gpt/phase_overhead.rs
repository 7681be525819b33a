//! `overhead`: the same steps at `--batch` as the plain loop and through `train_step` (nothing
//! to retry), alternated in `--overhead-rounds` rounds of 5 + 5 steps (which loop goes first
//! alternates too), after a warm-up of both: the median step time of each and their ratio
//! (goal ≤ 1.01). Both loops train the same model with their own AdamW; each step is timed up
//! to the device synchronised after it.

use std::time::Instant;

use oomguard::retry::RetryEngine;

use crate::plain_step::plain_step;
use crate::report::{median, Line};
use crate::{Ctx, Outcome, PhaseResult};

const PER_ROUND: usize = 5;

impl Ctx {
    /// The phase (see the module's doc).
    pub fn overhead(&mut self) -> PhaseResult {
        let batch = self.args.batch;
        let (vs, model) = self.model().map_err(|e| e.to_string())?;
        let mut opt_plain = self.adamw(&vs).map_err(|e| e.to_string())?;
        let mut opt_guarded = self.adamw(&vs).map_err(|e| e.to_string())?;
        let engine = RetryEngine::new();
        let tokens = self.tokens(batch, 11).map_err(|e| e.to_string())?;
        let plain = |opt: &mut tch::nn::Optimizer| {
            plain_step(&model, opt, &tokens, self.dev, &self.charge)
                .map(|_| ())
                .map_err(|e| format!("plain step: {e}"))
        };
        let guarded = |opt: &mut tch::nn::Optimizer| -> Result<(), String> {
            let d = self.guarded_step(&engine, &vs, &model, opt, &tokens)?;
            if d.report.retries() > 0 {
                return Err(format!(
                    "train_step retried at batch {batch}: the comparison needs a batch that fits"
                ));
            }
            Ok(())
        };
        plain(&mut opt_plain)?;
        guarded(&mut opt_guarded)?;
        let (mut tp, mut tg) = (Vec::new(), Vec::new());
        for round in 0..self.args.overhead_rounds {
            for which in [round % 2, 1 - round % 2] {
                for _ in 0..PER_ROUND {
                    let t = Instant::now();
                    if which == 0 {
                        plain(&mut opt_plain)?;
                        tp.push(t.elapsed().as_secs_f64());
                    } else {
                        guarded(&mut opt_guarded)?;
                        tg.push(t.elapsed().as_secs_f64());
                    }
                }
            }
        }
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        let (pm, gm) = (mean(&tp), mean(&tg));
        let (p, g) = (median(&mut tp), median(&mut tg));
        self.emit(
            Line::result("overhead")
                .int("batch", batch)
                .int("steps_each", tp.len() as i64)
                .float("plain_median_ms", p * 1e3, 2)
                .float("train_step_median_ms", g * 1e3, 2)
                .float("ratio", g / p, 4)
                .float("plain_mean_ms", pm * 1e3, 2)
                .float("train_step_mean_ms", gm * 1e3, 2)
                .float("ratio_of_means", gm / pm, 4),
        );
        Ok(Outcome::Pass)
    }
}
