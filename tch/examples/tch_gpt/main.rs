//! A GPT-2-small-shaped model in tch (libtorch 2.11), trained on seeded synthetic tokens with
//! AdamW: plain, and under oomguard (issue 33, item 5). `--help` lists the phases and options.
//!
//! ```sh
//! eval "$(scripts/libtorch.sh)"   # from the repository root: LIBTORCH, LD_LIBRARY_PATH
//! cd tch && cargo run --release --example tch_gpt -- --tiny --device cpu --phase all  # seconds
//! cd tch && cargo build --release --example tch_gpt   # then, on the GPU machine:
//! tch_gpt --phase all                                 # GPT-2 small, cuda:0
//! tch_gpt --phase alloc                               # two child processes
//! ```
//!
//! Every measured figure is one `RESULT phase=NAME key=value ...` line (`--json`: one JSON
//! object per line); `STEP` and `TRIAL` lines show the work inside a phase, and each phase ends
//! with `PHASE phase=NAME status=ok|FAIL|error|panicked secs=..`. The exit status is 0 when
//! every phase ran and its checks held, 1 otherwise, 2 when the device cannot be used, 64 on a
//! bad command line.
//!
//! On the CPU a simulated card (`charge.rs`: 256 MiB, 3 MiB a row: at most 85 rows) stands in
//! for the device's memory and is the memory source, so that `max`, `finder` and `oom` meet an
//! out-of-memory there too (`train_step` charges it per micro-batch); on CUDA nothing is
//! simulated. Float32 throughout; libtorch's default keeps TF32 off for matmuls.

mod args;
mod charge;
mod grads;
mod guarded_step;
mod model;
mod phase_alloc;
mod phase_equiv;
mod phase_finder;
mod phase_grads;
mod phase_max;
mod phase_oom;
mod phase_overhead;
mod phase_plain;
mod plain_step;
mod report;

use std::panic::{self, AssertUnwindSafe};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use oomguard::{ByteSize, MemorySource};
use tch::nn::{self, OptimizerConfig};
use tch::{Device, TchError, Tensor};

use oomguard_tch::LibtorchCudaSource;

use args::Args;
use charge::Charge;
use model::{synthetic_tokens, Config, Gpt};
use report::{one_line, Line};

/// How a phase that ran ended.
pub(crate) enum Outcome {
    /// Its checks held.
    Pass,
    /// A check failed (said in the lines above).
    Fail,
}

/// A phase's result: an error is a phase that could not run to its end.
pub(crate) type PhaseResult = Result<Outcome, String>;

/// What every phase works with.
pub(crate) struct Ctx {
    pub(crate) args: Args,
    pub(crate) dev: Device,
    pub(crate) cfg: Config,
    pub(crate) charge: Charge,
    /// Where the steps' memory comes from, as oomguard sees it: libtorch's CUDA caching
    /// allocator (`LibtorchCudaSource`, registered), or the simulated card on the CPU.
    pub(crate) source: Arc<dyn MemorySource>,
    /// The largest batch of a plain step: `--max`, or measured by `max` in this run.
    pub(crate) max: Option<i64>,
}

impl Ctx {
    /// A fresh model with the run's seeded initialisation (the same weights at every call).
    pub fn model(&self) -> Result<(nn::VarStore, Gpt), TchError> {
        tch::manual_seed(self.args.seed as i64);
        let vs = nn::VarStore::new(self.dev);
        let model = Gpt::new(&vs, self.cfg)?;
        Ok((vs, model))
    }

    /// AdamW (tch's defaults: betas 0.9/0.999, weight decay 0.01) at `--lr`.
    pub fn adamw(&self, vs: &nn::VarStore) -> Result<nn::Optimizer, TchError> {
        nn::AdamW::default().build(vs, self.args.lr)
    }

    /// Seeded tokens `(rows, seq + 1)`; `salt` picks another batch.
    pub fn tokens(&self, rows: i64, salt: u64) -> Result<Tensor, TchError> {
        let seed = self.args.seed ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        synthetic_tokens(seed, rows, &self.cfg, self.dev)
    }

    /// Prints a line in the run's format.
    pub fn emit(&self, line: Line) {
        line.emit(self.args.json);
    }

    fn phase(&mut self, name: &str) -> PhaseResult {
        match name {
            "grads" => self.grads(),
            "plain" => self.plain(),
            "max" => self.max_phase(),
            "equiv" => self.equiv(),
            "finder" => self.finder(),
            "alloc" => self.alloc(),
            "alloc-one" => self.alloc_one(),
            "oom" => self.oom(),
            "overhead" => self.overhead(),
            other => Err(format!("unknown phase {other}")),
        }
    }
}

