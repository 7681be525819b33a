//! The example's command line.

use tch::Device;

use crate::model::Config;

/// Phases in the order `all` runs them.
pub const ALL_PHASES: [&str; 6] = ["grads", "plain", "equiv", "finder", "oom", "overhead"];

/// Phases run only when named (`alloc` starts two child processes of `alloc-one`).
pub const EXTRA_PHASES: [&str; 3] = ["max", "alloc", "alloc-one"];

pub const USAGE: &str = "\
tch_gpt: a GPT-2-small-shaped model in tch (libtorch), plain and under oomguard (issue 33, item 5)

usage: tch_gpt [--phase NAME]... [options]

phases (repeatable, comma-separated, or `all` = grads,plain,equiv,finder,oom,overhead):
  grads     one backward: every parameter has a finite non-zero gradient; the loss falls
            over --grads-steps AdamW steps on one batch
  plain     a plain tch loop (forward, backward, step, zero_grad) at --batch: ms/step median
  equiv     1 x B against 4 x B/4 micro-batches (--equiv-batch), SGD then AdamW
  finder    find_max_batch on plain steps; --find-steps plain steps at its batch; then
            the true max (as `max`) and found / true
  oom       train_step at --oom-factor x max: the OOM survived, later steps from the plan
  max       (also run by finder and oom when needed) the largest batch a plain step runs:
            doubling, then bisection, up to --max-cap
  overhead  train_step vs the plain loop at --batch, alternated: the time ratio
  alloc     (only when named) libtorch's native allocator vs expandable segments vs
            oomguard's allocator under libtorch: this program run three times as child
            processes (PYTORCH_ALLOC_CONF is read at CUDA init, the allocator is installed
            before it) with --phase alloc-one; each prints its RESULT phase=alloc line
  alloc-one (only when named) the allocator this process has: --steps plain steps at
            --batch (median ms, peak reserved / peak used), then the largest batch

model (default GPT-2 small: 12 layers, width 768, 12 heads, vocab 50257, seq 1024):
  --tiny                   2 layers, width 32, 2 heads, vocab 64, seq 16 (a CPU run in seconds)
  --layers N --width N --heads N --vocab N --seq N   (after --tiny, override it)
options:
  --device cpu|cuda|cuda:N (default cuda)
  --allocator libtorch|oomguard   who serves the CUDA tensors (default libtorch): oomguard
                           installs oomguard's caching allocator under libtorch first
                           (oomguard_tch::allocator::install); its Device is then the source
  --seed N                 weights and tokens (default 1234)
  --lr X                   AdamW learning rate (default 3e-4)
  --sgd-lr X               SGD learning rate of `equiv` (default 0.05)
  --batch N                rows of `plain` and `overhead` (default 8)
  --steps N                timed steps of `plain` (default 20)
  --warmup N               untimed steps before them (default 3)
  --grads-batch N          (default 4)
  --grads-steps N          (default 10)
  --max N                  the largest batch of a plain step: skips `max`'s bisection
  --max-cap N              largest batch `max` and `finder` try (default 4096; --tiny: 1024)
  --oom-factor X           (default 2)
  --equiv-batch N          a multiple of 4 (default 8)
  --equiv-steps N          (default 3)
  --find-steps N           (default 100)
  --overhead-rounds N      rounds of 5 plain + 5 train_step steps (default 12)
  --json                   RESULT lines as JSON objects
";

/// Parsed options.
#[derive(Clone, Debug)]
pub struct Args {
    pub phases: Vec<String>,
    pub device: Device,
    pub tiny: bool,
    pub cfg: Config,
    pub seed: u64,
    pub lr: f64,
    pub sgd_lr: f64,
    pub batch: i64,
    pub steps: usize,
    pub warmup: usize,
    pub grads_batch: i64,
    pub grads_steps: usize,
    pub max: Option<i64>,
    pub max_cap: i64,
    pub oom_factor: f64,
    pub equiv_batch: i64,
    pub equiv_steps: usize,
    pub find_steps: usize,
    pub overhead_rounds: usize,
    pub json: bool,
    /// `--allocator oomguard`: oomguard's allocator under libtorch.
    pub oomguard_allocator: bool,
}

fn parse_device(v: &str) -> Result<Device, String> {
    match v {
        "cpu" => Ok(Device::Cpu),
        "cuda" => Ok(Device::Cuda(0)),
        _ => v
            .strip_prefix("cuda:")
            .and_then(|n| n.parse().ok())
            .map(Device::Cuda)
            .ok_or_else(|| format!("--device {v:?}: cpu, cuda or cuda:N")),
    }
}

