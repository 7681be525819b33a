//! The README's training-loop example, compiled and run on the simulated device: the step
//! recovers from an out-of-memory by accumulation and remembers the plan.

use oomguard::{leak_check, memory_budget, no_grad, oom_retry, BatchPlan, ByteSize, Device, Error};

struct Trainer {
    dev: Device,
}

impl Trainer {
    #[oom_retry(plan = plan)]
    #[memory_budget("16 GiB")]
    #[leak_check(action = error)]
    fn train_step(&mut self, plan: &BatchPlan) -> Result<f32, Error> {
        let mut loss = 0.0;
        for chunk in plan.chunks() {
            let x = self.dev.alloc::<f32>(chunk.len() * 1024)?;
            loss += chunk.weight_f32() * x.len() as f32;
        }
        Ok(loss)
    }

    #[no_grad]
    fn evaluate(&self) -> Result<f32, Error> {
        Ok(if oomguard::is_grad_enabled() {
            1.0
        } else {
            0.0
        })
    }
}

#[test]
fn the_readme_step_recovers_from_oom_and_remembers_the_plan() {
    // 64 MiB device: 100k rows × 4 KiB = 400 MB does not fit; 1/8 of it does.
    let mut t = Trainer {
        dev: Device::sim(ByteSize::mib(64)),
    };
    let plan = BatchPlan::whole(100_000).unwrap();
    let loss = t.train_step(&plan).unwrap();
    // the weighted sum over chunks is the same whatever the split: Σ (len/N)·len·1024
    assert!(loss > 0.0);
    let first = oomguard::retry::last_report().unwrap();
    assert!(first.retries() >= 2, "{first}");
    assert!(first.final_plan.num_chunks() > 1);
    t.train_step(&plan).unwrap();
    assert_eq!(
        oomguard::retry::last_report().unwrap().retries(),
        0,
        "remembered"
    );
    assert_eq!(t.evaluate().unwrap(), 0.0);
    assert_eq!(t.dev.stats().allocated_bytes.all.current, 0);
}
