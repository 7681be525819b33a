//! `grads`: the model trains at all. One backward through oomguard-burn's `GradAccumulator`:
//! every trainable parameter gets a gradient (those without are named); then the loss over
//! `--grads-steps` (default 5) `train_step` steps with AdamW on one batch falls.

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use oomguard::retry::{BatchPlan, RetryEngine};
use oomguard_burn::{catch_oom, Error, GradAccumulator};
use oomguard_harness::{Bench, Line, Optim, Outcome, PhaseResult, Runner};

use crate::bench::{with_report, Ad, BurnBench, Model};

/// Counts float parameters, those that require a gradient, and their elements.
#[derive(Default)]
struct Count {
    all: usize,
    trainable: usize,
    elements: usize,
}

impl<Bk: Backend> ModuleVisitor<Bk> for Count {
    fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<Bk, D>>) {
        let v = p.val();
        self.all += 1;
        self.trainable += usize::from(v.is_require_grad());
        self.elements += v.shape().num_elements();
    }
}

/// The phase (see the module's doc).
pub fn grads<B: Backend>(r: &mut Runner<BurnBench<B>>) -> PhaseResult {
    let batch = r.args.grads_batch as usize;
    let b = &r.bench;
    let model = b.model().map_err(|e| e.to_string())?;
    let tokens = b.tokens(batch, 1).map_err(|e| e.to_string())?;
    let plan = BatchPlan::whole(batch).map_err(|e| e.to_string())?;
    let chunk = plan.chunks().next().ok_or("empty plan")?;
    let mut acc = GradAccumulator::<Ad<B>, Model<B>>::new();
    catch_oom(|| {
        let loss = model.loss(tokens.clone());
        acc.backward(&model, loss, &chunk)
    })
    .map_err(|e| e.to_string())?;
    let mut count = Count::default();
    model.visit(&mut count);
    let (with_grad, missing) = match acc.into_grads(&model) {
        Ok(g) => (g.len(), Vec::new()),
        Err(Error::NoGradient { params }) => (count.trainable - params.len(), params),
        Err(e) => return Err(e.to_string()),
    };
    drop(model);
    r.emit(
        Line::result("grads")
            .int("batch", batch as i64)
            .int("params", count.all as i64)
            .int("trainable", count.trainable as i64)
            .int("elements", count.elements as i64)
            .int("with_grad", with_grad as i64)
            .int("missing", missing.len() as i64)
            .text(
                "missing_list",
                if missing.is_empty() {
                    "-".to_string()
                } else {
                    missing.join(",")
                },
            )
            .flag("every_parameter_has_a_gradient", missing.is_empty()),
    );

    let mut s = r.bench.session(Optim::AdamW).map_err(|e| e.to_string())?;
    let engine = RetryEngine::new();
    let mut losses = Vec::new();
    for step in 0..r.args.grads_steps {
        let done = r
            .bench
            .guarded_step(&engine, &mut s, &tokens)
            .map_err(|e| format!("step {}: {e}", step + 1))?;
        r.emit(with_report(
            Line::step("grads")
                .int("step", step as i64 + 1)
                .float("loss", done.loss, 5),
            &done.report,
        ));
        losses.push(done.loss);
    }
    let (first, last) = (losses[0], losses[losses.len() - 1]);
    let falls = last < first && losses.iter().all(|l| l.is_finite());
    r.emit(
        Line::result("grads")
            .int("batch", batch as i64)
            .int("steps", losses.len() as i64)
            .float("loss_first", first, 5)
            .float("loss_last", last, 5)
            .flag("loss_falls", falls),
    );
    Ok(if missing.is_empty() && falls {
        Outcome::Pass
    } else {
        Outcome::Fail
    })
}
