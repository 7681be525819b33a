//! oomguard-burn on a GPT-2-small-shaped model (burn 0.21, CUDA backend): the measurements of
//! issue 25, item 2. Feature `cuda`; a CPU run of the same logic on a tiny model with
//! `--backend ndarray` (a simulated card, charged per row, gives the out-of-memory there).
//!
//! ```sh
//! cargo run --release -p oomguard-burn --features cuda --example burn_gpt -- --phase all
//! cargo run --release -p oomguard-burn --features cuda --example burn_gpt -- --backend ndarray --phase all
//! ```
//!
//! Phases (`--phase NAME`, repeatable or comma-separated, or `all`; `all` runs them in the
//! order grads, max, equiv, oom, cubecl, overhead, find). Each prints `RESULT phase=NAME ...`
//! lines (one `key=value` per field), `TRIAL`/`STEP` lines for the work inside, and
//! `PHASE name=NAME status=ok|FAIL|error|panicked|skipped secs=..` at its end:
//!
//! - `grads`: one step; every parameter gets a gradient (those without are listed); the loss
//!   falls over 5 AdamW steps on one small batch.
//! - `max`: the largest batch one plain step (no oomguard) runs: doubling, then bisection, the
//!   cache emptied (`memory_cleanup`) before each trial, each trial under `catch_oom`.
//! - `oom`: `train_step` at 2 × max (`--max N`, or measured): step 1's retries and final plan,
//!   then 2 steps from the remembered plan with no retry.
//! - `equiv`: from identical initial weights, 3 steps of batch 8 as 1 × 8 and as 4 × 2 (a plan
//!   forced through the engine's plan memory), with SGD, then AdamW: max abs / rel difference.
//! - `find`: `oomguard_burn::find_max_batch` on the plain step; then 100 steps of `train_step`
//!   at the batch found (no cache trim between them), counting out-of-memory retries.
//! - `overhead`: `train_step` and the plain step interleaved at batch 8; median step times
//!   (device synchronised before the clock stops) and their ratio.
//! - `curve` (only when named): two plain steps at each of `--curve-rows`, in that order, in
//!   one process, the cache emptied between sizes: the step's peak, what the source still
//!   holds after `memory_cleanup`, and cubecl's own counters (how memory grows with the batch,
//!   and what a failed size leaves behind).
//! - `budget` (only when named): the memory source's budget (`--budget-gib`; on CUDA a ballast
//!   that leaves only that much for cubecl), then 3 `train_step` steps at `--budget-batch`: the
//!   plan the budget forces and the peak reserved under it; then one plain step at that batch
//!   without the budget.
//! - `cubecl`: the plain loop (cubecl's own fallback only) and `train_step` at 1.0, 1.25 and
//!   2 × max: which survive.
//!
//! Every out-of-memory is caught (`catch_oom`, `train_step`); without a CUDA driver the example
//! prints one line and exits with status 2.

mod model;

use std::any::Any;
use std::fmt::Write as _;
use std::panic::{self, AssertUnwindSafe};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use burn::backend::{Autodiff, NdArray};
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer, SgdConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use oomguard::retry::{BatchPlan, FinderOptions, Limits, MemoryKey, RetryEngine, RetryReport};
use oomguard::{ByteSize, DeviceBuffer, IsOom, MemorySource};
use oomguard_burn::{
    catch_oom, chunk_rows, find_max_batch, train_step, Error, GradAccumulator, TrainStepError,
    TrainedStep,
};

use model::{Gpt, GptConfig};

type Ad<B> = Autodiff<B>;

/// Phases in the order `all` runs them.
const ALL_PHASES: [&str; 7] = ["grads", "max", "equiv", "oom", "cubecl", "overhead", "find"];

/// Phases run only when named (not part of `all`).
const EXTRA_PHASES: [&str; 2] = ["curve", "budget"];

const USAGE: &str = "\
burn_gpt: oomguard-burn on a GPT-2-small-shaped model (issue 25, item 2)

usage: burn_gpt [--phase NAME]... [options]

phases (repeatable, comma-separated, or `all`): grads max equiv oom cubecl overhead find
  (and, only when named: curve budget)

model (defaults: GPT-2 small; with --backend ndarray a tiny model):
  --layers N --width N --heads N --vocab N --seq N
options:
  --backend cuda|ndarray   (default cuda)
  --seed N                 tokens and weights (default 1234)
  --lr X                   AdamW learning rate (default 3e-4)
  --sgd-lr X               SGD learning rate of `equiv` (default 0.1)
  --max N                  the max batch of a plain step: skips the bisection for oom/cubecl/find
  --max-cap N              largest batch the bisection tries (default 4096)
  --grads-batch N          batch of `grads` (default 4)
  --equiv-batch N          batch of `equiv`, split as 4 micro-batches (default 8)
  --equiv-steps N          (default 3)
  --oom-factor X           batch of `oom` = X * max (default 2)
  --find-steps N           train_step steps after the finder (default 100)
  --overhead-batch N       (default 8)
  --overhead-steps N       timed pairs (default 20, after 2 warm-up pairs)
  --cubecl-factors LIST    (default 1.0,1.25,2.0)
  --cubecl-steps N         steps per cell (default 2)
  --curve-rows LIST        batches `curve` runs, in order (default 8,16,24,32,40,48,56,64,80,64,48)
  --budget-gib X           the memory source's budget in `budget` (default 40)
  --budget-batch N         batch of `budget` (default 32)
  --budget-s S             stop starting work after S seconds (loops are cut, phases skipped)
  --sim-mib N              ndarray: the simulated card (default 256)
  --sim-row-kib N          ndarray: charge per row of a step (default 4096)
";

/// Command-line options.
#[derive(Clone, Debug)]
struct Args {
    phases: Vec<String>,
    cuda: bool,
    cfg: GptConfig,
    seed: u64,
    lr: f64,
    sgd_lr: f64,
    max: Option<usize>,
    max_cap: usize,
    grads_batch: usize,
    equiv_batch: usize,
    equiv_steps: usize,
    oom_factor: f64,
    find_steps: usize,
    overhead_batch: usize,
    overhead_steps: usize,
    cubecl_factors: Vec<f64>,
    cubecl_steps: usize,
    curve_rows: Vec<usize>,
    budget_gib: f64,
    budget_batch: usize,
    budget_s: Option<f64>,
    sim_mib: u64,
    sim_row_kib: usize,
}

