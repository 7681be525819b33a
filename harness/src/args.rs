//! The examples' one command line (clap): `--phase NAME`... and the options every GPT example
//! takes ([`Args`]), beside the example's own (any `clap::Args`, flattened in). An example names
//! its phases, allocators and defaults in a [`Spec`]; what only its framework can check (the
//! model's shape, an allocator that needs CUDA) it checks after [`parse`], and reports like a
//! parse error ([`Spec::usage_error`]: one line, exit status 64).

use std::process::ExitCode;

use clap::builder::PossibleValuesParser;
use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches};

/// The exit status of a bad command line (BSD's `EX_USAGE`).
pub const EXIT_USAGE: u8 = 64;

/// What an example accepts.
#[derive(Clone, Copy, Debug)]
pub struct Spec {
    /// The program's name, the prefix of its error messages.
    pub program: &'static str,
    /// `--help`'s text above the options: what the example does, its phases.
    pub usage: &'static str,
    /// Phases in the order `--phase all` runs them.
    pub all_phases: &'static [&'static str],
    /// Phases run only when named.
    pub extra_phases: &'static [&'static str],
    /// The values `--allocator` takes; the first is the default.
    pub allocators: &'static [&'static str],
    /// `--max-cap`'s default, without and with `--tiny`.
    pub max_cap: (i64, i64),
    /// This example's defaults where they differ from [`Args`]'s: (field name, value); a name
    /// that is not a field of [`Args`] is a bug of the example (clap panics on it).
    pub defaults: &'static [(&'static str, &'static str)],
    /// Whether arguments not starting with `--` are taken: the first as a phase (as
    /// `--phase`), the others kept in [`Args::positional`]. Without a phase, [`Spec::default_phases`]
    /// run.
    pub positional: bool,
    /// The phases run when none is named (empty: a phase must be named).
    pub default_phases: &'static [&'static str],
}

