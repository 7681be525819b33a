//! The README's training-loop example, compiled and run on the simulated device: the step
//! recovers from an out-of-memory by accumulation, remembers the plan, computes the same loss
//! (the batch mean) whatever the split, and applies its update once per step.

use oomguard::{leak_check, memory_budget, no_grad, oom_retry, BatchPlan, ByteSize, Device, Error};

struct Trainer {
    dev: Device,
    data: Vec<f32>,
    param: f32,
}

impl Trainer {
    #[oom_retry(plan = plan, commit = |loss| self.apply(loss))]
    #[memory_budget("16 GiB")]
    #[leak_check(action = error)]
    fn train_step(&mut self, plan: &BatchPlan) -> Result<f32, Error> {
        let mut loss = 0.0;
        for chunk in plan.chunks() {
            let x = self.dev.from_slice(&self.data[chunk.rows()])?;
            let _acts = self.dev.alloc::<f32>(chunk.len() * 1024)?;
            let chunk_mean = x.to_vec()?.iter().sum::<f32>() / chunk.len() as f32;
            loss += chunk.weight_f32() * chunk_mean;
        }
        Ok(loss)
    }

    fn apply(&mut self, loss: f32) -> Result<f32, Error> {
        self.param -= 0.1 * loss;
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

const ROWS: usize = 100_000;

fn trainer(capacity: ByteSize) -> Trainer {
    Trainer {
        dev: Device::sim(capacity),
        data: (0..ROWS).map(|i| (i % 101) as f32).collect(),
        param: 1.0,
    }
}

#[test]
fn the_readme_step_recovers_from_oom_and_remembers_the_plan() {
    let plan = BatchPlan::whole(ROWS).unwrap();
    // First one unsplit step on a device where it fits (before any plan is remembered).
    let mut big = trainer(ByteSize::gib(1));
    let unsplit = big.train_step(&plan).unwrap();
    assert_eq!(
        oomguard::retry::last_report()
            .unwrap()
            .final_plan
            .num_chunks(),
        1
    );

    // 64 MiB device: 100k rows × 4 KiB = 400 MB does not fit; 1/8 of it does.
    let mut t = trainer(ByteSize::mib(64));
    let loss = t.train_step(&plan).unwrap();
    let first = oomguard::retry::last_report().unwrap();
    assert!(first.retries() >= 2, "{first}");
    assert!(first.final_plan.num_chunks() > 1);

    // The loss is the batch's mean whatever the split: compare with the exact mean (rows are
    // 0..=100 repeating; in f64) and with the unsplit step.
    let exact = (0..ROWS).map(|i| (i % 101) as f64).sum::<f64>() / ROWS as f64;
    assert!(
        (f64::from(loss) - exact).abs() <= 1e-5 * exact,
        "{loss} vs {exact}"
    );
    assert!(
        (loss - unsplit).abs() <= 1e-5 * unsplit,
        "split {loss} vs unsplit {unsplit}"
    );
    // one update per step
    assert_eq!(t.param, 1.0 - 0.1 * loss);

    t.train_step(&plan).unwrap();
    assert_eq!(
        oomguard::retry::last_report().unwrap().retries(),
        0,
        "remembered"
    );
    assert_eq!(t.evaluate().unwrap(), 0.0);
    assert_eq!(t.dev.stats().allocated_bytes.all.current, 0);
}