fn parse_args() -> Result<Args, String> {
    let raw: Vec<String> = std::env::args().skip(1).collect();
    let mut kv: Vec<(String, String)> = Vec::new();
    let mut i = 0;
    while i < raw.len() {
        let a = &raw[i];
        if a == "-h" || a == "--help" {
            return Err(String::new());
        }
        let Some(name) = a.strip_prefix("--") else {
            return Err(format!("unexpected argument {a:?}"));
        };
        let (name, value) = match name.split_once('=') {
            Some((n, v)) => (n.to_string(), v.to_string()),
            None => {
                i += 1;
                let v = raw
                    .get(i)
                    .ok_or_else(|| format!("--{name} needs a value"))?;
                (name.to_string(), v.clone())
            }
        };
        kv.push((name, value));
        i += 1;
    }
    let backend = kv
        .iter()
        .rev()
        .find(|(k, _)| k == "backend")
        .map_or("cuda", |(_, v)| v.as_str());
    let cuda = match backend {
        "cuda" => true,
        "ndarray" => false,
        other => return Err(format!("--backend {other}: cuda or ndarray")),
    };
    let cfg = if cuda {
        GptConfig::gpt2_small()
    } else {
        GptConfig {
            vocab: 128,
            seq: 16,
            width: 32,
            heads: 2,
            layers: 2,
        }
    };
    let mut a = Args {
        phases: Vec::new(),
        cuda,
        cfg,
        seed: 1234,
        lr: 3e-4,
        sgd_lr: 0.1,
        max: None,
        max_cap: 4096,
        grads_batch: 4,
        equiv_batch: 8,
        equiv_steps: 3,
        oom_factor: 2.0,
        find_steps: 100,
        overhead_batch: 8,
        overhead_steps: 20,
        cubecl_factors: vec![1.0, 1.25, 2.0],
        cubecl_steps: 2,
        curve_rows: vec![8, 16, 24, 32, 40, 48, 56, 64, 80, 64, 48],
        budget_gib: 40.0,
        budget_batch: 32,
        budget_s: None,
        sim_mib: 256,
        sim_row_kib: 4096,
    };
    fn num<T: std::str::FromStr>(k: &str, v: &str) -> Result<T, String> {
        v.parse().map_err(|_| format!("--{k} {v:?}: not a number"))
    }
    for (k, v) in &kv {
        match k.as_str() {
            "backend" => {}
            "phase" => {
                for p in v.split(',').filter(|p| !p.is_empty()) {
                    if p == "all" {
                        a.phases.extend(ALL_PHASES.iter().map(|s| s.to_string()));
                    } else if ALL_PHASES.contains(&p) || EXTRA_PHASES.contains(&p) {
                        a.phases.push(p.to_string());
                    } else {
                        return Err(format!("unknown phase {p:?}"));
                    }
                }
            }
            "layers" => a.cfg.layers = num(k, v)?,
            "width" => a.cfg.width = num(k, v)?,
            "heads" => a.cfg.heads = num(k, v)?,
            "vocab" => a.cfg.vocab = num(k, v)?,
            "seq" => a.cfg.seq = num(k, v)?,
            "seed" => a.seed = num(k, v)?,
            "lr" => a.lr = num(k, v)?,
            "sgd-lr" => a.sgd_lr = num(k, v)?,
            "max" => a.max = Some(num(k, v)?),
            "max-cap" => a.max_cap = num(k, v)?,
            "grads-batch" => a.grads_batch = num(k, v)?,
            "equiv-batch" => a.equiv_batch = num(k, v)?,
            "equiv-steps" => a.equiv_steps = num(k, v)?,
            "oom-factor" => a.oom_factor = num(k, v)?,
            "find-steps" => a.find_steps = num(k, v)?,
            "overhead-batch" => a.overhead_batch = num(k, v)?,
            "overhead-steps" => a.overhead_steps = num(k, v)?,
            "cubecl-factors" => {
                a.cubecl_factors = v.split(',').map(|f| num(k, f)).collect::<Result<_, _>>()?
            }
            "cubecl-steps" => a.cubecl_steps = num(k, v)?,
            "budget-gib" => a.budget_gib = num(k, v)?,
            "budget-batch" => a.budget_batch = num(k, v)?,
            "curve-rows" => {
                a.curve_rows = v.split(',').map(|r| num(k, r)).collect::<Result<_, _>>()?
            }
            "budget-s" => a.budget_s = Some(num(k, v)?),
            "sim-mib" => a.sim_mib = num(k, v)?,
            "sim-row-kib" => a.sim_row_kib = num(k, v)?,
            _ => return Err(format!("unknown option --{k}")),
        }
    }
    if a.phases.is_empty() {
        return Err("no --phase given".into());
    }
    if a.cfg.width % a.cfg.heads != 0 || a.cfg.seq < 2 || a.cfg.vocab < 2 {
        return Err("width must be a multiple of heads; seq and vocab at least 2".into());
    }
    if a.equiv_batch < 4 || a.grads_batch == 0 || a.overhead_batch == 0 || a.max_cap == 0 {
        return Err("--equiv-batch at least 4; other batches at least 1".into());
    }
    if a.max == Some(0) {
        return Err("--max at least 1".into());
    }
    Ok(a)
}

/// While set, the panic hook prints nothing (the driver probe).
static QUIET: AtomicBool = AtomicBool::new(false);

/// Panics seen on threads other than `main` (cubecl's device threads).
static THREAD_PANICS: AtomicU64 = AtomicU64::new(0);

/// A panic hook that prints cubecl's out-of-memory panics as one line (they are expected here
/// and caught), panics of other threads (cubecl's device threads, which catch them) as one line
/// for the first 20 and then every 100th, and every other panic as before. `catch_oom` chains
/// its own hook to this one.
fn install_panic_hook() {
    let previous = panic::take_hook();
    panic::set_hook(Box::new(move |info| {
        if QUIET.load(Ordering::SeqCst) {
            return;
        }
        let text = info
            .payload()
            .downcast_ref::<&str>()
            .copied()
            .or_else(|| info.payload().downcast_ref::<String>().map(String::as_str))
            .unwrap_or("<non-string panic>");
        let thread = std::thread::current();
        let name = thread.name().unwrap_or("<unnamed>");
        let first = text.lines().next().unwrap_or("");
        if name != "main" {
            let n = THREAD_PANICS.fetch_add(1, Ordering::SeqCst) + 1;
            if n <= 20 || n % 100 == 0 {
                let oom = oomguard_burn::panic_message_is_oom(text);
                eprintln!("[panic #{n} on thread {name}, out of memory: {oom}] {first}");
            }
        } else if oomguard_burn::panic_message_is_oom(text) {
            eprintln!("[panic, out of memory, caught] thread {name}: {first}");
        } else {
            previous(info);
        }
    }));
}