impl Spec {
    /// Says `message` on stderr, on one line: the exit status of a bad command line.
    pub fn usage_error(&self, message: &str) -> ExitCode {
        eprintln!("{}: {message} (--help lists the options)", self.program);
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
                .ok_or_else(|| "cpu, cuda, cuda:N or N".to_string()),
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
#[derive(clap::Args, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ModelArgs {
    /// Transformer blocks.
    #[arg(long, value_name = "N")]
    pub layers: Option<i64>,
    /// Embedding width.
    #[arg(long, value_name = "N")]
    pub width: Option<i64>,
    /// Attention heads.
    #[arg(long, value_name = "N")]
    pub heads: Option<i64>,
    /// Vocabulary size.
    #[arg(long, value_name = "N")]
    pub vocab: Option<i64>,
    /// Sequence length.
    #[arg(long, value_name = "N")]
    pub seq: Option<i64>,
}

/// The options every example takes (an option given twice: the last one counts).
#[derive(clap::Args, Clone, Debug, PartialEq)]
pub struct Args {
    /// Phases to run, in order: repeatable, comma-separated, `all` (listed above).
    #[arg(long = "phase", value_name = "NAME", value_delimiter = ',')]
    pub phases: Vec<String>,
    /// cpu, cuda, cuda:N or N.
    #[arg(long, default_value = "cuda", value_parser = DeviceArg::parse)]
    pub device: DeviceArg,
    /// The small model (a CPU run in seconds).
    #[arg(long)]
    pub tiny: bool,
    /// The model's shape.
    #[command(flatten)]
    pub model: ModelArgs,
    /// Weights and tokens.
    #[arg(long, value_name = "N", default_value_t = 1234)]
    pub seed: u64,
    /// AdamW's learning rate.
    #[arg(long, value_name = "X", default_value_t = 3e-4)]
    pub lr: f64,
    /// SGD's learning rate, in `equiv`.
    #[arg(long, value_name = "X", default_value_t = 0.05)]
    pub sgd_lr: f64,
    /// Rows of `plain` and `overhead`.
    #[arg(long, value_name = "N", default_value_t = 8)]
    pub batch: i64,
    /// Timed steps of `plain`.
    #[arg(long, value_name = "N", default_value_t = 20)]
    pub steps: usize,
    /// Untimed steps before them.
    #[arg(long, value_name = "N", default_value_t = 3)]
    pub warmup: usize,
    /// Rows of `grads`.
    #[arg(long, value_name = "N", default_value_t = 4)]
    pub grads_batch: i64,
    /// Steps of `grads`.
    #[arg(long, value_name = "N", default_value_t = 10)]
    pub grads_steps: usize,
    /// The largest batch of a plain step, when known: skips `max`'s bisection.
    #[arg(long, value_name = "N")]
    pub max: Option<i64>,
    /// The largest batch `max` and the finder try.
    #[arg(long, value_name = "N", default_value_t = 4096)]
    pub max_cap: i64,
    /// `oom`'s batch over the largest.
    #[arg(long, value_name = "X", default_value_t = 2.0)]
    pub oom_factor: f64,
    /// `oom`'s batch, given (then the largest batch is not measured).
    #[arg(long, value_name = "N")]
    pub oom_batch: Option<i64>,
    /// Guarded steps of `oom` (the first meets the out-of-memory).
    #[arg(long, value_name = "N", default_value_t = 4)]
    pub oom_steps: usize,
    /// Rows of `equiv`: a multiple of 4.
    #[arg(long, value_name = "N", default_value_t = 8)]
    pub equiv_batch: i64,
    /// Steps of `equiv`.
    #[arg(long, value_name = "N", default_value_t = 3)]
    pub equiv_steps: usize,
    /// Plain steps at the batch the finder found.
    #[arg(long, value_name = "N", default_value_t = 100)]
    pub find_steps: usize,
    /// Rounds of 5 plain and 5 guarded steps in `overhead`.
    #[arg(long, value_name = "N", default_value_t = 12)]
    pub overhead_rounds: usize,
    /// Lines as JSON objects.
    #[arg(long)]
    pub json: bool,
    /// Who serves the tensors.
    #[arg(long, default_value = "")]
    pub allocator: String,
    /// A phase (as `--phase`), then what it takes; once parsed, the arguments after the phase
    /// ([`Spec::positional`]).
    #[arg(value_name = "PHASE")]
    pub positional: Vec<String>,
}

/// An example without options of its own.
#[derive(clap::Args, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NoOptions {}

/// The whole command line: the common options and the example's.
#[derive(clap::Parser)]
struct Cli<E: clap::Args> {
    #[command(flatten)]
    args: Args,
    #[command(flatten)]
    own: E,
}

/// What [`parse`] found.
#[derive(Clone, Debug, PartialEq)]
pub enum Parsed<E = NoOptions> {
    /// `-h` or `--help`: the text to print.
    Help(String),
    /// Options to run, and the example's own.
    Run(Box<Args>, E),
}

/// Parses `raw` (the arguments after the program's name) against `spec`, the example's own
/// options into `E`; `Err` says on one line what is wrong with the command line.
pub fn parse<E: clap::Args>(raw: &[String], spec: &Spec) -> Result<Parsed<E>, String> {
    let mut cmd = Cli::<E>::command()
        .name(spec.program)
        .bin_name(spec.program)
        .about(spec.usage.trim_end())
        .args_override_self(true)
        .allow_negative_numbers(true)
        .mut_arg("positional", |a| a.hide(!spec.positional))
        .mut_arg("max_cap", |a| a.default_value(spec.max_cap.0.to_string()));
    if let Some(first) = spec.allocators.first() {
        cmd = cmd.mut_arg("allocator", |a| {
            a.default_value(*first)
                .value_parser(PossibleValuesParser::new(spec.allocators))
        });
    }
    for (id, v) in spec.defaults {
        cmd = cmd.mut_arg(*id, |a| a.default_value(*v));
    }
    let argv = std::iter::once(spec.program.to_string()).chain(raw.iter().cloned());
    let matches = match cmd.try_get_matches_from(argv) {
        Ok(m) => m,
        Err(e) if e.kind() == clap::error::ErrorKind::DisplayHelp => {
            return Ok(Parsed::Help(e.render().to_string()))
        }
        Err(e) => return Err(one_line_error(&e.render().to_string())),
    };
    let cli = Cli::<E>::from_arg_matches(&matches).map_err(|e| one_line_error(&e.to_string()))?;
    let mut a = cli.args;
    if a.tiny && matches.value_source("max_cap") != Some(ValueSource::CommandLine) {
        a.max_cap = spec.max_cap.1;
    }
    // The first bare argument is a phase, run before those of `--phase`.
    if let Some(first) = (!a.positional.is_empty()).then(|| a.positional.remove(0)) {
        if !spec.positional {
            return Err(format!("unexpected argument {first:?}"));
        }
        a.phases.insert(0, first);
    }
    let known = |p: &str| spec.all_phases.contains(&p) || spec.extra_phases.contains(&p);
    for p in std::mem::take(&mut a.phases) {
        match p.as_str() {
            "all" => a
                .phases
                .extend(spec.all_phases.iter().map(|s| s.to_string())),
            "" => {}
            _ if known(&p) => a.phases.push(p),
            _ => return Err(format!("unknown phase {p:?}")),
        }
    }
    if a.phases.is_empty() {
        if spec.default_phases.is_empty() {
            return Err("no --phase given".into());
        }
        a.phases = spec.default_phases.iter().map(|s| s.to_string()).collect();
    }
    check(&a)?;
    Ok(Parsed::Run(Box::new(a), cli.own))
}

/// clap's error, its lines before the usage joined into one, without the `error: ` prefix.
fn one_line_error(rendered: &str) -> String {
    rendered
        .lines()
        .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"))
        .map(str::trim)
        // clap's advice to write `-- --name` for a value: this command line takes none.
        .filter(|l| !l.is_empty() && !l.starts_with("tip: to pass"))
        .collect::<Vec<_>>()
        .join("; ")
        .trim_start_matches("error: ")
        .to_string()
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
    if a.oom_steps < 2 {
        return Err(format!(
            "--oom-steps {}: at least 2 (the first meets the out-of-memory, the rest start \
             from its plan)",
            a.oom_steps
        ));
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
pub fn from_env<E: clap::Args>(spec: &Spec) -> Result<(Args, E), ExitCode> {
    let raw: Vec<String> = std::env::args().skip(1).collect();
    match parse(&raw, spec) {
        Ok(Parsed::Run(a, own)) => Ok((*a, own)),
        Ok(Parsed::Help(text)) => {
            crate::say!("{}", text.trim_end());
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
        usage: "phases: a",
        all_phases: &["a", "b"],
        extra_phases: &["x"],
        allocators: &["native", "oomguard"],
        max_cap: (4096, 1024),
        defaults: &[("sgd_lr", "0.1")],
        positional: false,
        default_phases: &[],
    };

    const POSITIONAL: Spec = Spec {
        positional: true,
        default_phases: &["a", "b"],
        ..SPEC
    };

    /// An example's own option.
    #[derive(clap::Args, Debug, PartialEq)]
    struct Own {
        #[arg(long)]
        big: Option<u64>,
    }

    fn raw(cli: &str) -> Vec<String> {
        cli.split_whitespace().map(String::from).collect()
    }

    fn run(cli: &str) -> Result<Args, String> {
        match parse::<Own>(&raw(cli), &SPEC)? {
            Parsed::Run(a, _) => Ok(*a),
            Parsed::Help(_) => Err("help".into()),
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
        // The example's defaults; given, the command line's values.
        assert_eq!(a.sgd_lr, 0.1);
        assert_eq!(run("--tiny --phase a --max-cap 7").unwrap().max_cap, 7);
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
        // Repeated: phases add up, other options the last one counts.
        let a = run("--phase a --phase x --batch 2 --batch 5").unwrap();
        assert_eq!((a.phases, a.batch), (vec!["a".to_string(), "x".into()], 5));
    }

    #[test]
    fn own_options_and_positional_phases() {
        let Ok(Parsed::Run(a, own)) =
            parse::<Own>(&raw("x out/p --big 56 --device 1 --big 7"), &POSITIONAL)
        else {
            panic!("did not parse");
        };
        assert_eq!(a.phases, ["x"]);
        assert_eq!(a.positional, ["out/p"]);
        assert_eq!(a.device, DeviceArg::Cuda(1));
        assert_eq!(own.big, Some(7));
        let Ok(Parsed::Run(a, own)) = parse::<Own>(&raw("--big 3"), &POSITIONAL) else {
            panic!("did not parse");
        };
        assert_eq!(a.phases, ["a", "b"]);
        assert_eq!(own.big, Some(3));
        let e = parse::<Own>(&raw("--big x"), &POSITIONAL).unwrap_err();
        assert!(e.contains("'x'") && e.contains("--big"), "{e}");
        assert_eq!(
            parse::<Own>(&raw("y"), &POSITIONAL),
            Err("unknown phase \"y\"".to_string())
        );
        // Without `positional`, a bare argument is refused; without defaults, a phase is needed;
        // an example's option is not another's.
        assert!(parse::<Own>(&raw("x"), &SPEC).is_err());
        assert!(parse::<Own>(&raw("--big 3"), &SPEC).is_err());
        assert!(parse::<NoOptions>(&raw("--phase a --big 3"), &SPEC).is_err());
    }

    #[test]
    fn help() {
        let Ok(Parsed::Help(text)) = parse::<Own>(&raw("--phase a -h"), &SPEC) else {
            panic!("no help");
        };
        for said in ["phases: a", "--big", "--oom-factor", "[default: 0.1]"] {
            assert!(text.contains(said), "{text}");
        }
    }

    #[test]
    fn the_scripts_command_lines_parse_to_their_settings() {
        // scripts/gpu-runs' tch_gpt and candle_gpt lines (candle's own options as `--big`).
        let tch = Spec {
            allocators: &["libtorch", "oomguard"],
            extra_phases: &["plain", "alloc"],
            ..SPEC
        };
        let candle = Spec {
            allocators: &["pool", "oomguard"],
            extra_phases: &["frag", "snap"],
            max_cap: (16384, 16384),
            ..POSITIONAL
        };
        for (spec, cli, settings) in [
            (
                &tch,
                "--phase plain --allocator oomguard --batch 44 --steps 8 --warmup 3",
                r#"["plain"] [] oomguard cuda:0 44 8 3 4096"#,
            ),
            (
                &tch,
                "--phase alloc --batch 44 --steps 5 --warmup 2 --max-cap 64",
                r#"["alloc"] [] libtorch cuda:0 44 5 2 64"#,
            ),
            (
                &candle,
                "frag --batch 24 --steps 6 --allocator pool --big 18446744073709551615",
                r#"["frag"] [] pool cuda:0 24 6 3 16384"#,
            ),
            (
                &candle,
                "snap /tmp/gpt28 --batch 28 --steps 6 --allocator oomguard",
                r#"["snap"] ["/tmp/gpt28"] oomguard cuda:0 28 6 3 16384"#,
            ),
        ] {
            let Ok(Parsed::Run(a, _)) = parse::<Own>(&raw(cli), spec) else {
                panic!("{cli:?} did not parse");
            };
            let got = format!(
                "{:?} {:?} {} {} {} {} {} {}",
                a.phases,
                a.positional,
                a.allocator,
                a.device,
                a.batch,
                a.steps,
                a.warmup,
                a.max_cap
            );
            assert_eq!(got, settings, "{cli:?}");
        }
    }

    #[test]
    fn bad_command_lines_say_what_is_wrong() {
        for (cli, said) in [
            ("", "no --phase given"),
            ("--phase c", "unknown phase \"c\""),
            ("--phase a --batch", "a value is required for '--batch <N>'"),
            ("--phase a --batch x", "invalid value 'x' for '--batch <N>'"),
            ("--phase a --batch 0", "at least 1"),
            ("--phase a --batch -3", "at least 1"),
            ("--phase a --frob 1", "unexpected argument '--frob'"),
            ("--phase a stray", "unexpected argument \"stray\""),
            ("--phase a --device gpu", "cpu, cuda, cuda:N or N"),
            ("--phase a --oom-batch 0", "at least 1"),
            ("--phase a --allocator pool", "values: native, oomguard"),
            ("--phase a --equiv-batch 6", "a multiple of 4"),
            ("--phase a --oom-factor 1", "more than 1"),
            ("--phase a --oom-steps 1", "--oom-steps 1: at least 2"),
            ("--phase a --grads-steps 1", "--grads-steps at least 2"),
        ] {
            let e = run(cli).unwrap_err();
            assert!(e.contains(said), "{cli:?}: {e:?} does not say {said:?}");
            assert!(!e.contains('\n') && !e.starts_with("error"), "{e:?}");
        }
    }
}
