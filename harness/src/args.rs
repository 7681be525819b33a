//! The examples' one command line: `--phase NAME`... and `--key value` (or `--key=value`)
//! options, the union of what the GPT examples take. An example names its phases, allocators
//! and usage text in a [`Spec`]; what only its framework can check (the model's shape, an
//! allocator that needs CUDA) it checks after [`parse`], and reports like a parse error
//! ([`Spec::usage_error`]: exit status 64).

use std::process::ExitCode;

/// The exit status of a bad command line (BSD's `EX_USAGE`).
pub const EXIT_USAGE: u8 = 64;

/// What an example accepts.
#[derive(Clone, Copy, Debug)]
pub struct Spec {
    /// The program's name, the prefix of its error messages.
    pub program: &'static str,
    /// `--help`'s text.
    pub usage: &'static str,
    /// Phases in the order `--phase all` runs them.
    pub all_phases: &'static [&'static str],
    /// Phases run only when named.
    pub extra_phases: &'static [&'static str],
    /// The values `--allocator` takes; the first is the default.
    pub allocators: &'static [&'static str],
    /// `--max-cap`'s default, without and with `--tiny`.
    pub max_cap: (i64, i64),
    /// The example's own options (names without `--`), each taking a value: kept in
    /// [`Args::options`] for the example to read ([`Args::option`]).
    pub options: &'static [&'static str],
    /// Whether arguments not starting with `--` are taken: the first as a phase (as
    /// `--phase`), the others kept in [`Args::positional`]. Without a phase, [`Spec::default_phases`]
    /// run.
    pub positional: bool,
    /// The phases run when none is named (empty: a phase must be named).
    pub default_phases: &'static [&'static str],
}

impl Spec {
    /// Prints `message` and the usage on stderr: the exit status of a bad command line.
    pub fn usage_error(&self, message: &str) -> ExitCode {
        eprintln!("{}: {message}\n\n{}", self.program, self.usage);
        ExitCode::from(EXIT_USAGE)
    }
}

/// `--device`: the CPU (a simulated card stands in for the device's memory) or a CUDA ordinal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceArg {
    /// `cpu`.
    Cpu,
    /// `cuda` (ordinal 0) or `cuda:N`.
    Cuda(usize),
}

impl DeviceArg {
    /// `cpu`, `cuda`, `cuda:N` or `N` (a CUDA ordinal).
    pub fn parse(v: &str) -> Result<Self, String> {
        match v {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            _ => v
                .strip_prefix("cuda:")
                .unwrap_or(v)
                .parse()
                .ok()
                .map(Self::Cuda)
                .ok_or_else(|| format!("--device {v:?}: cpu, cuda, cuda:N or N")),
        }
    }

    /// Whether it is a CUDA device.
    pub fn is_cuda(self) -> bool {
        matches!(self, Self::Cuda(_))
    }
}

impl std::fmt::Display for DeviceArg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// The model's shape as given on the command line (`None`: the example's default, or
/// `--tiny`'s).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ModelArgs {
    /// `--layers`.
    pub layers: Option<i64>,
    /// `--width`.
    pub width: Option<i64>,
    /// `--heads`.
    pub heads: Option<i64>,
    /// `--vocab`.
    pub vocab: Option<i64>,
    /// `--seq`.
    pub seq: Option<i64>,
}