/// A libtorch out-of-memory panic is expected here (and caught): printed as one line; every
/// other panic as before.
fn install_panic_hook() {
    let previous = panic::take_hook();
    panic::set_hook(Box::new(move |info| {
        let text = info
            .payload()
            .downcast_ref::<&str>()
            .copied()
            .or_else(|| info.payload().downcast_ref::<String>().map(String::as_str))
            .unwrap_or("");
        if oomguard_tch::panic_message_is_oom(text) {
            eprintln!("[out-of-memory panic, caught] {}", one_line(text));
        } else {
            previous(info);
        }
    }));
}

fn main() -> ExitCode {
    let raw: Vec<String> = std::env::args().skip(1).collect();
    let args = match args::parse(&raw) {
        Ok(a) => a,
        Err(e) if e.is_empty() => {
            print!("{}", args::USAGE);
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("tch_gpt: {e}\n\n{}", args::USAGE);
            return ExitCode::from(64);
        }
    };
    install_panic_hook();
    let (charge, source) = match args.device {
        // Before anything of libtorch's CUDA starts: the allocator can only be changed then.
        Device::Cuda(i) if args.oomguard_allocator => match oomguard_tch::allocator::install(i) {
            Ok(dev) => {
                let source: Arc<dyn MemorySource> = Arc::new(dev);
                (Charge::none(), source)
            }
            Err(e) => {
                println!("tch_gpt: oomguard's allocator under libtorch on cuda:{i}: {e}");
                return ExitCode::from(2);
            }
        },
        Device::Cuda(i) => {
            let n = tch::Cuda::device_count();
            if !tch::Cuda::is_available() || i as i64 >= n {
                println!(
                    "tch_gpt: no usable CUDA device cuda:{i} (libtorch sees {n}); use --device cpu"
                );
                return ExitCode::from(2);
            }
            match LibtorchCudaSource::new(i) {
                Ok(s) => (Charge::none(), s.register()),
                Err(e) => {
                    println!("tch_gpt: libtorch's CUDA allocator on cuda:{i}: {e}");
                    return ExitCode::from(2);
                }
            }
        }
        _ => {
            let card = oomguard::Device::sim(ByteSize::mib(256));
            let source: Arc<dyn MemorySource> = Arc::new(card.clone());
            (Charge::on(card, 3 << 20), source)
        }
    };
    let c = args.cfg;
    Line::config()
        .text(
            "device",
            match args.device {
                Device::Cuda(i) => format!("cuda:{i}"),
                _ => "cpu".into(),
            },
        )
        .flag("tiny", args.tiny)
        .flag("simulated_card", charge.card().is_some())
        .text(
            "allocator",
            if args.oomguard_allocator {
                "oomguard"
            } else {
                "libtorch"
            },
        )
        .int("layers", c.layers)
        .int("width", c.width)
        .int("heads", c.heads)
        .int("vocab", c.vocab)
        .int("seq", c.seq)
        .int("parameters", c.parameters())
        .text("head", "tied")
        .int("seed", args.seed as i64)
        .float("lr", args.lr, 0)
        .text("phases", args.phases.join(","))
        .emit(args.json);
    let mut ctx = Ctx {
        source,
        dev: args.device,
        cfg: args.cfg,
        max: args.max,
        charge,
        args,
    };
    let started = Instant::now();
    let mut failed = false;
    for name in ctx.args.phases.clone() {
        let t = Instant::now();
        let out = panic::catch_unwind(AssertUnwindSafe(|| ctx.phase(&name)));
        let (status, error) = match out {
            Ok(Ok(Outcome::Pass)) => ("ok", None),
            Ok(Ok(Outcome::Fail)) => ("FAIL", None),
            Ok(Err(e)) => ("error", Some(e)),
            Err(p) => (
                "panicked",
                Some(
                    p.downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| p.downcast_ref::<String>().cloned())
                        .unwrap_or_default(),
                ),
            ),
        };
        failed |= status != "ok";
        // The next phase starts from an emptied cache (what this one held is dropped).
        if let Err(e) = ctx.source.empty_cache() {
            ctx.emit(Line::phase(&name).text("empty_cache_error", one_line(&e.to_string())));
            failed = true;
        }
        let mut line = Line::phase(&name).text("status", status);
        if let Some(e) = error {
            line = line.text("error", one_line(&e));
        }
        ctx.emit(line.float("secs", t.elapsed().as_secs_f64(), 1).float(
            "total_secs",
            started.elapsed().as_secs_f64(),
            1,
        ));
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
