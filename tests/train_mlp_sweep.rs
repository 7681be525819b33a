//! Fault-injection sweep over `examples/train_mlp`'s training step on the simulated device (the
//! example's own model and host math): an OOM injected at every allocation index of one step;
//! each time the `#[oom_retry]` step completes with parameters identical to the fault-free run,
//! the update runs once, and nothing leaks.

#[allow(dead_code)]
#[path = "../examples/train_mlp/model.rs"]
mod model;
#[allow(dead_code)]
#[path = "../examples/train_mlp/ops.rs"]
mod ops;

use oomguard::backend::sim::SimDevice;
use oomguard::{leak_check, oom_retry, AllocatorConfig, BatchPlan, ByteSize, Device, Error};

use model::Mlp;
use ops::{HostOps, Ops};

struct Trainer {
    dev: Device,
    mlp: Mlp,
    updates: usize,
}

impl Trainer {
    /// The example's step (see examples/train_mlp/main.rs), on host math.
    #[oom_retry(plan = plan, remember = false, commit = |loss| self.apply(loss))]
    #[leak_check(action = error)]
    fn train_step(&mut self, plan: &BatchPlan) -> Result<f64, Error> {
        let ops = HostOps;
        let n = plan.batch();
        let (d_in, classes) = (self.mlp.dims[0], self.mlp.classes());
        self.mlp.zero_grads(&ops)?;
        let mut loss = 0.0;
        for chunk in plan.chunks() {
            let rows = chunk.len();
            let mut x = self.dev.alloc::<f32>(rows * d_in)?;
            let mut y = self.dev.alloc::<u32>(rows)?;
            ops.gen_data(&mut x, &mut y, 7, chunk.start(), d_in, classes)?;
            let (logits, saved) = self.mlp.forward(&self.dev, &ops, x, rows)?;
            let mut dl = self.dev.alloc::<f32>(rows * classes)?;
            let (l, _) = ops.softmax_xent(&logits, &y, Some(&mut dl), classes, 1.0 / n as f32)?;
            drop((logits, y));
            let saved = saved.ok_or_else(|| Error::InvalidArgument("grad off".into()))?;
            self.mlp.backward(&self.dev, &ops, saved, dl, rows)?;
            loss += l;
        }
        Ok(loss / n as f64)
    }

    /// The commit: the update, once.
    fn apply(&mut self, loss: f64) -> Result<f64, Error> {
        self.mlp.sgd(&HostOps, 0.5)?;
        self.updates += 1;
        Ok(loss)
    }
}

fn trainer(sim: &SimDevice) -> Trainer {
    let dev = Device::new(sim.clone(), AllocatorConfig::default());
    let mlp = Mlp::new(&dev, &[16, 32, 32, 10], 7).unwrap();
    Trainer {
        dev,
        mlp,
        updates: 0,
    }
}

#[test]
fn an_oom_at_every_allocation_index_of_the_train_mlp_step_is_survived_exactly() {
    let plan = BatchPlan::whole(24).unwrap();
    let sim = SimDevice::new(ByteSize::gib(1));
    let mut reference = trainer(&sim);
    let before = sim.faults().requests_seen();
    let expected_loss = reference.train_step(&plan).unwrap();
    let allocations = sim.faults().requests_seen() - before;
    let expected = reference.mlp.parameters().unwrap();
    assert!(allocations >= 8, "{allocations}");
    for k in 0..allocations {
        let sim = SimDevice::new(ByteSize::gib(1));
        let mut t = trainer(&sim);
        let baseline = t.dev.stats().allocated_bytes.all.current;
        sim.faults().fail_nth_request(k);
        let loss = t.train_step(&plan).unwrap();
        let report = oomguard::retry::last_report().unwrap();
        assert_eq!(report.retries(), 1, "fault at {k}: one retry");
        assert_eq!(loss, expected_loss, "fault at {k}");
        assert_eq!(
            t.mlp.parameters().unwrap(),
            expected,
            "fault at {k}: parameters differ"
        );
        assert_eq!(t.updates, 1, "fault at {k}: the update ran once");
        assert_eq!(
            t.dev.stats().allocated_bytes.all.current,
            baseline,
            "fault at {k}: leak"
        );
        t.dev.allocator().check_invariants().unwrap();
    }
}