/// The parsed options.
#[derive(Clone, Debug, PartialEq)]
pub struct Args {
    /// The phases, in the order given (`all` expanded).
    pub phases: Vec<String>,
    /// `--device` (default `cuda`).
    pub device: DeviceArg,
    /// `--tiny`: the small model (a CPU run in seconds).
    pub tiny: bool,
    /// `--layers` etc.
    pub model: ModelArgs,
    /// `--seed`: weights and tokens (default 1234).
    pub seed: u64,
    /// `--lr`: AdamW's learning rate (default 3e-4).
    pub lr: f64,
    /// `--sgd-lr`: SGD's, in `equiv` (default 0.05).
    pub sgd_lr: f64,
    /// `--batch`: rows of `plain` and `overhead` (default 8).
    pub batch: i64,
    /// `--steps`: timed steps of `plain` (default 20).
    pub steps: usize,
    /// `--warmup`: untimed steps before them (default 3).
    pub warmup: usize,
    /// `--grads-batch` (default 4).
    pub grads_batch: i64,
    /// `--grads-steps` (default 10).
    pub grads_steps: usize,
    /// `--max`: the largest batch of a plain step, when known.
    pub max: Option<i64>,
    /// `--max-cap`: the largest batch `max` and `finder` try.
    pub max_cap: i64,
    /// `--oom-factor`: `oom`'s batch over the largest (default 2).
    pub oom_factor: f64,
    /// `--oom-batch`: `oom`'s batch, given (then the largest batch is not measured).
    pub oom_batch: Option<i64>,
    /// `--equiv-batch`: a multiple of 4 (default 8).
    pub equiv_batch: i64,
    /// `--equiv-steps` (default 3).
    pub equiv_steps: usize,
    /// `--find-steps`: plain steps at the batch `finder` found (default 100).
    pub find_steps: usize,
    /// `--overhead-rounds`: rounds of 5 plain and 5 guarded steps (default 12).
    pub overhead_rounds: usize,
    /// `--json`: lines as JSON objects.
    pub json: bool,
    /// `--allocator`: one of [`Spec::allocators`].
    pub allocator: String,
    /// The example's own options ([`Spec::options`]), as given.
    pub options: Vec<(String, String)>,
    /// Arguments after the phase that do not start with `--` ([`Spec::positional`]).
    pub positional: Vec<String>,
}

impl Args {
    /// The example's option `name` ([`Spec::options`]; the last one given), parsed; `Err` names
    /// the option and the value.
    pub fn option<T: std::str::FromStr>(&self, name: &str) -> Result<Option<T>, String> {
        match self.options.iter().rev().find(|(k, _)| k == name) {
            None => Ok(None),
            Some((_, v)) => v
                .parse()
                .map(Some)
                .map_err(|_| format!("--{name} {v:?}: not a valid value")),
        }
    }
}

/// What [`parse`] found.
#[derive(Clone, Debug, PartialEq)]
pub enum Parsed {
    /// `-h` or `--help`.
    Help,
    /// Options to run.
    Run(Box<Args>),
}