fn panic_text(p: &(dyn Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "<non-string panic>".into())
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) if e.is_empty() => {
            print!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("burn_gpt: {e}\n\n{USAGE}");
            return ExitCode::from(64);
        }
    };
    install_panic_hook();
    if args.cuda {
        run_cuda(args)
    } else {
        let dev = Default::default();
        let sim = oomguard::Device::sim(ByteSize::mib(args.sim_mib));
        let source: Arc<dyn MemorySource> = Arc::new(sim.clone());
        let charge = Charge {
            sim: Some(sim),
            per_row: args.sim_row_kib << 10,
        };
        Ctx::<NdArray>::new(args, dev, source, charge).run()
    }
}

#[cfg(feature = "cuda")]
fn run_cuda(args: Args) -> ExitCode {
    use burn::backend::cuda::CudaDevice;
    use burn::backend::Cuda;
    let dev = CudaDevice::default();
    // The driver first: an error, never a panic, without one.
    let source = match oomguard_burn::memory_source::<Ad<Cuda>>(&dev) {
        Ok(s) => s,
        Err(e) => {
            println!("burn_gpt: no usable CUDA device: {e}");
            return ExitCode::from(2);
        }
    };
    // Then cubecl (NVRTC, the device's client): a panic there is caught and said in one line.
    QUIET.store(true, Ordering::SeqCst);
    let probe = panic::catch_unwind(|| {
        let t = Tensor::<Cuda, 1>::ones([16], &dev);
        t.sum().try_into_data().map(|d| d.iter::<f32>().next())
    });
    QUIET.store(false, Ordering::SeqCst);
    match probe {
        Ok(Ok(Some(16.0))) => {}
        Ok(Ok(v)) => {
            println!("burn_gpt: the CUDA device computed a wrong sum ({v:?}, not 16)");
            return ExitCode::from(2);
        }
        Ok(Err(e)) => {
            println!("burn_gpt: burn's CUDA backend failed on a first kernel: {e}");
            return ExitCode::from(2);
        }
        Err(p) => {
            println!(
                "burn_gpt: burn's CUDA backend panicked on a first kernel: {}",
                panic_text(p.as_ref()).lines().next().unwrap_or("")
            );
            return ExitCode::from(2);
        }
    }
    println!("device: {}", source.info());
    Ctx::<Cuda>::new(args, dev, source, Charge::none()).run()
}

#[cfg(not(feature = "cuda"))]
fn run_cuda(_args: Args) -> ExitCode {
    println!("burn_gpt: built without feature `cuda`; use --backend ndarray or build with --features cuda");
    ExitCode::from(2)
}

/// On the simulated card (ndarray): bytes charged per row of a step, held while it runs.
struct Charge {
    sim: Option<oomguard::Device>,
    per_row: usize,
}

impl Charge {
    fn none() -> Self {
        Self {
            sim: None,
            per_row: 0,
        }
    }
    fn rows(&self, rows: usize) -> Result<Option<DeviceBuffer<u8>>, Error> {
        match &self.sim {
            Some(s) => Ok(Some(s.alloc::<u8>(rows * self.per_row)?)),
            None => Ok(None),
        }
    }
}

/// How a phase ended.
enum Outcome {
    /// Ran, and its checks held.
    Pass,
    /// Ran, and a check failed (said in the lines above).
    Fail,
}

type PhaseResult = Result<Outcome, String>;

/// Counts float parameters, and those that require a gradient.
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

/// Every float parameter's values, in visit order (reading them also initialises lazy ones).
#[derive(Default)]
struct Collect {
    values: Vec<Vec<f32>>,
    error: Option<String>,
}

impl<Bk: Backend> ModuleVisitor<Bk> for Collect {
    fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<Bk, D>>) {
        match p.val().try_into_data() {
            Ok(d) => self.values.push(d.iter::<f32>().collect()),
            Err(e) => {
                self.error.get_or_insert(e.to_string());
            }
        }
    }
}

fn params_of<Bk: Backend, M: Module<Bk>>(m: &M) -> Result<Vec<Vec<f32>>, String> {
    let mut c = Collect::default();
    m.visit(&mut c);
    match c.error {
        Some(e) => Err(format!("reading the parameters: {e}")),
        None => Ok(c.values),
    }
}

/// Max abs difference, max relative difference (`|a-b| / max(|a|, |b|, 1e-6)`), and
/// `||a-b|| / ||a||` over all parameters (infinite when one is NaN and the other is not, or
/// the shapes differ).
fn compare(a: &[Vec<f32>], b: &[Vec<f32>]) -> (f64, f64, f64) {
    let same_shape = a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.len() == y.len());
    if !same_shape {
        return (f64::INFINITY, f64::INFINITY, f64::INFINITY);
    }
    let (mut abs, mut rel, mut d2, mut n2) = (0f64, 0f64, 0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        for (&x, &y) in x.iter().zip(y) {
            let (x, y) = (x as f64, y as f64);
            let d = match (x.is_nan(), y.is_nan()) {
                (false, false) => (x - y).abs(),
                (true, true) => 0.0,
                _ => f64::INFINITY,
            };
            abs = abs.max(d);
            rel = rel.max(d / x.abs().max(y.abs()).max(1e-6));
            d2 += d * d;
            n2 += x * x;
        }
    }
    (abs, rel, (d2 / n2.max(f64::MIN_POSITIVE)).sqrt())
}

fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// `2x40`: micro-batches × rows of each (the last may be smaller).
fn plan_str(p: &BatchPlan) -> String {
    format!("{}x{}", p.num_chunks(), p.micro_batch())
}

/// The short kind of an error: `DevicePanic`, `Execution`, `Oomguard`, ...
fn err_kind(e: &Error) -> &'static str {
    match e {
        Error::Execution(_) => "Execution",
        Error::DevicePanic { .. } => "DevicePanic",
        Error::Oomguard(_) => "Oomguard",
        Error::Rows(_) => "Rows",
        Error::Loss(_) => "Loss",
        Error::DropsRows { .. } => "DropsRows",
        Error::NoGradient { .. } => "NoGradient",
        Error::BrokenParameters { .. } => "BrokenParameters",
    }
}

fn one_line(s: &str) -> String {
    let l = s.lines().next().unwrap_or("");
    let l: String = l.chars().take(200).collect();
    l.replace(' ', "_")
}

