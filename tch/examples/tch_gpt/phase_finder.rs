//! `finder`: `oomguard_tch::find_max_batch` on the plain tch step (the model and AdamW warm), the
//! batch it returns, then `--find-steps` consecutive plain steps at that batch (each out of
//! memory caught and counted: which steps failed, `X`, or ran, `.`), then the true largest
//! batch by bisection over plain steps (`max`, unless known) and found / true.

use std::time::Instant;

use oomguard::retry::FinderOptions;
use oomguard::IsOom;
use oomguard_tch::{find_max_batch, Error};

use crate::plain_step::plain_step;
use crate::report::{median, one_line, Line};
use crate::{Ctx, Outcome, PhaseResult};

impl Ctx {
    /// The phase (see the module's doc).
    pub fn finder(&mut self) -> PhaseResult {
        let source = self.source.clone();
        let (vs, model) = self.model().map_err(|e| e.to_string())?;
        let mut opt = self.adamw(&vs).map_err(|e| e.to_string())?;
        let one = self.tokens(1, 999).map_err(|e| e.to_string())?;
        plain_step(&model, &mut opt, &one, self.dev, &self.charge)
            .map_err(|e| format!("a warm-up step of one row failed: {e}"))?;
        source.empty_cache().map_err(|e| e.to_string())?;

        let t = Instant::now();
        let opts = FinderOptions {
            max: self.args.max_cap as usize,
            ..FinderOptions::default()
        };
        let report = find_max_batch(&*source, opts, |rows| {
            let t = Instant::now();
            let r = self
                .tokens(rows as i64, 55)
                .map_err(Error::from)
                .and_then(|tokens| plain_step(&model, &mut opt, &tokens, self.dev, &self.charge));
            let mut line = Line::trial("finder")
                .int("rows", rows as i64)
                .flag("ok", r.is_ok())
                .float("secs", t.elapsed().as_secs_f64(), 2);
            if let Err(e) = &r {
                line = line.text("error", one_line(&e.to_string()));
            }
            self.emit(line);
            r
        })
        .map_err(|e| format!("find_max_batch: {e}"))?;
        let secs = t.elapsed().as_secs_f64();
        println!("{report}");
        let found = report.max_batch as i64;
        self.emit(
            Line::result("finder")
                .int("found", found)
                .int("trials", report.runs() as i64)
                .int("step_runs", report.step_runs() as i64)
                .int("verified_steps", report.verified_steps())
                .float("secs", secs, 1)
                .text("source", source.info().to_string()),
        );

        // The batch found as a loop, right after the search.
        let steps = self.args.find_steps;
        let (mut pattern, mut times) = (String::with_capacity(steps), Vec::new());
        for s in 0..steps {
            let tokens = self
                .tokens(found, 500 + s as u64)
                .map_err(|e| e.to_string())?;
            let t = Instant::now();
            match plain_step(&model, &mut opt, &tokens, self.dev, &self.charge) {
                Ok(_) => {
                    times.push(t.elapsed().as_secs_f64());
                    pattern.push('.');
                }
                Err(e) if e.is_oom() => pattern.push('X'),
                Err(e) => return Err(format!("plain step {} at {found} rows: {e}", s + 1)),
            }
        }
        let ooms = pattern.matches('X').count();
        self.emit(
            Line::result("finder")
                .int("batch", found)
                .int("steps", steps as i64)
                .int("ooms", ooms as i64)
                .float("median_ms", median(&mut times) * 1e3, 2)
                .text("pattern", pattern),
        );
        drop((opt, model, vs));
        source.empty_cache().map_err(|e| e.to_string())?;

        let max = self.known_max()?;
        self.emit(
            Line::result("finder")
                .int("found", found)
                .int("true_max", max)
                .float("found_over_true", found as f64 / max as f64, 3),
        );
        Ok(if ooms == 0 && found <= max {
            Outcome::Pass
        } else {
            Outcome::Fail
        })
    }
}
