//! oomguard-burn on a GPT-2-small-shaped model (burn 0.21, CUDA backend), trained on seeded
//! synthetic tokens with AdamW: plain, and under oomguard. Feature `cuda`; `--backend ndarray`
//! (or `--device cpu`) runs the same phases on a tiny model on the CPU, where a simulated card
//! charged per row (`--sim-mib`, `--sim-row-kib`: 256 MiB, 4 MiB a row) gives the
//! out-of-memory. `--help` lists the phases and options.
//!
//! ```sh
//! cargo run --release -p oomguard-burn --features cuda --example burn_gpt -- --phase all
//! cargo run --release -p oomguard-burn --features cuda --example burn_gpt -- --backend ndarray --phase all
//! ```
//!
//! The command line, the output lines and the phases `max`, `equiv`, `oom`, `overhead`, `find`
//! (the harness's `finder`) and `plain` are oomguard-harness's, written once for the GPT
//! examples: every measured figure is one `RESULT phase=NAME key=value ...` line (`--json`: one
//! JSON object per line), `STEP` and `TRIAL` lines show the work inside a phase, and each phase
//! ends with `PHASE phase=NAME status=ok|FAIL|error|panicked secs=..`. This example gives them
//! burn's model and steps (`bench.rs`) and keeps its own `grads`, `cubecl`, `curve` and
//! `budget`.
//!
//! Every out-of-memory is caught (`catch_oom`, `train_step`). The exit status is 0 when every
//! phase ran and its checks held, 1 otherwise, 2 when the CUDA device cannot be used, 64 on a
//! bad command line.

mod bench;
mod model;
mod phase_budget;
mod phase_cubecl;
mod phase_curve;
mod phase_grads;

use std::any::Any;
use std::panic;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::backend::NdArray;
use burn::tensor::backend::Backend;
use oomguard::{ByteSize, MemorySource};
use oomguard_harness::{one_line, say, Args, DeviceArg, Line, Runner, Spec};

use bench::{BurnBench, Charge};
use model::GptConfig;

/// The command line.
const SPEC: Spec = Spec {
    program: "burn_gpt",
    usage: USAGE,
    all_phases: &["grads", "max", "equiv", "oom", "cubecl", "overhead", "find"],
    extra_phases: &["curve", "budget", "plain"],
    // burn's tensors live in cubecl's pools: nothing else to choose.
    allocators: &["cubecl"],
    max_cap: (4096, 4096),
    // The figures of docs/GPU.md were taken with these.
    defaults: &[("sgd_lr", "0.1"), ("grads_steps", "5")],
    positional: false,
    default_phases: &[],
};

const USAGE: &str = "\
burn_gpt: oomguard-burn on a GPT-2-small-shaped model (burn 0.21, CUDA), plain and under oomguard

phases (repeatable, comma-separated, or `all` = grads,max,equiv,oom,cubecl,overhead,find):
  grads     one backward: every parameter gets a gradient; the loss falls over
            --grads-steps (default 5) train_step steps on one batch
  max       the largest batch a plain step runs: doubling, then bisection, up to --max-cap
  equiv     1 x B against 4 x B/4 micro-batches (--equiv-batch), SGD then AdamW
  oom       train_step at --oom-factor x max, --oom-steps steps: the OOM survived, later steps
            from the plan; then the settled split and its neighbours timed as plain steps
  cubecl    the plain loop (cubecl's own fallback only) and train_step at --cubecl-factors
            x max: which survive
  overhead  train_step vs the plain loop at --batch, alternated: the time ratio
  find      find_max_batch on plain steps; --find-steps plain steps at its batch; then
            the true max (as `max`) and found / true
  (only when named:)
  plain     a plain burn loop at --batch: ms/step median, peaks
  curve     two plain steps at each of --curve-rows: peak, what stays held, cubecl's counters
  budget    the source's budget (--budget-gib), 3 train_step steps at --budget-batch under
            it, then one plain step without it

model: GPT-2 small (12 layers, width 768, 12 heads, vocab 50257, seq 512); on ndarray
(--backend ndarray or --device cpu) or with --tiny: 2 layers, width 32, 2 heads, vocab 128,
seq 16; --layers etc. override either.
";

/// The options only this example has.
#[derive(clap::Args)]
pub struct Own {
    /// cuda or ndarray [default: cuda; ndarray with --device cpu].
    #[arg(long)]
    backend: Option<String>,
    /// --batch, under another name.
    #[arg(long, value_name = "N")]
    overhead_batch: Option<i64>,
    /// Steps of `overhead`: ceil(N / 5) rounds.
    #[arg(long, value_name = "N")]
    overhead_steps: Option<usize>,
    /// Factors of the largest batch `cubecl` runs.
    #[arg(long, value_name = "LIST", value_delimiter = ',', default_values_t = [1.0, 1.25, 2.0])]
    pub cubecl_factors: Vec<f64>,
    /// Steps per cell of `cubecl`.
    #[arg(long, value_name = "N", default_value_t = 2)]
    pub cubecl_steps: usize,
    /// Batches `curve` runs, in order.
    #[arg(long, value_name = "LIST", value_delimiter = ',',
          default_values_t = [8, 16, 24, 32, 40, 48, 56, 64, 80, 64, 48])]
    pub curve_rows: Vec<usize>,
    /// The memory source's budget in `budget`, GiB.
    #[arg(long, value_name = "X", default_value_t = 40.0)]
    pub budget_gib: f64,
    /// Batch of `budget`.
    #[arg(long, value_name = "N", default_value_t = 32)]
    pub budget_batch: usize,
    /// Phases that would start after S seconds do not run (status error); cubecl and curve
    /// stop their loops then.
    #[arg(long, value_name = "S")]
    budget_s: Option<f64>,
    /// ndarray: the simulated card, MiB.
    #[arg(long, value_name = "N", default_value_t = 256)]
    sim_mib: u64,
    /// ndarray: charge per row of a step, KiB.
    #[arg(long, value_name = "N", default_value_t = 4096)]
    sim_row_kib: usize,
    /// When `--budget-s` runs out.
    #[arg(skip)]
    pub deadline: Option<Instant>,
}

