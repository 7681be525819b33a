//! `#[oom_retry]` on a function returning `Result<_, TchError>`: tch's own error is retryable
//! (oomguard's `tch` feature implements `IsOom` for it), with a real libtorch out-of-memory.

use oomguard::{no_grad, oom_retry};
use tch::{Device, Kind, TchError, Tensor};

/// Asks libtorch's CPU allocator for 2^40 floats (4 TiB) per row beyond 4 rows: a real ENOMEM
/// out-of-memory for a batch above 4, a small tensor at 4 rows or fewer. Evaluation
/// (`#[no_grad]`): `batch =` runs fewer rows, which a training step may not.
#[oom_retry(batch = batch, min = 1)]
#[no_grad]
fn rows_with_cap(batch: usize) -> Result<i64, TchError> {
    let rows = if batch > 4 {
        (batch as i64) << 40
    } else {
        batch as i64
    };
    let t = Tensor::f_zeros([rows], (Kind::Float, Device::Cpu))?;
    Ok(t.size()[0])
}

#[oom_retry(batch = batch, min = 1)]
#[no_grad]
fn shape_error(batch: usize) -> Result<Tensor, TchError> {
    let a = Tensor::f_zeros([batch as i64, 3], (Kind::Float, Device::Cpu))?;
    let b = Tensor::f_zeros([4, 5], (Kind::Float, Device::Cpu))?;
    a.f_matmul(&b)
}

#[test]
fn a_libtorch_oom_shrinks_the_batch_until_it_fits() {
    // 16 (and 16 again after emptying the cache) -> 8 -> 4: three failed attempts, each a
    // libtorch out-of-memory, then 4 rows.
    assert_eq!(rows_with_cap(16).unwrap(), 4);
    let report = oomguard::retry::last_report().expect("a report of the retried call");
    let batches: Vec<usize> = report.attempts.iter().map(|a| a.plan.batch()).collect();
    assert_eq!(batches, [16, 16, 8], "{report}");
    assert_eq!(report.final_plan.batch(), 4, "{report}");
    assert!(report.attempts.iter().all(|a| a
        .error
        .as_deref()
        .is_some_and(|e| e.contains("DefaultCPUAllocator"))));
}

#[test]
fn any_other_tch_error_is_returned_at_once() {
    let err = shape_error(8).unwrap_err();
    assert!(matches!(err, TchError::Torch(_)), "{err:?}");
    let report = oomguard::retry::last_report().expect("a report of the call");
    assert_eq!(report.retries(), 0, "{report}");
}

/// A tch training step under `#[oom_retry(plan = ...)]`, returning `TchError`: libtorch's CPU
/// allocator fails (ENOMEM, a real out-of-memory) for a micro-batch above 16 rows, the engine
/// halves the micro-batch, the body accumulates `.grad` weighted by each chunk's share, and the
/// commit steps the optimizer once.
struct TchModel {
    vs: tch::nn::VarStore,
    w: Tensor,
    opt: tch::nn::Optimizer,
    x: Tensor,
    y: Tensor,
}

impl TchModel {
    fn new() -> Self {
        use tch::nn::OptimizerConfig;
        let mut vs = tch::nn::VarStore::new(Device::Cpu);
        vs.set_kind(Kind::Double);
        let w = vs.root().var_copy(
            "w",
            &Tensor::from_slice(&[0.1f64, 0.2, 0.3, 0.4]).view([4, 1]),
        );
        let opt = tch::nn::Sgd::default().build(&vs, 0.05).unwrap();
        let x = Tensor::arange(256, (Kind::Double, Device::Cpu)).view([64, 4]) / 256.0;
        let y = x.sum_dim_intlist(1, true, Kind::Double);
        Self { vs, w, opt, x, y }
    }

    fn mse(&self, x: &Tensor, y: &Tensor) -> Result<Tensor, TchError> {
        x.f_matmul(&self.w)?
            .f_sub(y)?
            .f_square()?
            .f_mean(Kind::Double)
    }

    #[oom_retry(plan = plan, commit = |loss| self.update(loss))]
    fn step(&mut self, plan: &oomguard::BatchPlan) -> Result<f64, TchError> {
        self.opt.zero_grad(); // each attempt starts from no gradient
        let mut loss = 0.0;
        for c in plan.chunks() {
            if c.len() > 16 {
                let _huge = Tensor::f_empty([1i64 << 50], (Kind::Float, Device::Cpu))?;
                // 4 PiB: ENOMEM
            }
            let (start, len) = (c.start() as i64, c.len() as i64);
            let l = self.mse(
                &self.x.f_narrow(0, start, len)?,
                &self.y.f_narrow(0, start, len)?,
            )?;
            l.f_mul_scalar(c.weight())?.f_backward()?;
            loss += c.weight() * l.f_double_value(&[])?;
        }
        Ok(loss)
    }

    fn update(&mut self, loss: f64) -> Result<f64, TchError> {
        self.opt.step();
        Ok(loss)
    }
}

#[test]
fn a_tch_training_step_accumulates_under_oom_retry_plan() {
    let mut m = TchModel::new();
    let loss = m.step(&oomguard::BatchPlan::whole(64).unwrap()).unwrap();
    let report = oomguard::retry::last_report().expect("a report");
    assert_eq!(report.final_plan.micro_batch(), 16, "{report}");
    assert!(report.retries() >= 2, "{report}");
    // The same step on the whole batch, by hand.
    let mut plain = TchModel::new();
    let whole = plain.mse(&plain.x, &plain.y).unwrap();
    let whole_loss = whole.double_value(&[]);
    whole.backward();
    plain.opt.step();
    assert!(
        (loss - whole_loss).abs() <= 1e-12 * whole_loss,
        "{loss} vs {whole_loss}"
    );
    let (a, b) = (
        m.vs.variables()["w"].copy(),
        plain.vs.variables()["w"].copy(),
    );
    let diff = (a - &b).abs().max().double_value(&[]);
    let moved = (&b - Tensor::from_slice(&[0.1f64, 0.2, 0.3, 0.4]).view([4, 1]))
        .abs()
        .max()
        .double_value(&[]);
    assert!(moved > 1e-3, "the step moved w: {moved}");
    assert!(diff <= 1e-12, "accumulated vs whole-batch step: {diff:e}");
}