/// Parses `raw` (the arguments after the program's name) against `spec`; `Err` says what is
/// wrong with the command line.
pub fn parse(raw: &[String], spec: &Spec) -> Result<Parsed, String> {
    let mut kv: Vec<(String, Option<String>)> = Vec::new();
    let mut positional = Vec::new();
    let mut i = 0;
    while i < raw.len() {
        let a = &raw[i];
        if a == "-h" || a == "--help" {
            return Ok(Parsed::Help);
        }
        let Some(name) = a.strip_prefix("--") else {
            if !spec.positional {
                return Err(format!("unexpected argument {a:?}"));
            }
            if positional.is_empty() && kv.iter().all(|(k, _)| k != "phase") {
                kv.push(("phase".into(), Some(a.clone())));
            }
            positional.push(a.clone());
            i += 1;
            continue;
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
        device: DeviceArg::Cuda(0),
        tiny,
        model: ModelArgs::default(),
        seed: 1234,
        lr: 3e-4,
        sgd_lr: 0.05,
        batch: 8,
        steps: 20,
        warmup: 3,
        grads_batch: 4,
        grads_steps: 10,
        max: None,
        max_cap: if tiny { spec.max_cap.1 } else { spec.max_cap.0 },
        oom_factor: 2.0,
        oom_batch: None,
        equiv_batch: 8,
        equiv_steps: 3,
        find_steps: 100,
        overhead_rounds: 12,
        json: false,
        allocator: spec.allocators.first().copied().unwrap_or("").to_string(),
        options: Vec::new(),
        // The first is the phase.
        positional: positional.into_iter().skip(1).collect(),
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
                        a.phases
                            .extend(spec.all_phases.iter().map(|s| s.to_string()));
                    } else if spec.all_phases.contains(&p) || spec.extra_phases.contains(&p) {
                        a.phases.push(p.to_string());
                    } else {
                        return Err(format!("unknown phase {p:?}"));
                    }
                }
            }
            "device" => a.device = DeviceArg::parse(v)?,
            "allocator" => {
                if !spec.allocators.contains(&v.as_str()) {
                    return Err(format!(
                        "--allocator {v:?}: {}",
                        spec.allocators.join(" or ")
                    ));
                }
                a.allocator = v.clone();
            }
            "layers" => a.model.layers = Some(num(k, v)?),
            "width" => a.model.width = Some(num(k, v)?),
            "heads" => a.model.heads = Some(num(k, v)?),
            "vocab" => a.model.vocab = Some(num(k, v)?),
            "seq" => a.model.seq = Some(num(k, v)?),
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
            "oom-batch" => a.oom_batch = Some(num(k, v)?),
            "equiv-batch" => a.equiv_batch = num(k, v)?,
            "equiv-steps" => a.equiv_steps = num(k, v)?,
            "find-steps" => a.find_steps = num(k, v)?,
            "overhead-rounds" => a.overhead_rounds = num(k, v)?,
            _ if spec.options.contains(&k.as_str()) => a.options.push((k.clone(), v.clone())),
            _ => return Err(format!("unknown option --{k}")),
        }
    }
    if a.phases.is_empty() {
        if spec.default_phases.is_empty() {
            return Err("no --phase given".into());
        }
        a.phases = spec.default_phases.iter().map(|s| s.to_string()).collect();
    }
    check(&a)?;
    Ok(Parsed::Run(Box::new(a)))
}