fn report_line(r: &RetryReport) -> String {
    let mut s = format!(
        "retries={} initial_plan={} final_plan={} from_memory={} step_secs={:.3}",
        r.retries(),
        plan_str(&r.initial_plan),
        plan_str(&r.final_plan),
        r.from_memory,
        r.elapsed.as_secs_f64()
    );
    for (i, a) in r.attempts.iter().enumerate() {
        let _ = write!(s, " attempt{}={}:{:?}", i + 1, plan_str(&a.plan), a.outcome);
    }
    s
}

struct Ctx<B: Backend> {
    args: Args,
    cfg: GptConfig,
    dev: B::Device,
    source: Arc<dyn MemorySource>,
    charge: Charge,
    /// The max batch of a plain step: `--max`, or measured by `max` in this run.
    max: Option<usize>,
    started: Instant,
    failed: bool,
}

impl<B: Backend> Ctx<B> {
    fn new(args: Args, dev: B::Device, source: Arc<dyn MemorySource>, charge: Charge) -> Self {
        Self {
            cfg: args.cfg,
            max: args.max,
            args,
            dev,
            source,
            charge,
            started: Instant::now(),
            failed: false,
        }
    }

    fn run(mut self) -> ExitCode {
        let c = self.cfg;
        println!(
            "CONFIG backend={} layers={} width={} heads={} vocab={} seq={} seed={} lr={} \
             phases={}",
            if self.args.cuda { "cuda" } else { "ndarray" },
            c.layers,
            c.width,
            c.heads,
            c.vocab,
            c.seq,
            self.args.seed,
            self.args.lr,
            self.args.phases.join(",")
        );
        // Seeded weights (burn draws them when a parameter is first used).
        Ad::<B>::seed(&self.dev, self.args.seed);
        for phase in self.args.phases.clone() {
            if self.out_of_time() {
                println!("PHASE name={phase} status=skipped reason=budget");
                continue;
            }
            println!("=== {phase}");
            let t = Instant::now();
            let out = panic::catch_unwind(AssertUnwindSafe(|| self.phase(&phase)));
            let status = match out {
                Ok(Ok(Outcome::Pass)) => "ok".to_string(),
                Ok(Ok(Outcome::Fail)) => {
                    self.failed = true;
                    "FAIL".to_string()
                }
                Ok(Err(e)) => {
                    self.failed = true;
                    format!("error error={}", one_line(&e))
                }
                Err(p) => {
                    self.failed = true;
                    format!("panicked panic={}", one_line(&panic_text(p.as_ref())))
                }
            };
            if panic::catch_unwind(AssertUnwindSafe(|| self.cleanup())).is_err() {
                self.failed = true;
                println!("NOTE the cleanup after {phase} panicked");
            }
            println!(
                "PHASE name={phase} status={status} secs={:.1} total_secs={:.1}",
                t.elapsed().as_secs_f64(),
                self.started.elapsed().as_secs_f64()
            );
        }
        if self.failed {
            ExitCode::FAILURE
        } else {
            ExitCode::SUCCESS
        }
    }

    fn phase(&mut self, name: &str) -> PhaseResult {
        match name {
            "grads" => self.grads(),
            "max" => self.max_phase(),
            "oom" => self.oom(),
            "equiv" => self.equiv(),
            "find" => self.find(),
            "overhead" => self.overhead(),
            "cubecl" => self.cubecl(),
            "curve" => self.curve(),
            "budget" => self.budget(),
            other => Err(format!("unknown phase {other}")),
        }
    }

    fn out_of_time(&self) -> bool {
        self.args
            .budget_s
            .is_some_and(|b| self.started.elapsed().as_secs_f64() >= b)
    }

    /// cubecl frees its unused pages, the device syncs, the pool is trimmed (errors ignored: a
    /// sync after an out-of-memory may report it again).
    fn cleanup(&self) {
        B::memory_cleanup(&self.dev);
        let _ = catch_oom(|| B::sync(&self.dev));
        let _ = catch_oom(|| self.source.empty_cache());
    }

    fn usage(&self) -> String {
        match self.source.usage() {
            Ok(u) => format!(
                "used={} peak={} reserved={}",
                ByteSize(u.used),
                ByteSize(u.used_peak),
                ByteSize(u.reserved)
            ),
            Err(e) => format!("usage_error={}", one_line(&e.to_string())),
        }
    }

    fn model(&self) -> Gpt<Ad<B>> {
        self.cfg.init(&self.dev)
    }

    fn adamw(&self) -> impl Optimizer<Gpt<Ad<B>>, Ad<B>> {
        AdamWConfig::new().init::<Ad<B>, Gpt<Ad<B>>>()
    }

