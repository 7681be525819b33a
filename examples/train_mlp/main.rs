//! An MLP classifier trained on synthetic, seeded, learnable data, surviving out-of-memory.
//!
//! Every device array is an oomguard buffer. The forward pass keeps activations for backward
//! only when grad mode is on; evaluation runs under `#[no_grad]`; the training step is
//! `#[oom_retry]` with exact gradient accumulation and `#[leak_check]`. On a GPU the math is
//! cuBLAS SGEMM plus NVRTC kernels; on the simulated device (the default without a driver) it is
//! host math at small sizes.
//!
//! ```text
//! cargo run --example train_mlp                                   # simulated device
//! cargo run --release --example train_mlp -- --device cuda:0 --dims 1024,4096,4096,10 --batch 4096
//!   [--budget SIZE] [--steps N] [--seed S] [--lr X] [--check-equivalence] [--peak-eval]
//! ```

mod model;
mod ops;
#[cfg(feature = "cuda")]
mod ops_cuda;

use std::time::Instant;

use oomguard::{leak_check, no_grad, oom_retry, BatchPlan, ByteSize, Device, Error};

use model::Mlp;
use ops::{HostOps, Ops};

/// Options from the command line.
#[derive(Clone, Debug)]
struct Options {
    device: String,
    dims: Vec<usize>,
    batch: usize,
    steps: usize,
    seed: u64,
    lr: f32,
    budget: Option<u64>,
    check_equivalence: bool,
    peak_eval: bool,
    compare_alloc: bool,
    config: oomguard::AllocatorConfig,
}

fn usage() -> ! {
    eprintln!(
        "usage: train_mlp [--device sim|cuda:N] [--dims A,B,..] [--batch N] [--steps N] [--seed S] \
         [--lr X] [--budget SIZE] [--check-equivalence] [--peak-eval] [--compare-alloc]"
    );
    std::process::exit(2)
}

fn parse_options() -> Result<Options, String> {
    let gpu = cfg!(feature = "cuda") && oomguard_has_driver();
    let mut o = Options {
        device: if gpu { "cuda:0".into() } else { "sim".into() },
        dims: vec![],
        batch: 0,
        steps: 5,
        seed: 7,
        lr: 0.0,
        budget: None,
        check_equivalence: false,
        peak_eval: false,
        compare_alloc: false,
        config: oomguard::AllocatorConfig::from_env().map_err(|e| e.to_string())?,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--device" => o.device = val()?,
            "--dims" => {
                o.dims = val()?
                    .split(',')
                    .map(|d| {
                        d.trim()
                            .parse::<usize>()
                            .map_err(|_| format!("bad --dims entry {d:?}"))
                    })
                    .collect::<Result<_, _>>()?;
                if o.dims.len() < 2 || o.dims.contains(&0) {
                    return Err("--dims needs at least two positive sizes".into());
                }
            }
            "--batch" => {
                o.batch = val()?
                    .parse()
                    .map_err(|_| "--batch takes a positive integer")?
            }
            "--steps" => o.steps = val()?.parse().map_err(|_| "--steps takes an integer")?,
            "--seed" => o.seed = val()?.parse().map_err(|_| "--seed takes an integer")?,
            "--lr" => o.lr = val()?.parse().map_err(|_| "--lr takes a number")?,
            "--budget" => {
                o.budget = Some(
                    val()?
                        .parse::<ByteSize>()
                        .map_err(|e| e.to_string())?
                        .bytes(),
                )
            }
            "--check-equivalence" => o.check_equivalence = true,
            "--peak-eval" => o.peak_eval = true,
            "--compare-alloc" => o.compare_alloc = true,
            "-h" | "--help" => usage(),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    let sim = o.device == "sim";
    if o.dims.is_empty() {
        o.dims = if sim {
            vec![64, 128, 128, 10]
        } else {
            vec![1024, 4096, 4096, 10]
        };
    }
    if o.batch == 0 {
        o.batch = if sim { 64 } else { 4096 };
    }
    if o.lr == 0.0 {
        o.lr = if sim { 0.5 } else { 0.05 };
    }
    Ok(o)
}

#[cfg(feature = "cuda")]
fn oomguard_has_driver() -> bool {
    oomguard::cuda::driver_available()
}
#[cfg(not(feature = "cuda"))]
fn oomguard_has_driver() -> bool {
    false
}

fn open(o: &Options) -> Result<(Device, Box<dyn Ops>), Error> {
    if o.device == "sim" {
        let dev = Device::new(
            oomguard::backend::sim::SimDevice::new(ByteSize::gib(8)),
            o.config.clone(),
        );
        return Ok((dev, Box::new(HostOps)));
    }
    let ordinal = o
        .device
        .strip_prefix("cuda:")
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| {
            Error::InvalidArgument(format!("unknown device {:?}; use sim or cuda:N", o.device))
        })?;
    open_cuda(ordinal, o.config.clone())
}

