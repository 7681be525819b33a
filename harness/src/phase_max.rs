//! `max`: the true largest batch of a plain step, by real steps: doubling from 1 until a trial
//! runs out of memory (or `--max-cap` runs), then bisection to one row. Every trial starts from
//! the same state: the previous trial's model and optimizer dropped, the cache emptied, a fresh
//! model and AdamW that have taken a step of one row (the optimizer's state exists, as in
//! training); then two steps at the trial's batch (the second meets the first's cached blocks).
//! One model kept across trials measured less than it should on an H100 with libtorch's native
//! allocator: 37 rows, where 100 steps at 42 ran (docs/GPU.md), as the failed trials' blocks
//! were left where the next trial's requests could not use them.

use std::time::Instant;

use oomguard_runtime::IsOom;

use crate::bench::{Bench, Optim};
use crate::report::{one_line, Line};
use crate::runner::{Outcome, PhaseResult, Runner};

impl<B: Bench> Runner<B> {
    /// The phase (see the module's doc); its result is kept for `oom` and `finder`.
    pub fn max_phase(&mut self) -> PhaseResult {
        let t = Instant::now();
        let (max, trials, capped) = self.measure_max()?;
        let line = Line::result("max")
            .int("max_batch", max)
            .flag("reached_max_cap", capped)
            .int("trials", trials)
            .int("seq", self.bench.row_len())
            .float("secs", t.elapsed().as_secs_f64(), 1);
        self.emit(line);
        self.max = Some(max);
        Ok(Outcome::Pass)
    }

    /// One trial of `rows` rows from a fresh model: `Ok(false)` when it ran out of memory.
    fn max_trial(&mut self, rows: i64) -> Result<bool, String> {
        let b = &self.bench;
        b.source().empty_cache().map_err(|e| e.to_string())?;
        let mut s = b.session(Optim::AdamW).map_err(|e| e.to_string())?;
        let one = b.batch(1, 999).map_err(|e| e.to_string())?;
        b.plain_step(&mut s, &one)
            .map_err(|e| format!("a warm-up step of one row failed: {e}"))?;
        let batch = b.batch(rows, rows as u64).map_err(|e| e.to_string())?;
        let t = Instant::now();
        let r = b
            .plain_step(&mut s, &batch)
            .and_then(|_| b.plain_step(&mut s, &batch));
        let line = Line::trial("max")
            .int("rows", rows)
            .flag("ok", r.is_ok())
            .float("secs", t.elapsed().as_secs_f64(), 2);
        drop((s, batch));
        match r {
            Ok(_) => {
                self.emit(line);
                Ok(true)
            }
            Err(e) if e.is_oom() => {
                self.emit(line.text("error", one_line(&e.to_string())));
                Ok(false)
            }
            Err(e) => Err(format!("a trial of {rows} rows failed (not OOM): {e}")),
        }
    }

    /// The largest batch that ran, the trials, and whether the search stopped at `--max-cap`
    /// (every batch up to it ran).
    fn measure_max(&mut self) -> Result<(i64, i64, bool), String> {
        let mut trials = 0;
        let cap = self.args.max_cap;
        let (mut lo, mut rows) = (0, 1);
        let mut hi = None;
        while rows <= cap {
            trials += 1;
            if self.max_trial(rows)? {
                lo = rows;
                if rows == cap {
                    break;
                }
                rows = (rows * 2).min(cap);
            } else {
                hi = Some(rows);
                break;
            }
        }
        let Some(mut hi) = hi else {
            return Ok((lo, trials, true));
        };
        if lo == 0 {
            return Err("a plain step of one row ran out of memory".into());
        }
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            trials += 1;
            if self.max_trial(mid)? {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        Ok((lo, trials, false))
    }
}
