//! `budget` (only when named): the memory source's budget (`--budget-gib`; on CUDA a ballast
//! that leaves only that much for cubecl), then 3 `train_step` steps at `--budget-batch`: the
//! plan the budget forces and the peak reserved under it (the check: 3 steps ran, the peak
//! within the limit give or take the driver's page); then one plain step at that batch without
//! the budget.

use burn::tensor::backend::Backend;
use oomguard::retry::RetryEngine;
use oomguard_harness::{one_line, Bench, Line, Outcome, PhaseResult, Runner};

use crate::bench::{with_report, with_usage, BurnBench};
use crate::Own;

const GIB: f64 = (1u64 << 30) as f64;

/// The phase (see the module's doc).
pub fn budget<B: Backend>(r: &mut Runner<BurnBench<B>>, own: &Own) -> PhaseResult {
    let limit = (own.budget_gib * GIB) as u64;
    let batch = own.budget_batch;
    r.bench.cleanup();
    let mut s = r.bench.warm_session()?;
    let source = r.bench.source.clone();
    let guard = source
        .budget(limit)
        .map_err(|e| format!("budget of {limit} B: {e}"))?;
    r.emit(with_usage(
        Line::step("budget").int("limit", limit as i64),
        &*source,
    ));
    let _ = source.reset_peak();
    let engine = RetryEngine::new();
    let tokens = r.bench.tokens(batch, 5).map_err(|e| e.to_string())?;
    let mut steps_ok = 0;
    for step in 0..3 {
        let line = Line::step("budget").int("step", step + 1);
        match r.bench.guarded_step(&engine, &mut s, &tokens) {
            Ok(d) => {
                steps_ok += 1;
                let line = with_report(
                    line.int("rows", d.rows as i64).float("loss", d.loss, 4),
                    &d.report,
                );
                r.emit(with_usage(line, &*source));
            }
            Err(e) => {
                r.emit(line.text("failed", one_line(&e)));
                break;
            }
        }
    }
    let peak = source.usage().map(|u| u.reserved_peak).unwrap_or(0);
    let within = peak <= limit + oomguard::source::BALLAST_PAGE;
    drop(guard);
    r.bench.cleanup();
    let _ = source.reset_peak();
    let plain = r.bench.plain_step(&mut s, &tokens);
    let plain_peak = source.usage().map(|u| u.reserved_peak).unwrap_or(0);
    r.emit(
        Line::result("budget")
            .int("limit", limit as i64)
            .int("batch", batch as i64)
            .int("steps_ok", steps_ok)
            .int("reserved_peak_under_budget", peak as i64)
            .float("gib_peak", peak as f64 / GIB, 2)
            .flag("within_limit", within)
            .text(
                "plain_step_after",
                if plain.is_ok() { "ran" } else { "failed" },
            )
            .int("plain_peak", plain_peak as i64)
            .float("gib_plain_peak", plain_peak as f64 / GIB, 2),
    );
    Ok(if steps_ok == 3 && within {
        Outcome::Pass
    } else {
        Outcome::Fail
    })
}
