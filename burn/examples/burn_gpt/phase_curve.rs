//! `curve` (only when named): how memory grows with the batch, and what a failed size leaves
//! behind. Two plain steps at each of `--curve-rows`, in that order, one warm model, the cache
//! emptied between sizes: the step's peak, what the source still holds after the cleanup, and
//! cubecl's own counters.

use std::time::Instant;

use burn::tensor::backend::Backend;
use oomguard::MemorySource;
use oomguard_harness::{Bench, Line, Outcome, PhaseResult, Runner};

use crate::bench::{err_kind, BurnBench};
use crate::Own;

const GIB: f64 = (1u64 << 30) as f64;

/// The `cubecl:` line of a source's memory summary (in use, padding, reserved), or `-`.
pub fn cubecl_line(source: &dyn MemorySource) -> String {
    source
        .memory_summary()
        .lines()
        .find_map(|l| {
            l.split_once("cubecl:")
                .map(|(_, r)| r.trim_end_matches('|').trim().to_string())
        })
        .unwrap_or_else(|| "-".into())
}

/// The phase (see the module's doc).
pub fn curve<B: Backend>(r: &mut Runner<BurnBench<B>>, own: &Own) -> PhaseResult {
    r.bench.cleanup();
    let mut s = r.bench.warm_session()?;
    let source = r.bench.source.clone();
    for &rows in &own.curve_rows {
        if own.out_of_time() {
            r.emit(Line::result("curve").text("note", format!("cut by --budget-s at {rows} rows")));
            return Ok(Outcome::Fail);
        }
        r.bench.cleanup();
        let before = source.usage().map(|u| u.used).unwrap_or(0);
        let _ = source.reset_peak();
        let t = Instant::now();
        let tokens = r.bench.tokens(rows, 91).map_err(|e| e.to_string())?;
        let (mut ok, mut kind) = (0, "-");
        for _ in 0..2 {
            match r.bench.plain_step(&mut s, &tokens) {
                Ok(_) => ok += 1,
                Err(e) => {
                    kind = err_kind(&e);
                    break;
                }
            }
        }
        drop(tokens);
        let secs = t.elapsed().as_secs_f64();
        let (peak, after_steps) = source
            .usage()
            .map(|u| (u.used_peak, u.used))
            .unwrap_or((0, 0));
        let cubecl_steps = cubecl_line(&*source);
        r.bench.cleanup();
        let held = source.usage().map(|u| u.used).unwrap_or(0);
        r.emit(
            Line::trial("curve")
                .int("rows", rows as i64)
                .int("steps_ok", ok)
                .text("error_kind", kind)
                .float("secs", secs, 2)
                .int("held_before", before as i64)
                .int("peak", peak as i64)
                .int("held_after_steps", after_steps as i64)
                .int("held_after_cleanup", held as i64)
                .float("gib_peak", peak as f64 / GIB, 2)
                .float("gib_held_after_cleanup", held as f64 / GIB, 2)
                .text("cubecl_after_steps", cubecl_steps)
                .text("cubecl_after_cleanup", cubecl_line(&*source)),
        );
    }
    Ok(Outcome::Pass)
}