#[cfg(feature = "cuda")]
fn open_cuda(
    ordinal: usize,
    config: oomguard::AllocatorConfig,
) -> Result<(Device, Box<dyn Ops>), Error> {
    let dev = Device::cuda_with_config(ordinal, config)?;
    let ops = ops_cuda::CudaOps::new(&dev)?;
    Ok((dev, Box::new(ops)))
}
#[cfg(not(feature = "cuda"))]
fn open_cuda(_: usize, _: oomguard::AllocatorConfig) -> Result<(Device, Box<dyn Ops>), Error> {
    Err(Error::InvalidArgument(
        "this build has no CUDA support".into(),
    ))
}

/// Loss and accuracy of one step or evaluation.
#[derive(Clone, Copy, Debug)]
struct Stats {
    loss: f64,
    accuracy: f64,
}

struct Trainer {
    dev: Device,
    ops: Box<dyn Ops>,
    mlp: Mlp,
    seed: u64,
    lr: f32,
    steps_done: usize,
}

impl Trainer {
    fn classes(&self) -> usize {
        self.mlp.classes()
    }

    /// One SGD step over the logical batch of `plan.batch()` rows, run as the plan's
    /// micro-batches: each chunk's loss gradient is scaled by 1/N, so the accumulated gradient is
    /// the full batch's (up to floating-point summation order). The body is the attempt: an OOM
    /// anywhere in it reruns it with a finer plan. The update is the commit (`apply`): it runs
    /// once, after every micro-batch of one attempt succeeded, and is never rerun.
    #[oom_retry(plan = plan, commit = |stats| self.apply(stats))]
    #[leak_check(action = error)]
    fn train_step(&mut self, plan: &BatchPlan) -> Result<Stats, Error> {
        let n = plan.batch();
        let (d_in, classes) = (self.mlp.dims[0], self.classes());
        let base = self.steps_done * n;
        self.mlp.zero_grads(&*self.ops)?;
        let (mut loss, mut correct) = (0.0f64, 0u64);
        for chunk in plan.chunks() {
            let rows = chunk.len();
            let mut x = self.dev.alloc::<f32>(rows * d_in)?;
            let mut y = self.dev.alloc::<u32>(rows)?;
            self.ops.gen_data(
                &mut x,
                &mut y,
                self.seed,
                base + chunk.start(),
                d_in,
                classes,
            )?;
            let (logits, saved) = self.mlp.forward(&self.dev, &*self.ops, x, rows)?;
            let mut dlogits = self.dev.alloc::<f32>(rows * classes)?;
            let (l, c) =
                self.ops
                    .softmax_xent(&logits, &y, Some(&mut dlogits), classes, 1.0 / n as f32)?;
            drop((logits, y));
            let saved = saved.ok_or_else(|| {
                Error::InvalidArgument("grad mode is off in a training step".into())
            })?;
            self.mlp
                .backward(&self.dev, &*self.ops, saved, dlogits, rows)?;
            loss += l;
            correct += c;
        }
        Ok(Stats {
            loss: loss / n as f64,
            accuracy: correct as f64 / n as f64,
        })
    }

    /// The commit of `train_step`: the SGD update, once per step.
    fn apply(&mut self, stats: Stats) -> Result<Stats, Error> {
        self.mlp.sgd(&*self.ops, self.lr)?;
        self.steps_done += 1;
        Ok(stats)
    }

    /// Loss and accuracy on `rows` held-out rows, with grad mode off: activations are dropped as
    /// soon as the next layer's exist.
    #[no_grad]
    fn evaluate(&self, rows: usize) -> Result<Stats, Error> {
        self.forward_loss(rows)
    }

    /// Loss and accuracy of a forward pass in the current grad mode.
    fn forward_loss(&self, rows: usize) -> Result<Stats, Error> {
        let (d_in, classes) = (self.mlp.dims[0], self.classes());
        let mut x = self.dev.alloc::<f32>(rows * d_in)?;
        let mut y = self.dev.alloc::<u32>(rows)?;
        // held-out rows: another seed
        self.ops
            .gen_data(&mut x, &mut y, self.seed ^ 0xe7a1, 0, d_in, classes)?;
        let (logits, _saved) = self.mlp.forward(&self.dev, &*self.ops, x, rows)?;
        let (l, c) = self.ops.softmax_xent(&logits, &y, None, classes, 1.0)?;
        Ok(Stats {
            loss: l / rows as f64,
            accuracy: c as f64 / rows as f64,
        })
    }
}

fn trainer(o: &Options) -> Result<Trainer, Error> {
    let (dev, ops) = open(o)?;
    let mlp = Mlp::new(&dev, &o.dims, o.seed)?;
    Ok(Trainer {
        dev,
        ops,
        mlp,
        seed: o.seed,
        lr: o.lr,
        steps_done: 0,
    })
}

/// Trains `o.steps` steps (under `budget` if given); returns the final parameters.
fn train(o: &Options, budget: Option<u64>, label: &str) -> Result<(Vec<f32>, Trainer), Error> {
    train_timed(o, budget, label).map(|(p, t, _)| (p, t))
}