    /// Seeded synthetic tokens `[rows, seq + 1]` (xorshift64*; `salt` picks another batch).
    fn tokens(&self, rows: usize, salt: u64) -> Tensor<Ad<B>, 2, Int> {
        let len = self.cfg.seq + 1;
        let mut x = (self.args.seed ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15)) | 1;
        let vocab = self.cfg.vocab as u64;
        let v: Vec<i64> = (0..rows * len)
            .map(|_| {
                x ^= x >> 12;
                x ^= x << 25;
                x ^= x >> 27;
                (x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 33) as i64 % vocab as i64
            })
            .collect();
        Tensor::from_data(TensorData::new(v, [rows, len]), &self.dev)
    }

    /// One plain training step (no oomguard): forward, backward, optimizer, loss read, sync.
    /// `*model` is replaced only when all of it ran.
    fn plain_step<O: Optimizer<Gpt<Ad<B>>, Ad<B>>>(
        &self,
        model: &mut Gpt<Ad<B>>,
        opt: &mut O,
        tokens: Tensor<Ad<B>, 2, Int>,
    ) -> Result<f64, Error> {
        let _acts = self.charge.rows(tokens.dims()[0])?;
        let loss = model.loss(tokens);
        let grads = GradientsParams::from_grads(loss.backward(), &*model);
        let value = loss
            .try_into_data()?
            .iter::<f64>()
            .next()
            .unwrap_or(f64::NAN);
        let updated = opt.step(self.args.lr, model.clone(), grads);
        B::sync(&self.dev)?;
        *model = updated;
        Ok(value)
    }

    /// `plain_step` under `catch_oom` (a cubecl out-of-memory panic is an error).
    fn plain_caught<O: Optimizer<Gpt<Ad<B>>, Ad<B>>>(
        &self,
        model: &mut Gpt<Ad<B>>,
        opt: &mut O,
        tokens: Tensor<Ad<B>, 2, Int>,
    ) -> Result<f64, Error> {
        catch_oom(|| self.plain_step(model, opt, tokens))
    }

    /// One `train_step` over `tokens` (the call site of every guarded step of the example).
    fn guarded_step<O: Optimizer<Gpt<Ad<B>>, Ad<B>>>(
        &self,
        engine: &RetryEngine,
        model: &mut Gpt<Ad<B>>,
        opt: &mut O,
        lr: f64,
        tokens: &Tensor<Ad<B>, 2, Int>,
    ) -> Result<TrainedStep, TrainStepError> {
        let batch = tokens.dims()[0];
        train_step(engine, &self.source, batch, model, opt, lr, |m, chunk| {
            let _acts = self.charge.rows(chunk.len())?;
            Ok(m.loss(chunk_rows(tokens, chunk)?))
        })
    }

    /// A fresh model and AdamW that have taken one step of one row (the optimizer's state
    /// exists, as in training).
    #[allow(clippy::type_complexity)]
    fn warm_model(&self) -> Result<(Gpt<Ad<B>>, impl Optimizer<Gpt<Ad<B>>, Ad<B>>), String> {
        let mut model = self.model();
        let mut opt = self.adamw();
        self.plain_caught(&mut model, &mut opt, self.tokens(1, 999))
            .map_err(|e| format!("a warm-up step of one row failed: {e}"))?;
        Ok((model, opt))
    }

    // ---- grads

    fn grads(&mut self) -> PhaseResult {
        let batch = self.args.grads_batch;
        let model = self.model();
        let tokens = self.tokens(batch, 1);
        let plan = BatchPlan::whole(batch).map_err(|e| e.to_string())?;
        let chunk = plan.chunks().next().ok_or("empty plan")?;
        let mut acc = GradAccumulator::<Ad<B>, Gpt<Ad<B>>>::new();
        let loss = model.loss(tokens.clone());
        catch_oom(|| acc.backward(&model, loss, &chunk)).map_err(|e| e.to_string())?;
        let mut count = Count::default();
        model.visit(&mut count);
        let (with_grad, missing) = match acc.into_grads(&model) {
            Ok(g) => (g.len(), Vec::new()),
            Err(Error::NoGradient { params }) => (count.trainable - params.len(), params),
            Err(e) => return Err(e.to_string()),
        };
        println!(
            "RESULT phase=grads params={} trainable={} elements={} with_grad={} missing={} \
             missing_list={}",
            count.all,
            count.trainable,
            count.elements,
            with_grad,
            missing.len(),
            if missing.is_empty() {
                "-".to_string()
            } else {
                missing.join(",")
            }
        );
        drop(model);

        // The loss over 5 AdamW steps on one batch.
        let mut model = self.model();
        let mut opt = self.adamw();
        let engine = RetryEngine::new();
        let mut losses = Vec::new();
        for s in 0..5 {
            let done = self
                .guarded_step(&engine, &mut model, &mut opt, self.args.lr, &tokens)
                .map_err(|e| e.to_string())?;
            println!(
                "STEP phase=grads step={} loss={:.5} {}",
                s + 1,
                done.loss,
                report_line(&done.report)
            );
            losses.push(done.loss);
        }
        let falls = losses.last() < losses.first() && losses.iter().all(|l| l.is_finite());
        println!(
            "RESULT phase=grads batch={batch} loss_first={:.5} loss_last={:.5} loss_falls={falls}",
            losses[0],
            losses[losses.len() - 1]
        );
        Ok(if missing.is_empty() && falls {
            Outcome::Pass
        } else {
            Outcome::Fail
        })
    }

    // ---- max

    /// The largest batch one plain step runs: doubling from 1, then bisection to one row.
    fn measure_max(&mut self) -> Result<(usize, usize), String> {
        let mut model = self.model();
        let mut opt = self.adamw();
        let mut trials = 0usize;
        let mut trial = |ctx: &Self, rows: usize| -> Result<bool, String> {
            ctx.cleanup();
            trials += 1;
            let t = Instant::now();
            let r = ctx.plain_caught(&mut model, &mut opt, ctx.tokens(rows, rows as u64));
            let secs = t.elapsed().as_secs_f64();
            let out = match &r {
                Ok(loss) => {
                    println!(
                        "TRIAL phase=max rows={rows} ok=true secs={secs:.2} loss={loss:.4} {}",
                        ctx.usage()
                    );
                    Ok(true)
                }
                Err(e) if e.is_oom() => {
                    println!(
                        "TRIAL phase=max rows={rows} ok=false secs={secs:.2} kind={} err={}",
                        err_kind(e),
                        one_line(&e.to_string())
                    );
                    Ok(false)
                }
                Err(e) => Err(format!("a trial of {rows} rows failed (not OOM): {e}")),
            };
            ctx.cleanup();
            out
        };
        let mut lo = 0usize; // largest that ran
        let mut hi = None; // smallest that did not
        let mut rows = 1usize;
        while rows <= self.args.max_cap {
            if self.out_of_time() {
                return Err(format!(
                    "out of time budget (ran {lo}, bisection unfinished)"
                ));
            }
            if trial(self, rows)? {
                lo = rows;
                rows *= 2;
            } else {
                hi = Some(rows);
                break;
            }
        }
        let Some(mut hi) = hi else {
            println!(
                "RESULT phase=max note=every_batch_up_to_max_cap_ran max_cap={}",
                lo
            );
            return Ok((lo, trials));
        };
        if lo == 0 {
            return Err("a plain step of one row ran out of memory".into());
        }
        while hi - lo > 1 {
            if self.out_of_time() {
                println!("RESULT phase=max note=bisection_cut_by_budget lo={lo} hi={hi}");
                break;
            }
            let mid = lo + (hi - lo) / 2;
            if trial(self, mid)? {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        Ok((lo, trials))
    }

    fn max_phase(&mut self) -> PhaseResult {
        let t = Instant::now();
        let (max, trials) = self.measure_max()?;
        println!(
            "RESULT phase=max max_batch={max} trials={trials} secs={:.1} seq={}",
            t.elapsed().as_secs_f64(),
            self.cfg.seq
        );
        self.max = Some(max);
        Ok(Outcome::Pass)
    }

    /// `--max`, the `max` phase's, or measured now.
    fn known_max(&mut self) -> Result<usize, String> {
        if let Some(m) = self.max {
            return Ok(m);
        }
        println!("NOTE no --max and no max phase yet: bisecting now");
        let (max, trials) = self.measure_max()?;
        println!("RESULT phase=max max_batch={max} trials={trials}");
        self.max = Some(max);
        Ok(max)
    }

    // ---- oom

    fn oom(&mut self) -> PhaseResult {
        let max = self.known_max()?;
        self.cleanup();
        let batch = ((max as f64 * self.args.oom_factor).round() as usize).max(max + 1);
        let mut model = self.model();
        let mut opt = self.adamw();
        let engine = RetryEngine::new();
        let tokens = self.tokens(batch, 7);
        let mut reports = Vec::new();
        let mut losses = Vec::new();
        for s in 0..3 {
            match self.guarded_step(&engine, &mut model, &mut opt, self.args.lr, &tokens) {
                Ok(done) => {
                    losses.push(done.loss);
                    println!(
                        "STEP phase=oom step={} batch={batch} rows={} loss={:.5} {} {}",
                        s + 1,
                        done.rows,
                        done.loss,
                        report_line(&done.report),
                        self.usage()
                    );
                    if s == 0 {
                        println!("{}", done.report);
                    }
                    reports.push(done.report);
                }
                Err(e) => {
                    println!(
                        "STEP phase=oom step={} batch={batch} failed={}",
                        s + 1,
                        one_line(&e.to_string())
                    );
                    println!("{e}");
                    return Ok(Outcome::Fail);
                }
            }
        }
        let first = &reports[0];
        let then_clean = reports[1..]
            .iter()
            .all(|r| r.retries() == 0 && r.from_memory && r.initial_plan == first.final_plan);
        // A step that survived must have trained on numbers: every parameter finite, every
        // loss finite (a parameter left uninitialised by an OOM trains on NaN).
        let non_finite = params_of(&model)?
            .iter()
            .flatten()
            .filter(|v| !v.is_finite())
            .count();
        let finite_losses = losses.iter().all(|l| l.is_finite());
        let pass = first.retries() >= 1
            && first.final_plan.num_chunks() > 1
            && then_clean
            && non_finite == 0
            && finite_losses;
        println!(
            "RESULT phase=oom max={max} batch={batch} step1_retries={} step1_final_plan={} \
             steps23_retries={},{} steps23_from_memory={} losses={losses:?} non_finite_params={non_finite} pass={pass}",
            first.retries(),
            plan_str(&first.final_plan),
            reports[1].retries(),
            reports[2].retries(),
            reports[1].from_memory && reports[2].from_memory
        );
        Ok(if pass { Outcome::Pass } else { Outcome::Fail })
    }

    // ---- equiv

    fn equiv(&mut self) -> PhaseResult {
        let sgd_lr = self.args.sgd_lr;
        let lr = self.args.lr;
        let a = self.equiv_with(
            "sgd",
            || SgdConfig::new().init::<Ad<B>, Gpt<Ad<B>>>(),
            sgd_lr,
        )?;
        self.cleanup();
        let b = self.equiv_with(
            "adamw",
            || AdamWConfig::new().init::<Ad<B>, Gpt<Ad<B>>>(),
            lr,
        )?;
        // The goal: SGD within 1e-5 (max abs); AdamW is reported.
        Ok(if a <= 1e-5 && b.is_finite() {
            Outcome::Pass
        } else {
            Outcome::Fail
        })
    }

    /// Runs `equiv_steps` steps as one pass and as 4 micro-batches from the same weights;
    /// returns the max abs difference.
    fn equiv_with<O: Optimizer<Gpt<Ad<B>>, Ad<B>>>(
        &mut self,
        name: &str,
        make: impl Fn() -> O,
        lr: f64,
    ) -> Result<f64, String> {
        let batch = self.args.equiv_batch;
        let steps = self.args.equiv_steps;
        let split = BatchPlan::new(batch, 4).map_err(|e| e.to_string())?;
        let init = self.model();
        // Reading every parameter initialises the lazy ones: the clones below then share the
        // same weights (a clone of an uninitialised parameter would draw its own).
        let w0 = params_of(&init)?;
        let batches: Vec<_> = (0..steps)
            .map(|s| self.tokens(batch, 100 + s as u64))
            .collect();

        // 1 × batch.
        let engine = RetryEngine::new();
        let mut model = init.clone();
        let mut opt = make();
        let mut site = None;
        for (s, t) in batches.iter().enumerate() {
            let done = self
                .guarded_step(&engine, &mut model, &mut opt, lr, t)
                .map_err(|e| format!("{name} 1x{batch} step {}: {e}", s + 1))?;
            println!(
                "STEP phase=equiv opt={name} plan=whole step={} loss={:.6} {}",
                s + 1,
                done.loss,
                report_line(&done.report)
            );
            if done.report.final_plan.num_chunks() != 1 {
                return Err(format!("{name}: the whole batch did not run in one pass"));
            }
            site = Some((done.report.site.clone(), done.report.mode));
        }
        let whole = params_of(&model)?;
        drop((model, opt, engine));
        self.cleanup();

        // 4 micro-batches: the plan forced through the engine's plan memory (the limits
        // remembered for the call site of `guarded_step` on this source, as after an OOM).
        let (site, mode) = site.ok_or("no step ran")?;
        let engine = RetryEngine::new().regrow_after(None);
        let key = MemoryKey::at(site, &*self.source, mode);
        engine
            .memory()
            .set_limits(
                &key,
                Limits {
                    micro_batch: Some(split.micro_batch()),
                    batch: None,
                },
            )
            .map_err(|e| e.to_string())?;
        let mut model = init.clone();
        let mut opt = make();
        for (s, t) in batches.iter().enumerate() {
            let done = self
                .guarded_step(&engine, &mut model, &mut opt, lr, t)
                .map_err(|e| format!("{name} {} step {}: {e}", plan_str(&split), s + 1))?;
            println!(
                "STEP phase=equiv opt={name} plan=forced step={} loss={:.6} {}",
                s + 1,
                done.loss,
                report_line(&done.report)
            );
            if done.report.final_plan != split || done.report.retries() != 0 {
                return Err(format!(
                    "{name}: the forced plan did not run (ran {}, wanted {})",
                    done.report.final_plan, split
                ));
            }
        }
        let parts = params_of(&model)?;
        drop((model, opt, engine));
        let (abs, rel, norm) = compare(&whole, &parts);
        let (moved, _, moved_norm) = compare(&w0, &whole);
        println!(
            "RESULT phase=equiv opt={name} lr={lr} batch={batch} plans=1x{batch}_vs_{} \
             steps={steps} max_abs_diff={abs:.3e} max_rel_diff={rel:.3e} norm_rel_diff={norm:.3e} \
             params_moved_max_abs={moved:.3e} params_moved_norm_rel={moved_norm:.3e}",
            plan_str(&split)
        );
        Ok(abs)
    }

    // ---- find

    fn find(&mut self) -> PhaseResult {
        self.cleanup();
        let (mut model, mut opt) = self.warm_model()?;
        let opts = FinderOptions {
            max: self.args.max_cap,
            ..FinderOptions::default()
        };
        let t = Instant::now();
        let mut runs = 0usize;
        let report = find_max_batch(&*self.source, opts, |rows| {
            runs += 1;
            let t = Instant::now();
            let r = catch_oom(|| self.plain_step(&mut model, &mut opt, self.tokens(rows, 55)));
            println!(
                "TRIAL phase=find rows={rows} ok={} secs={:.2}{}",
                r.is_ok(),
                t.elapsed().as_secs_f64(),
                match &r {
                    Err(e) => format!(" kind={} err={}", err_kind(e), one_line(&e.to_string())),
                    Ok(_) => String::new(),
                }
            );
            r
        })
        .map_err(|e| format!("find_max_batch: {e}"))?;
        let found = report.max_batch;
        println!("{report}");
        let ratio = self.max.map_or("na".to_string(), |m| {
            format!("{:.3}", found as f64 / m as f64)
        });
        println!(
            "RESULT phase=find found={found} trials={} step_runs={} closure_calls={runs} \
             secs={:.1} max={} ratio_to_max={ratio}",
            report.runs(),
            report.step_runs(),
            t.elapsed().as_secs_f64(),
            self.max.map_or("na".to_string(), |m| m.to_string()),
        );

        // Steps at the batch found, no trim between them.
        let engine = RetryEngine::new();
        let tokens = self.tokens(found, 77);
        let (mut ooms, mut retried_steps, mut failed, mut done_steps) = (0, 0, 0, 0);
        let mut times = Vec::new();
        for s in 0..self.args.find_steps {
            if self.out_of_time() {
                println!("NOTE phase=find steps_cut_by_budget after={s}");
                break;
            }
            let t = Instant::now();
            match self.guarded_step(&engine, &mut model, &mut opt, self.args.lr, &tokens) {
                Ok(d) => {
                    times.push(t.elapsed().as_secs_f64());
                    let r = d.report.retries();
                    ooms += r;
                    if r > 0 {
                        retried_steps += 1;
                        println!(
                            "STEP phase=find step={} retried loss={:.4} {}",
                            s + 1,
                            d.loss,
                            report_line(&d.report)
                        );
                    } else if s % 10 == 0 {
                        println!(
                            "STEP phase=find step={} loss={:.4} {} {}",
                            s + 1,
                            d.loss,
                            report_line(&d.report),
                            self.usage()
                        );
                    }
                }
                Err(e) => {
                    failed += 1;
                    println!(
                        "STEP phase=find step={} failed={}",
                        s + 1,
                        one_line(&e.to_string())
                    );
                }
            }
            done_steps += 1;
        }
        let step_median = median(&mut times);
        println!(
            "RESULT phase=find batch={found} steps={done_steps} ooms={ooms} \
             steps_with_retry={retried_steps} failed_steps={failed} step_median_secs={step_median:.3} \
             rows_per_sec={:.1}",
            found as f64 / step_median
        );
        Ok(if failed == 0 {
            Outcome::Pass
        } else {
            Outcome::Fail
        })
    }

    // ---- overhead

    fn overhead(&mut self) -> PhaseResult {
        let batch = self.args.overhead_batch;
        let (mut model, mut opt) = self.warm_model()?;
        let engine = RetryEngine::new();
        let tokens = self.tokens(batch, 11);
        let (mut plain, mut guarded) = (Vec::new(), Vec::new());
        let n = self.args.overhead_steps + 2;
        for i in 0..n {
            if self.out_of_time() {
                println!("NOTE phase=overhead cut_by_budget after={i}");
                break;
            }
            for which in [i % 2, 1 - i % 2] {
                let t = Instant::now();
                if which == 0 {
                    self.plain_caught(&mut model, &mut opt, tokens.clone())
                        .map_err(|e| format!("plain step: {e}"))?;
                } else {
                    let d = self
                        .guarded_step(&engine, &mut model, &mut opt, self.args.lr, &tokens)
                        .map_err(|e| format!("train_step: {e}"))?;
                    if d.report.retries() > 0 {
                        return Err(format!("train_step retried at batch {batch}"));
                    }
                    B::sync(&self.dev).map_err(|e| e.to_string())?;
                }
                let secs = t.elapsed().as_secs_f64();
                if i >= 2 {
                    if which == 0 {
                        plain.push(secs);
                    } else {
                        guarded.push(secs);
                    }
                }
            }
        }
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
        let (pm, gm) = (mean(&plain), mean(&guarded));
        let (pmed, gmed) = (median(&mut plain), median(&mut guarded));
        println!(
            "RESULT phase=overhead batch={batch} pairs={} plain_median_ms={:.2} \
             train_step_median_ms={:.2} ratio={:.4} plain_mean_ms={:.2} train_step_mean_ms={:.2}",
            plain.len(),
            pmed * 1e3,
            gmed * 1e3,
            gmed / pmed,
            pm * 1e3,
            gm * 1e3
        );
        Ok(Outcome::Pass)
    }

    // ---- cubecl

    // ---- curve

    fn curve(&mut self) -> PhaseResult {
        self.cleanup();
        let (mut model, mut opt) = self.warm_model()?;
        for &rows in &self.args.curve_rows.clone() {
            if self.out_of_time() {
                println!("NOTE phase=curve cut_by_budget rows={rows}");
                break;
            }
            self.cleanup();
            let before = self.source.usage().map(|u| u.used).unwrap_or(0);
            let _ = self.source.reset_peak();
            let t = Instant::now();
            let mut ok = 0;
            let mut err = String::new();
            for _ in 0..2 {
                match self.plain_caught(&mut model, &mut opt, self.tokens(rows, 91)) {
                    Ok(_) => ok += 1,
                    Err(e) => {
                        err = format!(" kind={}", err_kind(&e));
                        break;
                    }
                }
            }
            let secs = t.elapsed().as_secs_f64();
            let (peak, after_steps) = self
                .source
                .usage()
                .map(|u| (u.used_peak, u.used))
                .unwrap_or((0, 0));
            let cubecl_steps = cubecl_line(&*self.source);
            self.cleanup();
            let held = self.source.usage().map(|u| u.used).unwrap_or(0);
            println!(
                "TRIAL phase=curve rows={rows} steps_ok={ok}{err} secs={secs:.2} \
                 held_before={before} peak={peak} held_after_steps={after_steps} \
                 held_after_cleanup={held} gib_peak={:.2} gib_held_after_cleanup={:.2} \
                 cubecl_after_steps=[{cubecl_steps}] cubecl_after_cleanup=[{}]",
                peak as f64 / GIB,
                held as f64 / GIB,
                cubecl_line(&*self.source)
            );
        }
        Ok(Outcome::Pass)
    }

    // ---- budget

    fn budget(&mut self) -> PhaseResult {
        let limit = (self.args.budget_gib * GIB) as u64;
        let batch = self.args.budget_batch;
        self.cleanup();
        let (mut model, mut opt) = self.warm_model()?;
        let guard = self
            .source
            .budget(limit)
            .map_err(|e| format!("budget of {limit} B: {e}"))?;
        println!("NOTE phase=budget limit={limit} {}", self.usage());
        let _ = self.source.reset_peak();
        let engine = RetryEngine::new();
        let tokens = self.tokens(batch, 5);
        let mut steps_ok = 0;
        for s in 0..3 {
            match self.guarded_step(&engine, &mut model, &mut opt, self.args.lr, &tokens) {
                Ok(d) => {
                    steps_ok += 1;
                    println!(
                        "STEP phase=budget step={} rows={} loss={:.4} {} {}",
                        s + 1,
                        d.rows,
                        d.loss,
                        report_line(&d.report),
                        self.usage()
                    );
                }
                Err(e) => {
                    println!(
                        "STEP phase=budget step={} failed={}",
                        s + 1,
                        one_line(&e.to_string())
                    );
                    break;
                }
            }
        }
        let peak = self.source.usage().map(|u| u.reserved_peak).unwrap_or(0);
        // Within the limit, give or take the driver's page (the ballast's granularity).
        let within = peak <= limit + oomguard::source::BALLAST_PAGE;
        drop(guard);
        self.cleanup();
        let _ = self.source.reset_peak();
        let plain = self.plain_caught(&mut model, &mut opt, tokens);
        let plain_peak = self.source.usage().map(|u| u.reserved_peak).unwrap_or(0);
        println!(
            "RESULT phase=budget limit={limit} batch={batch} steps_ok={steps_ok} \
             reserved_peak_under_budget={peak} gib_peak={:.2} within_limit={within} \
             plain_step_after={} plain_peak={plain_peak} gib_plain_peak={:.2}",
            peak as f64 / GIB,
            if plain.is_ok() { "ran" } else { "failed" },
            plain_peak as f64 / GIB
        );
        Ok(if steps_ok == 3 && within {
            Outcome::Pass
        } else {
            Outcome::Fail
        })
    }

    fn cubecl(&mut self) -> PhaseResult {
        let max = self.known_max()?;
        self.cleanup();
        let (mut model, mut opt) = self.warm_model()?;
        let steps = self.args.cubecl_steps;
        let mut table = Vec::new();
        let mut pass = true;
        for &f in &self.args.cubecl_factors.clone() {
            if self.out_of_time() {
                println!("NOTE phase=cubecl cut_by_budget factor={f}");
                break;
            }
            let rows = ((max as f64 * f).round() as usize).max(1);
            let tokens = self.tokens(rows, 33);

            // The plain loop: what cubecl survives on its own (its cuMemAllocAsync ->
            // cuMemAlloc fallback); a loop without oomguard would die at the first OOM.
            self.cleanup();
            let mut plain_ok = 0;
            let mut plain_fail = "-".to_string();
            for s in 0..steps {
                match self.plain_caught(&mut model, &mut opt, tokens.clone()) {
                    Ok(_) => plain_ok += 1,
                    Err(e) => {
                        plain_fail = format!("step{}:{}", s + 1, err_kind(&e));
                        println!(
                            "STEP phase=cubecl factor={f} rows={rows} loop=plain step={} oom={} \
                             err={}",
                            s + 1,
                            e.is_oom(),
                            one_line(&e.to_string())
                        );
                        break;
                    }
                }
            }
            self.cleanup();

            // train_step, a fresh engine (nothing remembered).
            let engine = RetryEngine::new();
            let (mut g_ok, mut g_retries, mut g_plan) = (0, 0, "-".to_string());
            let mut g_fail = "-".to_string();
            for s in 0..steps {
                match self.guarded_step(&engine, &mut model, &mut opt, self.args.lr, &tokens) {
                    Ok(d) => {
                        g_ok += 1;
                        g_retries += d.report.retries();
                        g_plan = plan_str(&d.report.final_plan);
                        println!(
                            "STEP phase=cubecl factor={f} rows={rows} loop=train_step step={} {}",
                            s + 1,
                            report_line(&d.report)
                        );
                    }
                    Err(e) => {
                        g_fail = format!("step{}", s + 1);
                        println!(
                            "STEP phase=cubecl factor={f} rows={rows} loop=train_step step={} \
                             failed={}",
                            s + 1,
                            one_line(&e.to_string())
                        );
                        break;
                    }
                }
            }
            self.cleanup();
            pass &= g_ok == steps;
            println!(
                "RESULT phase=cubecl factor={f} rows={rows} plain_ok={plain_ok}/{steps} \
                 plain_first_oom={plain_fail} train_step_ok={g_ok}/{steps} \
                 train_step_retries={g_retries} train_step_plan={g_plan} \
                 train_step_failed={g_fail}"
            );
            table.push((f, rows, plain_ok, plain_fail, g_ok, g_retries, g_plan));
        }
        println!("| × max | rows | plain loop (cubecl alone) | train_step | retries | plan |");
        println!("|---|---|---|---|---|---|");
        for (f, rows, pok, pfail, gok, gr, gp) in table {
            let plain = if pok == steps {
                format!("{pok}/{steps} ran")
            } else {
                format!("{pok}/{steps} ran, OOM at {pfail}")
            };
            println!("| {f} | {rows} | {plain} | {gok}/{steps} ran | {gr} | {gp} |");
        }
        Ok(if pass { Outcome::Pass } else { Outcome::Fail })
    }
}

const GIB: f64 = (1u64 << 30) as f64;

/// The `cubecl:` line of a source's memory summary (in use, padding, reserved), or `-`.
fn cubecl_line(source: &dyn MemorySource) -> String {
    source
        .memory_summary()
        .lines()
        .find_map(|l| {
            l.split_once("cubecl:")
                .map(|(_, r)| r.trim_end_matches('|').trim().to_string())
        })
        .unwrap_or_else(|| "-".into())
}
