//! A small MLP with host math whose activations live in device buffers (so their memory is real):
//! gradient accumulation over micro-batches equals the full batch, and an OOM injected at any
//! allocation of a step never corrupts parameters, commits twice, or leaks memory.

use oomguard_runtime::backend::sim::SimDevice;
use oomguard_runtime::retry::{
    Accumulate, AttemptOutcome, BatchPlan, Chunk, EmptyCacheRetry, PolicyExt, RetryEngine,
    RetryError, Step,
};
use oomguard_runtime::{AllocatorConfig, ByteSize, Device, Error};

const D: usize = 8;
const H: usize = 16;

#[derive(Clone, Debug, PartialEq)]
struct Params {
    w1: Vec<f32>, // D×H
    b1: Vec<f32>, // H
    w2: Vec<f32>, // H
    b2: f32,
}

impl Params {
    fn init() -> Self {
        let f = |i: usize, s: f32| (i as f32 * 0.7361).sin() * s;
        Params {
            w1: (0..D * H).map(|i| f(i, 0.5)).collect(),
            b1: (0..H).map(|i| f(i + 1000, 0.1)).collect(),
            w2: (0..H).map(|i| f(i + 2000, 0.5)).collect(),
            b2: 0.05,
        }
    }
    fn zeros() -> Self {
        Params {
            w1: vec![0.0; D * H],
            b1: vec![0.0; H],
            w2: vec![0.0; H],
            b2: 0.0,
        }
    }
    fn flat(&self) -> Vec<f32> {
        let mut v = self.w1.clone();
        v.extend(&self.b1);
        v.extend(&self.w2);
        v.push(self.b2);
        v
    }
    fn sgd(&mut self, g: &Params, lr: f32) {
        for (p, g) in self.w1.iter_mut().zip(&g.w1) {
            *p -= lr * g;
        }
        for (p, g) in self.b1.iter_mut().zip(&g.b1) {
            *p -= lr * g;
        }
        for (p, g) in self.w2.iter_mut().zip(&g.w2) {
            *p -= lr * g;
        }
        self.b2 -= lr * g.b2;
    }
}

fn data(n: usize) -> (Vec<f32>, Vec<f32>) {
    let x = (0..n * D).map(|i| ((i as f32) * 0.37).cos()).collect();
    let t = (0..n).map(|i| ((i as f32) * 1.3).sin()).collect();
    (x, t)
}

/// Forward and backward of one micro-batch; adds `weight ×` its mean-loss gradients to `g`.
/// Every intermediate is a device buffer (6 allocations per micro-batch).
fn micro_batch(
    dev: &Device,
    p: &Params,
    x: &[f32],
    t: &[f32],
    c: &Chunk,
    g: &mut Params,
) -> Result<(), Error> {
    let n = c.len();
    let xd = dev.from_slice(&x[c.start() * D..c.end() * D])?;
    let xh = xd.to_vec()?;
    let mut z = vec![0f32; n * H];
    for r in 0..n {
        for j in 0..H {
            let mut s = p.b1[j];
            for k in 0..D {
                s += xh[r * D + k] * p.w1[k * H + j];
            }
            z[r * H + j] = s;
        }
    }
    let zd = dev.from_slice(&z)?;
    let hv: Vec<f32> = zd.to_vec()?.iter().map(|v| v.max(0.0)).collect();
    let hd = dev.from_slice(&hv)?;
    let hh = hd.to_vec()?;
    let y: Vec<f32> = (0..n)
        .map(|r| p.b2 + (0..H).map(|j| hh[r * H + j] * p.w2[j]).sum::<f32>())
        .collect();
    let yd = dev.from_slice(&y)?;
    // mean loss over the chunk, weighted by its share of the batch
    let scale = c.weight_f32() / n as f32;
    let dy: Vec<f32> = yd
        .to_vec()?
        .iter()
        .zip(&t[c.rows()])
        .map(|(y, t)| (y - t) * scale)
        .collect();
    let dyd = dev.from_slice(&dy)?;
    let dyh = dyd.to_vec()?;
    let mut dh = vec![0f32; n * H];
    for r in 0..n {
        for j in 0..H {
            dh[r * H + j] = if z[r * H + j] > 0.0 {
                dyh[r] * p.w2[j]
            } else {
                0.0
            };
        }
    }
    let dhd = dev.from_slice(&dh)?;
    let dhh = dhd.to_vec()?;
    for r in 0..n {
        g.b2 += dyh[r];
        for j in 0..H {
            g.w2[j] += hh[r * H + j] * dyh[r];
            g.b1[j] += dhh[r * H + j];
            for k in 0..D {
                g.w1[k * H + j] += xh[r * D + k] * dhh[r * H + j];
            }
        }
    }
    Ok(())
}