/// As [`train`], also returning steps per second (steps after the first, which warms up).
fn train_timed(
    o: &Options,
    budget: Option<u64>,
    label: &str,
) -> Result<(Vec<f32>, Trainer, f64), Error> {
    let mut t = trainer(o)?;
    println!(
        "[{label}] device {} ({}), dims {:?}, batch {}, budget {}",
        t.dev.name(),
        ByteSize(t.dev.mem_info()?.total),
        o.dims,
        o.batch,
        budget.map_or("none".to_string(), |b| ByteSize(b).to_string())
    );
    let mut start = Instant::now();
    for step in 0..o.steps {
        if step == 1 {
            start = Instant::now();
        }
        let s0 = Instant::now();
        let stats = {
            let _budget = budget.map(|b| t.dev.thread_budget(ByteSize(b)));
            t.train_step(
                &BatchPlan::whole(o.batch).map_err(|e| Error::InvalidArgument(e.to_string()))?,
            )?
        };
        let report = oomguard::retry::last_report();
        println!(
            "[{label}] step {step}: loss {:.4} acc {:.3}  plan {}  retries {}  {:.1} ms",
            stats.loss,
            stats.accuracy,
            report
                .as_ref()
                .map_or("?".into(), |r| r.final_plan.to_string()),
            report.as_ref().map_or(0, |r| r.retries()),
            s0.elapsed().as_secs_f64() * 1e3
        );
    }
    let secs = start.elapsed().as_secs_f64();
    let rate = o.steps.saturating_sub(1) as f64 / secs;
    println!("[{label}] {rate:.2} steps/s (steps after the first)");
    let eval = t.evaluate(o.batch)?;
    println!(
        "[{label}] eval: loss {:.4} acc {:.3}",
        eval.loss, eval.accuracy
    );
    Ok((t.mlp.parameters()?, t, rate))
}

fn run(o: &Options) -> Result<(), Error> {
    // The reference run with ample memory goes first: plans are remembered per call site, and
    // the budgeted run must not teach the reference its micro-batches.
    let reference = if o.check_equivalence && o.budget.is_some() {
        Some(train(o, None, "ample")?.0)
    } else {
        None
    };
    if o.compare_alloc {
        // The same loop, allocating every buffer from the driver's stream-ordered pool
        // (cuMemAllocAsync/cuMemFreeAsync, as cudarc's CudaStream::alloc does) instead of
        // oomguard's cache; the order alternates to even out warm-up.
        let mut pool = o.clone();
        pool.config.pass_through = true;
        pool.config.expandable_segments = false;
        let (_, _, a1) = train_timed(o, None, "oomguard")?;
        let (_, _, p1) = train_timed(&pool, None, "stream-ordered pool")?;
        let (_, _, p2) = train_timed(&pool, None, "stream-ordered pool")?;
        let (_, _, a2) = train_timed(o, None, "oomguard")?;
        let (ours, theirs) = ((a1 + a2) / 2.0, (p1 + p2) / 2.0);
        println!(
            "throughput: oomguard {ours:.2} steps/s, stream-ordered pool {theirs:.2} steps/s, ratio {:.3}",
            ours / theirs
        );
    }
    let (params, t) = train(o, o.budget, "run")?;
    if o.peak_eval {
        let with_grad = {
            let scope = t.dev.peak_scope();
            let _g = oomguard::enable_grad();
            t.forward_loss(o.batch)?;
            scope.peak_bytes()
        };
        let without = {
            let scope = t.dev.peak_scope();
            t.evaluate(o.batch)?;
            scope.peak_bytes()
        };
        println!(
            "peak memory of evaluation: grad on {}, no_grad {} ({:.2}x lower)",
            ByteSize(with_grad),
            ByteSize(without),
            with_grad as f64 / without.max(1) as f64
        );
    }
    if let Some(reference) = reference {
        // Relative difference of the parameter vectors, ‖a − b‖ / ‖b‖: micro-batches sum the
        // same terms in another order, so single elements near zero differ relatively more.
        let (mut diff, mut norm, mut max_abs) = (0.0f64, 0.0f64, 0.0f64);
        for (a, b) in params.iter().zip(&reference) {
            let d = (*a as f64) - (*b as f64);
            diff += d * d;
            norm += (*b as f64) * (*b as f64);
            max_abs = max_abs.max(d.abs());
        }
        let rel = (diff / norm.max(f64::MIN_POSITIVE)).sqrt();
        println!(
            "parameters after {} steps, budgeted vs ample: relative difference {rel:.2e} \
             (max element difference {max_abs:.2e}, {} parameters)",
            o.steps,
            params.len()
        );
        if rel > 1e-4 {
            return Err(Error::InvalidArgument(format!(
                "runs differ by {rel:.2e} > 1e-4"
            )));
        }
    }
    println!("\n{}", t.dev.memory_summary());
    Ok(())
}

fn main() {
    let o = match parse_options() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("train_mlp: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(&o) {
        eprintln!("train_mlp: {e}");
        std::process::exit(1);
    }
}
