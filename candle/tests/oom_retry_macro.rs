//! `#[oom_retry]` on a function that returns `candle_core::Result`: no user boilerplate, the
//! out-of-memory inside candle's `Error::Cuda` box is recognised by type, the step reruns as
//! micro-batches, and the commit (the optimizer update) runs once.

use candle_core::{Device, Tensor};
use oomguard::{oom_retry, BatchPlan, ByteSize};

struct Trainer {
    /// Stands in for the GPU's memory: 1 MiB of "activations" per row.
    card: oomguard::Device,
    x: Tensor,
    updates: usize,
    rows_seen: usize,
}

impl Trainer {
    #[oom_retry(plan = plan, commit = |sum| self.apply(sum))]
    fn step(&mut self, plan: &BatchPlan) -> candle_core::Result<f32> {
        let mut sum = 0f32;
        for c in plan.chunks() {
            let _acts = self
                .card
                .alloc::<u8>(c.len() << 20)
                .map_err(|e| candle_core::Error::Cuda(Box::new(e)).bt())?;
            let rows = oomguard_candle::chunk_rows(&self.x, &c)?;
            sum += rows.sum_all()?.to_scalar::<f32>()?;
        }
        Ok(sum)
    }

    fn apply(&mut self, sum: f32) -> candle_core::Result<f32> {
        self.updates += 1;
        self.rows_seen += 64;
        Ok(sum)
    }
}

#[test]
fn oom_retry_on_a_candle_result_splits_and_commits_once() {
    let x = Tensor::arange(0f32, 64., &Device::Cpu)
        .unwrap()
        .reshape((64, 1))
        .unwrap();
    let mut t = Trainer {
        card: oomguard::Device::sim(ByteSize::mib(40)),
        x,
        updates: 0,
        rows_seen: 0,
    };
    let plan = BatchPlan::new(64, 1).unwrap();
    let sum = t.step(&plan).unwrap();
    assert_eq!(
        sum,
        (0..64).sum::<i32>() as f32,
        "every row, whatever the split"
    );
    assert_eq!(t.updates, 1, "the commit ran once");
    let report = oomguard::retry::last_report().expect("a report");
    assert!(report.retries() >= 1, "{report}");
    assert!(report.final_plan.micro_batch() <= 40, "{report}");

    // A non-OOM candle error is returned as it is, not retried, and nothing is committed.
    let short = BatchPlan::new(65, 1).unwrap();
    let err = t.step(&short).unwrap_err();
    assert!(err.to_string().contains("65"), "{err}");
    assert_eq!(t.updates, 1);
    assert_eq!(t.rows_seen, 64);
}
