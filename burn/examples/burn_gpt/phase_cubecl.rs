//! `cubecl`: what cubecl survives on its own against what `train_step` survives. At each of
//! `--cubecl-factors` × the largest batch of a plain step (`max`, measured unless known),
//! `--cubecl-steps` steps of the plain loop (cubecl's own `cuMemAllocAsync` → `cuMemAlloc`
//! fallback is all it has: a loop without oomguard would die at its first out-of-memory), then
//! as many `train_step` steps from a fresh engine; a table at the end. The check: every
//! `train_step` step ran.

use burn::tensor::backend::Backend;
use oomguard::retry::RetryEngine;
use oomguard::IsOom;
use oomguard_harness::{one_line, plan_str, Bench, Line, Outcome, PhaseResult, Runner};

use crate::bench::{err_kind, with_report, BurnBench};
use crate::Own;

/// The phase (see the module's doc).
pub fn cubecl<B: Backend>(r: &mut Runner<BurnBench<B>>, own: &Own) -> PhaseResult {
    let max = r.known_max()?;
    r.bench.cleanup();
    let mut s = r.bench.warm_session()?;
    let steps = own.cubecl_steps;
    let mut table = Vec::new();
    let mut pass = true;
    for &f in &own.cubecl_factors {
        if own.out_of_time() {
            r.emit(Line::result("cubecl").text("note", format!("cut by --budget-s at factor {f}")));
            pass = false;
            break;
        }
        let rows = ((max as f64 * f).round() as usize).max(1);
        let tokens = r.bench.tokens(rows, 33).map_err(|e| e.to_string())?;

        r.bench.cleanup();
        let (mut plain_ok, mut plain_fail) = (0, "-".to_string());
        for step in 0..steps {
            if let Err(e) = r.bench.plain_step(&mut s, &tokens) {
                plain_fail = format!("step{}:{}", step + 1, err_kind(&e));
                r.emit(
                    Line::step("cubecl")
                        .float("factor", f, 2)
                        .int("rows", rows as i64)
                        .text("loop", "plain")
                        .int("step", step as i64 + 1)
                        .flag("oom", e.is_oom())
                        .text("error", one_line(&e.to_string())),
                );
                break;
            }
            plain_ok += 1;
        }
        r.bench.cleanup();

        let engine = RetryEngine::new();
        let (mut g_ok, mut g_retries, mut g_plan, mut g_fail) =
            (0, 0, "-".to_string(), "-".to_string());
        for step in 0..steps {
            let line = Line::step("cubecl")
                .float("factor", f, 2)
                .int("rows", rows as i64)
                .text("loop", "train_step")
                .int("step", step as i64 + 1);
            match r.bench.guarded_step(&engine, &mut s, &tokens) {
                Ok(d) => {
                    g_ok += 1;
                    g_retries += d.report.retries();
                    g_plan = plan_str(&d.report.final_plan);
                    r.emit(with_report(line, &d.report));
                }
                Err(e) => {
                    g_fail = format!("step{}", step + 1);
                    r.emit(line.text("failed", one_line(&e)));
                    break;
                }
            }
        }
        r.bench.cleanup();
        pass &= g_ok == steps;
        r.emit(
            Line::result("cubecl")
                .float("factor", f, 2)
                .int("rows", rows as i64)
                .text("plain_ok", format!("{plain_ok}/{steps}"))
                .text("plain_first_oom", &plain_fail)
                .text("train_step_ok", format!("{g_ok}/{steps}"))
                .int("train_step_retries", g_retries as i64)
                .text("train_step_plan", &g_plan)
                .text("train_step_failed", g_fail),
        );
        table.push((f, rows, plain_ok, plain_fail, g_ok, g_retries, g_plan));
    }
    let mut md = String::from(
        "| × max | rows | plain loop (cubecl alone) | train_step | retries | plan |\n\
         |---|---|---|---|---|---|",
    );
    for (f, rows, pok, pfail, gok, gr, gp) in table {
        let plain = if pok == steps {
            format!("{pok}/{steps} ran")
        } else {
            format!("{pok}/{steps} ran, OOM at {pfail}")
        };
        md += &format!("\n| {f} | {rows} | {plain} | {gok}/{steps} ran | {gr} | {gp} |");
    }
    r.print(md);
    Ok(if pass { Outcome::Pass } else { Outcome::Fail })
}
