//! `finder`: `find_max_batch` on the plain step (the model and AdamW warm), the batch it
//! returns, then `--find-steps` consecutive plain steps at that batch (each out of memory
//! caught and counted: which steps failed, `X`, or ran, `.`; where the report says the held
//! memory had not settled, `FinderReport::empty_cache_every`, the loop again emptying the cache
//! as often as it says, on a line of its own), then the true largest batch by
//! bisection over plain steps (`max`, unless known) and found / true.

use std::time::Instant;

use oomguard_runtime::retry::FinderOptions;
use oomguard_runtime::IsOom;

use crate::bench::{Bench, Optim};
use crate::report::{median, one_line, Line};
use crate::runner::{Outcome, PhaseResult, Runner};

impl<B: Bench> Runner<B> {
    /// The phase (see the module's doc).
    pub fn finder(&mut self) -> PhaseResult {
        let source = self.bench.source().clone();
        let mut s = self
            .bench
            .session(Optim::AdamW)
            .map_err(|e| e.to_string())?;
        let one = self.bench.batch(1, 999).map_err(|e| e.to_string())?;
        self.bench
            .plain_step(&mut s, &one)
            .map_err(|e| format!("a warm-up step of one row failed: {e}"))?;
        source.empty_cache().map_err(|e| e.to_string())?;

        let t = Instant::now();
        let opts = FinderOptions {
            max: self.args.max_cap as usize,
            ..FinderOptions::default()
        };
        let (bench, out) = (&self.bench, &mut self.out);
        let report = bench
            .find_max_batch(opts, &mut |rows| {
                let t = Instant::now();
                let r = bench
                    .batch(rows as i64, 55)
                    .and_then(|b| bench.plain_step(&mut s, &b));
                let mut line = Line::trial("finder")
                    .int("rows", rows as i64)
                    .flag("ok", r.is_ok())
                    .float("secs", t.elapsed().as_secs_f64(), 2);
                if let Err(e) = &r {
                    line = line.text("error", one_line(&e.to_string()));
                }
                out.emit(line);
                r
            })
            .map_err(|e| format!("find_max_batch: {e}"))?;
        let secs = t.elapsed().as_secs_f64();
        self.print(report.to_string());
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

        // The batch found as a loop, right after the search; and where the report says the
        // held memory had not settled, again emptying the cache as often as it says.
        let steps = self.args.find_steps;
        let mut ooms = 0;
        let every = report.empty_cache_every().map(|n| n as usize);
        for every in [None].into_iter().chain(every.map(Some)) {
            let (mut pattern, mut times) = (String::with_capacity(steps), Vec::new());
            for step in 0..steps {
                if every.is_some_and(|n| step > 0 && step % n == 0) {
                    source.empty_cache().map_err(|e| e.to_string())?;
                }
                let b = self
                    .bench
                    .batch(found, 500 + step as u64)
                    .map_err(|e| e.to_string())?;
                let t = Instant::now();
                match self.bench.plain_step(&mut s, &b) {
                    Ok(_) => {
                        times.push(t.elapsed().as_secs_f64());
                        pattern.push('.');
                    }
                    Err(e) if e.is_oom() => pattern.push('X'),
                    Err(e) => return Err(format!("plain step {} at {found} rows: {e}", step + 1)),
                }
            }
            let n = pattern.matches('X').count();
            let mut line = Line::result("finder")
                .int("batch", found)
                .int("steps", steps as i64)
                .int("ooms", n as i64);
            match every {
                None => ooms = n,
                Some(e) => line = line.int("empty_cache_every", e as i64),
            }
            self.emit(
                line.float("median_ms", median(&mut times) * 1e3, 2)
                    .text("pattern", pattern),
            );
        }
        drop(s);
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