/// `Err("")` for `--help`.
pub fn parse(raw: &[String]) -> Result<Args, String> {
    let mut kv: Vec<(String, Option<String>)> = Vec::new();
    let mut i = 0;
    while i < raw.len() {
        let a = &raw[i];
        if a == "-h" || a == "--help" {
            return Err(String::new());
        }
        let Some(name) = a.strip_prefix("--") else {
            return Err(format!("unexpected argument {a:?}"));
        };
        if name == "tiny" || name == "json" {
            kv.push((name.to_string(), None));
        } else if let Some((n, v)) = name.split_once('=') {
            kv.push((n.to_string(), Some(v.to_string())));
        } else {
            i += 1;
            let v = raw
                .get(i)
                .ok_or_else(|| format!("--{name} needs a value"))?;
            kv.push((name.to_string(), Some(v.clone())));
        }
        i += 1;
    }
    let tiny = kv.iter().any(|(k, _)| k == "tiny");
    let mut a = Args {
        phases: Vec::new(),
        device: Device::Cuda(0),
        tiny,
        cfg: if tiny {
            Config::tiny()
        } else {
            Config::gpt2_small()
        },
        seed: 1234,
        lr: 3e-4,
        sgd_lr: 0.05,
        batch: 8,
        steps: 20,
        warmup: 3,
        grads_batch: 4,
        grads_steps: 10,
        max: None,
        max_cap: if tiny { 1024 } else { 4096 },
        oom_factor: 2.0,
        equiv_batch: 8,
        equiv_steps: 3,
        find_steps: 100,
        overhead_rounds: 12,
        json: false,
        oomguard_allocator: false,
    };
    fn num<T: std::str::FromStr>(k: &str, v: &str) -> Result<T, String> {
        v.parse().map_err(|_| format!("--{k} {v:?}: not a number"))
    }
    for (k, v) in &kv {
        let Some(v) = v else {
            if k == "json" {
                a.json = true;
            }
            continue;
        };
        match k.as_str() {
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
            "device" => a.device = parse_device(v)?,
            "allocator" => {
                a.oomguard_allocator = match v.as_str() {
                    "libtorch" => false,
                    "oomguard" => true,
                    _ => return Err(format!("--allocator {v:?}: libtorch or oomguard")),
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
            "batch" => a.batch = num(k, v)?,
            "steps" => a.steps = num(k, v)?,
            "warmup" => a.warmup = num(k, v)?,
            "grads-batch" => a.grads_batch = num(k, v)?,
            "grads-steps" => a.grads_steps = num(k, v)?,
            "max" => a.max = Some(num(k, v)?),
            "max-cap" => a.max_cap = num(k, v)?,
            "oom-factor" => a.oom_factor = num(k, v)?,
            "equiv-batch" => a.equiv_batch = num(k, v)?,
            "equiv-steps" => a.equiv_steps = num(k, v)?,
            "find-steps" => a.find_steps = num(k, v)?,
            "overhead-rounds" => a.overhead_rounds = num(k, v)?,
            _ => return Err(format!("unknown option --{k}")),
        }
    }
    if a.phases.is_empty() {
        return Err("no --phase given".into());
    }
    if a.oomguard_allocator && !a.device.is_cuda() {
        return Err("--allocator oomguard serves CUDA tensors: it needs --device cuda".into());
    }
    a.cfg.check()?;
    if a.batch < 1 || a.grads_batch < 1 || a.max_cap < 1 || a.max.is_some_and(|m| m < 1) {
        return Err("--batch, --grads-batch, --max and --max-cap must be at least 1".into());
    }
    if a.steps == 0 || a.grads_steps < 2 || a.equiv_steps == 0 || a.overhead_rounds == 0 {
        return Err(
            "--steps, --equiv-steps and --overhead-rounds at least 1; --grads-steps at least 2"
                .into(),
        );
    }
    if a.equiv_batch < 4 || a.equiv_batch % 4 != 0 {
        return Err(format!(
            "--equiv-batch {}: a multiple of 4 (it is split into 4 micro-batches)",
            a.equiv_batch
        ));
    }
    if a.oom_factor.is_nan() || a.oom_factor <= 1.0 {
        return Err(format!("--oom-factor {}: more than 1", a.oom_factor));
    }
    Ok(a)
}
