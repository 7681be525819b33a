//! One step under oomguard: `oomguard_tch::train_step` over the model's `VarStore` and its
//! optimizer, each micro-batch's rows held on `charge`'s card while its loss is computed (on
//! the CPU; nothing on CUDA), the device synchronised before it returns.

use oomguard::retry::{BatchPlan, RetryEngine, RetryReport};
use oomguard_tch::{train_step, TrainStepError, TrainedStep};
use tch::{nn, Tensor};

use crate::plain_step::sync;
use crate::Ctx;

/// `2x40`: micro-batches × rows of each (the last may be smaller).
pub fn plan_str(p: &BatchPlan) -> String {
    format!("{}x{}", p.num_chunks(), p.micro_batch())
}

/// The attempts of a report, `plan:outcome` each, `-` when none failed.
pub fn attempts_str(r: &RetryReport) -> String {
    if r.attempts.is_empty() {
        return "-".into();
    }
    r.attempts
        .iter()
        .map(|a| format!("{}:{:?}", plan_str(&a.plan), a.outcome))
        .collect::<Vec<_>>()
        .join(",")
}

impl Ctx {
    /// One `train_step` over `tokens`: the call site of every guarded step of the example
    /// (the engine remembers plans per call site and source).
    pub fn guarded_step(
        &self,
        engine: &RetryEngine,
        vs: &nn::VarStore,
        model: &crate::model::Gpt,
        opt: &mut nn::Optimizer,
        tokens: &Tensor,
    ) -> Result<TrainedStep, String> {
        let done = train_step(engine, &self.source, &[tokens], vs, opt, |chunk, rows| {
            let _held = self.charge.rows(chunk.len() as i64)?;
            Ok(model.loss(&rows[0])?)
        })
        .map_err(|e: TrainStepError| e.to_string())?;
        sync(self.dev).map_err(|e| e.to_string())?;
        Ok(done)
    }
}