fn grads(
    dev: &Device,
    p: &Params,
    x: &[f32],
    t: &[f32],
    plan: &BatchPlan,
) -> Result<Params, Error> {
    let mut g = Params::zeros();
    for c in plan.chunks() {
        micro_batch(dev, p, x, t, &c, &mut g)?;
    }
    Ok(g)
}

fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|b| (*b as f64).powi(2)).sum();
    (num / den).sqrt()
}

#[test]
fn accumulated_gradients_equal_full_batch() {
    let dev = Device::sim(ByteSize::gib(1));
    let p = Params::init();
    for (n, chunk_counts) in [
        (36usize, vec![2usize, 3, 4, 6, 36]),
        (37, vec![2, 3, 5, 10, 37]),
    ] {
        let (x, t) = data(n);
        let full = grads(&dev, &p, &x, &t, &BatchPlan::whole(n).unwrap()).unwrap();
        assert!(
            full.flat().iter().any(|v| v.abs() > 1e-3),
            "non-trivial gradients"
        );
        for k in chunk_counts {
            let plan = BatchPlan::new(n, k).unwrap();
            let acc = grads(&dev, &p, &x, &t, &plan).unwrap();
            let e = rel_err(&acc.flat(), &full.flat());
            assert!(e <= 1e-5, "{plan}: relative error {e}");
        }
    }
    assert_eq!(dev.stats().allocated_bytes.all.current, 0);
}

struct Run {
    params: Params,
    commits: u32,
    result: Result<usize, String>,
    allocated_after: u64,
    baseline: u64,
}

/// One training step through the engine on a fresh device, with an OOM injected at request `k`.
fn step_with_fault(engine: &RetryEngine, k: Option<u64>, n: usize) -> (Run, u64) {
    let sim = SimDevice::new(ByteSize::mib(64));
    let dev = Device::new(sim.clone(), AllocatorConfig::default());
    let mut params = Params::init();
    // persistent device state (a parameter mirror) so the baseline is not zero
    let _mirror = dev.from_slice(&params.flat()).unwrap();
    let baseline = dev.stats().allocated_bytes.all.current;
    let (x, t) = data(n);
    let requests0 = sim.faults().requests_seen();
    if let Some(k) = k {
        sim.faults().fail_nth_request(k);
    }
    let mut commits = 0;
    let snapshot = params.clone();
    let out = engine.run(
        &dev,
        n,
        |plan| grads(&dev, &snapshot, &x, &t, plan),
        |g| {
            commits += 1;
            params.sgd(&g, 0.1);
        },
    );
    let requests = sim.faults().requests_seen() - requests0;
    let result = match out {
        Ok(r) => Ok(r.report.retries()),
        Err(e) => {
            assert!(
                matches!(e, RetryError::GaveUp { .. }),
                "only OOM give-ups are expected: {e}"
            );
            Err(e.to_string())
        }
    };
    (
        Run {
            params,
            commits,
            result,
            allocated_after: dev.stats().allocated_bytes.all.current,
            baseline,
        },
        requests,
    )
}