impl Own {
    /// Whether `--budget-s` has run out.
    pub fn out_of_time(&self) -> bool {
        self.deadline.is_some_and(|d| Instant::now() >= d)
    }
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
        let text = panic_text(info.payload());
        let thread = std::thread::current();
        let name = thread.name().unwrap_or("<unnamed>");
        let first = one_line(&text);
        if name != "main" {
            let n = THREAD_PANICS.fetch_add(1, Ordering::SeqCst) + 1;
            if n <= 20 || n % 100 == 0 {
                let oom = oomguard_burn::panic_message_is_oom(&text);
                eprintln!("[panic #{n} on thread {name}, out of memory: {oom}] {first}");
            }
        } else if oomguard_burn::panic_message_is_oom(&text) {
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

/// The model, the backend (`true`: CUDA) and the simulated card's size and charge per row,
/// from the command line; `args` and `own` adjusted where this example's options say so.
fn configure(args: &mut Args, own: &mut Own) -> Result<(GptConfig, bool, (u64, usize)), String> {
    let cuda = match own.backend.as_deref() {
        None => args.device.is_cuda(),
        Some("ndarray") => false,
        Some("cuda") if !args.device.is_cuda() => {
            return Err("--backend cuda with --device cpu".into())
        }
        Some("cuda") => true,
        Some(other) => return Err(format!("--backend {other}: cuda or ndarray")),
    };
    let mut cfg = if cuda && !args.tiny {
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
    let m = args.model;
    let dim = |v: Option<i64>, d: usize, name: &str| -> Result<usize, String> {
        match v {
            None => Ok(d),
            Some(v) if v >= 1 => Ok(v as usize),
            Some(v) => Err(format!("--{name} {v}: at least 1")),
        }
    };
    cfg.layers = dim(m.layers, cfg.layers, "layers")?;
    cfg.width = dim(m.width, cfg.width, "width")?;
    cfg.heads = dim(m.heads, cfg.heads, "heads")?;
    cfg.vocab = dim(m.vocab, cfg.vocab, "vocab")?;
    cfg.seq = dim(m.seq, cfg.seq, "seq")?;
    if cfg.width % cfg.heads != 0 || cfg.seq < 2 || cfg.vocab < 2 {
        return Err("width must be a multiple of heads; seq and vocab at least 2".into());
    }
    if let Some(b) = own.overhead_batch {
        if b < 1 {
            return Err("--overhead-batch at least 1".into());
        }
        args.batch = b;
    }
    if let Some(n) = own.overhead_steps {
        args.overhead_rounds = n.div_ceil(5).max(1);
    }
    if let Some(s) = own.budget_s {
        if s.is_nan() || s < 0.0 {
            return Err("--budget-s: seconds, at least 0".into());
        }
        own.deadline = Some(Instant::now() + Duration::from_secs_f64(s.min(1e9)));
    }
    if own
        .cubecl_factors
        .iter()
        .any(|f| !(f.is_finite() && *f > 0.0))
        || own.cubecl_steps == 0
        || own.budget_batch == 0
        || own.curve_rows.contains(&0)
        || !(own.budget_gib.is_finite() && own.budget_gib > 0.0)
    {
        return Err(
            "--cubecl-factors, --cubecl-steps, --curve-rows, --budget-gib and \
                    --budget-batch must be more than 0"
                .into(),
        );
    }
    let per_row = own
        .sim_row_kib
        .checked_mul(1024)
        .ok_or("--sim-row-kib: too large")?;
    Ok((cfg, cuda, (own.sim_mib, per_row)))
}

fn main() -> ExitCode {
    let (mut args, mut own) = match oomguard_harness::from_env::<Own>(&SPEC) {
        Ok(a) => a,
        Err(code) => return code,
    };
    let (cfg, cuda, (sim_mib, per_row)) = match configure(&mut args, &mut own) {
        Ok(c) => c,
        Err(e) => return SPEC.usage_error(&e),
    };
    install_panic_hook();
    if cuda {
        let DeviceArg::Cuda(ordinal) = args.device else {
            unreachable!("configure refuses --backend cuda with --device cpu")
        };
        run_cuda(args, own, cfg, ordinal)
    } else {
        let sim = oomguard::Device::sim(ByteSize::mib(sim_mib));
        let source: Arc<dyn MemorySource> = Arc::new(sim.clone());
        let charge = Charge {
            sim: Some(sim),
            per_row,
        };
        run::<NdArray>(args, own, cfg, Default::default(), source, charge)
    }
}

/// The CUDA device, checked: its driver first (an error, never a panic, without one), then
/// cubecl on a first kernel (a panic there is caught and said in one line).
fn run_cuda(args: Args, own: Own, cfg: GptConfig, ordinal: usize) -> ExitCode {
    use burn::backend::cuda::CudaDevice;
    use burn::backend::Cuda;
    use burn::tensor::Tensor;
    let dev = CudaDevice::new(ordinal);
    let source = match oomguard_burn::memory_source::<bench::Ad<Cuda>>(&dev) {
        Ok(s) => s,
        Err(e) => {
            say!("burn_gpt: no usable CUDA device cuda:{ordinal}: {e}");
            return ExitCode::from(2);
        }
    };
    QUIET.store(true, Ordering::SeqCst);
    let probe = panic::catch_unwind(|| {
        let t = Tensor::<Cuda, 1>::ones([16], &dev);
        t.sum().try_into_data().map(|d| d.iter::<f32>().next())
    });
    QUIET.store(false, Ordering::SeqCst);
    let failed = match probe {
        Ok(Ok(Some(16.0))) => None,
        Ok(Ok(v)) => Some(format!(
            "the CUDA device computed a wrong sum ({v:?}, not 16)"
        )),
        Ok(Err(e)) => Some(format!("burn's CUDA backend failed on a first kernel: {e}")),
        Err(p) => Some(format!(
            "burn's CUDA backend panicked on a first kernel: {}",
            one_line(&panic_text(p.as_ref()))
        )),
    };
    if let Some(f) = failed {
        say!("burn_gpt: {f}");
        return ExitCode::from(2);
    }
    run::<Cuda>(args, own, cfg, dev, source, Charge::none())
}

/// The phases on backend `B`.
fn run<B: Backend>(
    args: Args,
    own: Own,
    cfg: GptConfig,
    dev: B::Device,
    source: Arc<dyn MemorySource>,
    charge: Charge,
) -> ExitCode {
    let device = match &charge.sim {
        Some(_) => DeviceArg::Cpu,
        None => args.device,
    };
    Line::config()
        .text(
            "backend",
            if charge.sim.is_some() {
                "ndarray"
            } else {
                "cuda"
            },
        )
        .text("device", device.to_string())
        .flag("simulated_card", charge.sim.is_some())
        .int("layers", cfg.layers as i64)
        .int("width", cfg.width as i64)
        .int("heads", cfg.heads as i64)
        .int("vocab", cfg.vocab as i64)
        .int("seq", cfg.seq as i64)
        .int("seed", args.seed as i64)
        .float("lr", args.lr, 0)
        .text("source", source.info().to_string())
        .text("phases", args.phases.join(","))
        .emit(args.json);
    let bench = BurnBench::<B> {
        cfg,
        dev,
        source,
        charge,
        seed: args.seed,
        lr: args.lr,
        sgd_lr: args.sgd_lr,
    };
    Runner::new(bench, args).run(|r, name| {
        if own.out_of_time() {
            return Some(Err("not started: the --budget-s seconds were spent".into()));
        }
        Some(match name {
            "grads" => phase_grads::grads(r),
            "cubecl" => phase_cubecl::cubecl(r, &own),
            "curve" => phase_curve::curve(r, &own),
            "budget" => phase_budget::budget(r, &own),
            "find" => r.finder(),
            _ => return None,
        })
    })
}
