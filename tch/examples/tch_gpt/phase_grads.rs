//! `grads`: the model trains at all. One backward: every trainable parameter has a finite,
//! non-zero gradient (those without are named); then the loss over `--grads-steps` plain AdamW
//! steps on one batch falls.

use oomguard_harness::{Line, Outcome, PhaseResult, Runner};

use crate::bench::TchBench;
use crate::grads::check_gradients;
use crate::plain_step::plain_step;

/// The phase (see the module's doc).
pub fn grads(r: &mut Runner<TchBench>) -> PhaseResult {
    let batch = r.args.grads_batch;
    let b = &r.bench;
    let (vs, model) = b.model().map_err(|e| e.to_string())?;
    let tokens = b.tokens(batch, 1).map_err(|e| e.to_string())?;
    let loss = model.loss(&tokens).map_err(|e| e.to_string())?;
    loss.f_backward().map_err(|e| e.to_string())?;
    let c = check_gradients(&vs).map_err(|e| e.to_string())?;
    let list = |v: &[String]| {
        if v.is_empty() {
            "-".to_string()
        } else {
            v.join(",")
        }
    };
    r.emit(
        Line::result("grads")
            .int("batch", batch)
            .int("trainable", c.trainable as i64)
            .int("elements", c.elements)
            .int("missing", c.missing.len() as i64)
            .int("zero", c.zero.len() as i64)
            .int("non_finite", c.non_finite.len() as i64)
            .text("missing_list", list(&c.missing))
            .text("zero_list", list(&c.zero))
            .text("non_finite_list", list(&c.non_finite))
            .flag("every_parameter_has_a_gradient", c.passed()),
    );
    drop((loss, model, vs));

    let b = &r.bench;
    let (vs, model) = b.model().map_err(|e| e.to_string())?;
    let mut opt = b.adamw(&vs).map_err(|e| e.to_string())?;
    let mut losses = Vec::new();
    for s in 0..r.args.grads_steps {
        let b = &r.bench;
        let l = plain_step(&model, &mut opt, &tokens, b.dev, &b.charge)
            .map_err(|e| format!("step {}: {e}", s + 1))?;
        r.emit(
            Line::step("grads")
                .int("step", s as i64 + 1)
                .float("loss", l, 5),
        );
        losses.push(l);
    }
    let (first, last) = (losses[0], losses[losses.len() - 1]);
    let falls = last < first && losses.iter().all(|l| l.is_finite());
    r.emit(
        Line::result("grads")
            .int("batch", batch)
            .int("steps", losses.len() as i64)
            .float("loss_first", first, 5)
            .float("loss_last", last, 5)
            .float("ln_vocab", (r.bench.cfg.vocab as f64).ln(), 5)
            .flag("loss_falls", falls),
    );
    Ok(if c.passed() && falls {
        Outcome::Pass
    } else {
        Outcome::Fail
    })
}