#[test]
fn fault_at_every_allocation_of_a_step() {
    let n = 37;
    let (clean, per_step) = step_with_fault(&RetryEngine::new(), None, n);
    assert_eq!(clean.result, Ok(0));
    assert_eq!(clean.commits, 1);
    assert_eq!(per_step, 6, "6 device allocations in a one-chunk step");
    assert_ne!(clean.params, Params::init());

    // Default policy: the same plan is retried once after emptying the cache, so the result is
    // bit-identical.
    for k in 0..per_step + 3 {
        let (run, _) = step_with_fault(&RetryEngine::new(), Some(k), n);
        let expected_retries = usize::from(k < per_step);
        assert_eq!(run.result, Ok(expected_retries), "fault at request {k}");
        assert_eq!(run.commits, 1, "fault at request {k}: one optimizer update");
        assert_eq!(
            run.params, clean.params,
            "fault at request {k}: identical parameters"
        );
        assert_eq!(
            run.allocated_after, run.baseline,
            "fault at request {k}: nothing leaked"
        );
    }

    // Accumulation only: the retried step runs in micro-batches; parameters match to rounding.
    let accumulate = || RetryEngine::new().with_policy(Accumulate::halving());
    for k in 0..per_step {
        let (run, _) = step_with_fault(&accumulate(), Some(k), n);
        assert_eq!(run.result, Ok(1), "fault at request {k}");
        assert_eq!(run.commits, 1);
        let e = rel_err(&run.params.flat(), &clean.params.flat());
        assert!(e <= 1e-6, "fault at request {k}: relative error {e}");
        assert_eq!(run.allocated_after, run.baseline);
    }

    // No retries allowed: a clean error, no update, nothing leaked.
    let no_retry = || RetryEngine::new().with_policy(EmptyCacheRetry::once().max_retries(0));
    for k in 0..per_step {
        let (run, _) = step_with_fault(&no_retry(), Some(k), n);
        let msg = run.result.expect_err("gives up");
        assert!(
            msg.contains("out of memory") && msg.contains("injected fault"),
            "{msg}"
        );
        assert_eq!(run.commits, 0);
        assert_eq!(run.params, Params::init());
        assert_eq!(run.allocated_after, run.baseline);
    }
}

struct MlpStep<'a> {
    dev: Device,
    params: Params,
    grads: Params,
    x: &'a [f32],
    t: &'a [f32],
    begins: u32,
    aborts: u32,
    commits: u32,
}

impl Step for MlpStep<'_> {
    type Error = Error;
    type Output = ();
    fn begin(&mut self, _plan: &BatchPlan) -> Result<(), Error> {
        self.begins += 1;
        self.grads = Params::zeros();
        Ok(())
    }
    fn micro_batch(&mut self, c: &Chunk) -> Result<(), Error> {
        micro_batch(&self.dev, &self.params, self.x, self.t, c, &mut self.grads)
    }
    fn abort(&mut self) {
        self.aborts += 1;
    }
    fn commit(&mut self) {
        self.commits += 1;
        let g = std::mem::replace(&mut self.grads, Params::zeros());
        self.params.sgd(&g, 0.1);
    }
}

#[test]
fn fault_in_a_micro_batched_step() {
    let n = 37;
    let sim = SimDevice::new(ByteSize::mib(64));
    let dev = Device::new(sim.clone(), AllocatorConfig::default());
    let (x, t) = data(n);
    let engine = RetryEngine::new();
    let new_step = || MlpStep {
        dev: dev.clone(),
        params: Params::init(),
        grads: Params::zeros(),
        x: &x,
        t: &t,
        begins: 0,
        aborts: 0,
        commits: 0,
    };
    // Buffers above 700 bytes fail: the hidden activations of more than 10 rows do not fit, so
    // the engine learns micro-batches of <= 10 rows (4 chunks of 10/9/9/9).
    sim.faults().fail_requests_above(700);
    let mut step = new_step();
    let step_at_site = |step: &mut MlpStep<'_>| engine.run_step(&dev, n, step);
    let out = step_at_site(&mut step).unwrap();
    assert_eq!(out.report.final_plan, BatchPlan::new(n, 4).unwrap());
    assert_eq!(step.commits, 1);
    assert_eq!(step.aborts as usize, out.report.retries());
    let reference = step.params.clone();
    sim.faults().clear();

    // The remembered plan now starts at 4 chunks: inject an OOM at each of its 24 allocations.
    for k in 0..6 * 4 {
        sim.faults().fail_nth_request(k);
        let mut step = new_step();
        let out = step_at_site(&mut step).unwrap();
        assert!(out.report.from_memory);
        assert_eq!(out.report.retries(), 1, "fault at request {k}");
        assert_eq!(out.report.attempts[0].outcome, AttemptOutcome::Oom);
        assert_eq!((step.begins, step.aborts, step.commits), (2, 1, 1));
        assert_eq!(step.params, reference, "fault at request {k}");
        assert_eq!(dev.stats().allocated_bytes.all.current, 0);
    }
}