/// The checks of the numbers that hold for every example.
fn check(a: &Args) -> Result<(), String> {
    if a.batch < 1
        || a.grads_batch < 1
        || a.max_cap < 1
        || a.max.is_some_and(|m| m < 1)
        || a.oom_batch.is_some_and(|m| m < 1)
    {
        return Err(
            "--batch, --grads-batch, --max, --max-cap and --oom-batch must be at least 1".into(),
        );
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
    Ok(())
}

/// The process's arguments parsed against `spec`: `Err` is the exit status to end with (0
/// after `--help`, printed on stdout; 64 after a bad command line, said on stderr).
pub fn from_env(spec: &Spec) -> Result<Args, ExitCode> {
    let raw: Vec<String> = std::env::args().skip(1).collect();
    match parse(&raw, spec) {
        Ok(Parsed::Run(a)) => Ok(*a),
        Ok(Parsed::Help) => {
            print!("{}", spec.usage);
            Err(ExitCode::SUCCESS)
        }
        Err(e) => Err(spec.usage_error(&e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPEC: Spec = Spec {
        program: "t",
        usage: "",
        all_phases: &["a", "b"],
        extra_phases: &["x"],
        allocators: &["native", "oomguard"],
        max_cap: (4096, 1024),
        options: &["big"],
        positional: false,
        default_phases: &[],
    };

    const POSITIONAL: Spec = Spec {
        positional: true,
        default_phases: &["a", "b"],
        ..SPEC
    };

    fn run(cli: &str) -> Result<Args, String> {
        let raw: Vec<String> = cli.split_whitespace().map(String::from).collect();
        match parse(&raw, &SPEC)? {
            Parsed::Run(a) => Ok(*a),
            Parsed::Help => Err("help".into()),
        }
    }

    #[test]
    fn defaults_and_all() {
        let a = run("--phase all,x").unwrap();
        assert_eq!(a.phases, ["a", "b", "x"]);
        assert_eq!(a.device, DeviceArg::Cuda(0));
        assert_eq!((a.batch, a.steps, a.max_cap, a.max), (8, 20, 4096, None));
        assert_eq!(a.allocator, "native");
        assert!(!a.json && !a.tiny);
        assert_eq!(run("--tiny --phase a").unwrap().max_cap, 1024);
    }

    #[test]
    fn values_in_both_forms() {
        let a = run("--phase=b --batch=3 --steps 7 --device cuda:2 --allocator oomguard --json --seq 9 --max 5 --oom-factor 1.5").unwrap();
        assert_eq!(a.phases, ["b"]);
        assert_eq!((a.batch, a.steps, a.max), (3, 7, Some(5)));
        assert_eq!(a.device, DeviceArg::Cuda(2));
        assert_eq!(a.allocator, "oomguard");
        assert!(a.json);
        assert_eq!(a.model.seq, Some(9));
        assert_eq!(a.model.layers, None);
        assert_eq!(a.oom_factor, 1.5);
        assert_eq!(
            run("--phase a --device cpu").unwrap().device,
            DeviceArg::Cpu
        );
    }

    #[test]
    fn own_options_and_positional_phases() {
        let raw = |cli: &str| -> Vec<String> { cli.split_whitespace().map(String::from).collect() };
        let Ok(Parsed::Run(a)) = parse(&raw("x out/p --big 56 --device 1 --big 7"), &POSITIONAL)
        else {
            panic!("did not parse");
        };
        assert_eq!(a.phases, ["x"]);
        assert_eq!(a.positional, ["out/p"]);
        assert_eq!(a.device, DeviceArg::Cuda(1));
        assert_eq!(a.option::<usize>("big"), Ok(Some(7)));
        assert_eq!(a.option::<usize>("factor"), Ok(None));
        assert!(a.option::<u8>("big").is_ok());
        let Ok(Parsed::Run(a)) = parse(&raw("--big x"), &POSITIONAL) else {
            panic!("did not parse");
        };
        assert_eq!(a.phases, ["a", "b"]);
        assert!(a
            .option::<usize>("big")
            .unwrap_err()
            .contains("--big \"x\""));
        assert_eq!(
            parse(&raw("y"), &POSITIONAL),
            Err("unknown phase \"y\"".to_string())
        );
        // Without `positional`, a bare argument is refused; without defaults, a phase is needed.
        assert!(parse(&raw("x"), &SPEC).is_err());
        assert!(parse(&raw("--big 3"), &SPEC).is_err());
    }

    #[test]
    fn help() {
        let raw = vec!["--phase".to_string(), "a".into(), "-h".into()];
        assert_eq!(parse(&raw, &SPEC), Ok(Parsed::Help));
    }

    #[test]
    fn bad_command_lines_say_what_is_wrong() {
        for (cli, said) in [
            ("", "no --phase given"),
            ("--phase c", "unknown phase \"c\""),
            ("--phase a --batch", "--batch needs a value"),
            ("--phase a --batch x", "--batch \"x\": not a number"),
            ("--phase a --batch 0", "at least 1"),
            ("--phase a --frobnicate 1", "unknown option --frobnicate"),
            ("--phase a stray", "unexpected argument \"stray\""),
            ("--phase a --device gpu", "cpu, cuda, cuda:N or N"),
            ("--phase a --oom-batch 0", "at least 1"),
            ("--phase a --allocator pool", "native or oomguard"),
            ("--phase a --equiv-batch 6", "a multiple of 4"),
            ("--phase a --oom-factor 1", "more than 1"),
            ("--phase a --grads-steps 1", "--grads-steps at least 2"),
        ] {
            let e = run(cli).unwrap_err();
            assert!(e.contains(said), "{cli:?}: {e:?} does not say {said:?}");
        }
    }
}
