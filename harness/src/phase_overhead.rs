//! `overhead`: the same steps at `--batch` as the plain loop and through the guarded step
//! (nothing to retry), alternated in `--overhead-rounds` rounds of 5 + 5 steps (which loop goes
//! first alternates too), after a warm-up of both: the median step time of each and their ratio
//! (goal ≤ 1.01). Both loops train the same model with the same AdamW (the same work a step,
//! the memory of one model); each step is timed up to the device synchronised after it.

use std::time::Instant;

use oomguard_runtime::retry::RetryEngine;

use crate::bench::{Bench, Optim};
use crate::report::{median, Line};
use crate::runner::{Outcome, PhaseResult, Runner};

const PER_ROUND: usize = 5;

impl<B: Bench> Runner<B> {
    /// The phase (see the module's doc).
    pub fn overhead(&mut self) -> PhaseResult {
        let batch = self.args.batch;
        let b = &self.bench;
        let mut s = b.session(Optim::AdamW).map_err(|e| e.to_string())?;
        let engine = RetryEngine::new();
        let tokens = b.batch(batch, 11).map_err(|e| e.to_string())?;
        let plain = |s: &mut B::Session| {
            b.plain_step(s, &tokens)
                .map(|_| ())
                .map_err(|e| format!("plain step: {e}"))
        };
        let guarded = |s: &mut B::Session| -> Result<(), String> {
            let d = b.guarded_step(&engine, s, &tokens)?;
            if d.report.retries() > 0 {
                return Err(format!(
                    "train_step retried at batch {batch}: the comparison needs a batch that fits"
                ));
            }
            Ok(())
        };
        plain(&mut s)?;
        guarded(&mut s)?;
        let (mut tp, mut tg) = (Vec::new(), Vec::new());
        for round in 0..self.args.overhead_rounds {
            for which in [round % 2, 1 - round % 2] {
                for _ in 0..PER_ROUND {
                    let t = Instant::now();
                    if which == 0 {
                        plain(&mut s)?;
                        tp.push(t.elapsed().as_secs_f64());
                    } else {
                        guarded(&mut s)?;
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
