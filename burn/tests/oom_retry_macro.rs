//! `#[oom_retry]` on functions returning burn's `ExecutionError` and oomguard-burn's `Error`:
//! the out-of-memory is recognised (for `ExecutionError`, by the exact text burn-cubecl makes
//! of cubecl's `BufferTooBig`), the step reruns as micro-batches, the commit runs once.

use burn::backend::NdArray;
use burn::tensor::backend::ExecutionError;
use burn::tensor::{Tensor, TensorData};
use cubecl_common::backtrace::BackTrace;
use cubecl_runtime::server::{IoError, ServerError};
use oomguard::{oom_retry, BatchPlan, ByteSize};
use oomguard_burn::chunk_rows;

type B = NdArray;

/// What burn-cubecl returns when cubecl's reservation of `size` bytes failed.
fn burn_oom(size: u64) -> ExecutionError {
    let e = ServerError::Io(IoError::BufferTooBig {
        size,
        backtrace: BackTrace::capture(),
    });
    ExecutionError::WithContext {
        reason: format!("{e}"),
    }
}

struct Trainer {
    /// Stands in for the GPU's memory: 1 MiB of "activations" per row.
    card: oomguard::Device,
    x: Tensor<B, 2>,
    updates: usize,
}

impl Trainer {
    #[oom_retry(plan = plan, commit = |sum| self.apply(sum))]
    fn step(&mut self, plan: &BatchPlan) -> Result<f32, ExecutionError> {
        let mut sum = 0f32;
        for c in plan.chunks() {
            let bytes = c.len() << 20;
            let _acts = self
                .card
                .alloc::<u8>(bytes)
                .map_err(|_| burn_oom(bytes as u64))?;
            let rows = chunk_rows(&self.x, &c).map_err(|e| ExecutionError::WithContext {
                reason: e.to_string(),
            })?;
            sum += rows.sum().try_into_data()?.iter::<f32>().next().unwrap();
        }
        Ok(sum)
    }

    /// The same with oomguard-burn's error type (the sim's error converts into it).
    #[oom_retry(plan = plan, commit = |sum| Ok(self.apply(sum)?))]
    fn step_glue(&mut self, plan: &BatchPlan) -> Result<f32, oomguard_burn::Error> {
        let mut sum = 0f32;
        for c in plan.chunks() {
            let _acts = self.card.alloc::<u8>(c.len() << 20)?;
            let rows = chunk_rows(&self.x, &c)?;
            sum += rows.sum().try_into_data()?.iter::<f32>().next().unwrap();
        }
        Ok(sum)
    }

    fn apply(&mut self, sum: f32) -> Result<f32, ExecutionError> {
        self.updates += 1;
        Ok(sum)
    }
}

#[test]
fn oom_retry_on_burn_results_splits_and_commits_once() {
    let x: Vec<f32> = (0..64).map(|i| i as f32).collect();
    let x = Tensor::<B, 2>::from_data(TensorData::new(x, [64, 1]), &Default::default());
    let mut t = Trainer {
        card: oomguard::Device::sim(ByteSize::mib(40)),
        x,
        updates: 0,
    };
    let plan = BatchPlan::new(64, 1).unwrap();
    let total = (0..64).sum::<i32>() as f32;
    assert_eq!(
        t.step(&plan).unwrap(),
        total,
        "every row, whatever the split"
    );
    assert_eq!(t.updates, 1, "the commit ran once");
    let report = oomguard::retry::last_report().expect("a report");
    assert!(report.retries() >= 1, "{report}");
    assert!(report.final_plan.micro_batch() <= 40, "{report}");

    assert_eq!(t.step_glue(&plan).unwrap(), total);
    assert_eq!(t.updates, 2);

    // A non-OOM error (a batch that does not match the tensor) is returned, not retried, and
    // nothing is committed.
    let err = t.step(&BatchPlan::new(65, 1).unwrap()).unwrap_err();
    assert!(err.to_string().contains("64 rows"), "{err}");
    assert_eq!(t.updates, 2);
}
