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
//! The command line, the output lines and the phases `plain`, `max`, `equiv`, `finder`, `oom`
//! and `overhead` are oomguard-harness's (written once for the GPT examples); this example
//! gives them tch's model and steps (`bench.rs`) and keeps its own `grads` and `alloc`.
//!
//! On the CPU a simulated card (`charge.rs`: 256 MiB, 3 MiB a row: at most 85 rows) stands in
//! for the device's memory and is the memory source, so that `max`, `finder` and `oom` meet an
//! out-of-memory there too (`train_step` charges it per micro-batch); on CUDA nothing is
//! simulated. Float32 throughout; libtorch's default keeps TF32 off for matmuls.

mod bench;
mod charge;
mod grads;
mod model;
mod phase_alloc;
mod phase_grads;
mod plain_step;

use std::panic;
use std::process::ExitCode;
use std::sync::Arc;

use oomguard::{ByteSize, MemorySource};
use oomguard_harness::{one_line, say, DeviceArg, Line, NoOptions, Runner, Spec};
use tch::Device;

use oomguard_tch::LibtorchCudaSource;

use bench::TchBench;
use charge::Charge;
use model::Config;

/// The command line.
const SPEC: Spec = Spec {
    program: "tch_gpt",
    usage: USAGE,
    all_phases: &["grads", "plain", "equiv", "finder", "oom", "overhead"],
    // `alloc` starts two child processes of `alloc-one`.
    extra_phases: &["max", "alloc", "alloc-one"],
    allocators: &["libtorch", "oomguard"],
    max_cap: (4096, 1024),
    defaults: &[],
    positional: false,
    default_phases: &[],
};

const USAGE: &str = "\
tch_gpt: a GPT-2-small-shaped model in tch (libtorch), plain and under oomguard (issue 33, item 5)

phases (repeatable, comma-separated, or `all` = grads,plain,equiv,finder,oom,overhead):
  grads     one backward: every parameter has a finite non-zero gradient; the loss falls
            over --grads-steps AdamW steps on one batch
  plain     a plain tch loop (forward, backward, step, zero_grad) at --batch: ms/step median
  equiv     1 x B against 4 x B/4 micro-batches (--equiv-batch), SGD then AdamW
  finder    find_max_batch on plain steps; --find-steps plain steps at its batch; then
            the true max (as `max`) and found / true
  oom       train_step at --oom-factor x max, --oom-steps steps: the OOM survived, later steps
            from the plan; then the settled split and its neighbours timed as plain steps
  max       (also run by finder and oom when needed) the largest batch a plain step runs:
            doubling, then bisection, up to --max-cap
  overhead  train_step vs the plain loop at --batch, alternated: the time ratio
  alloc     (only when named) libtorch's native allocator vs expandable segments vs
            oomguard's allocator under libtorch: this program run three times as child
            processes (PYTORCH_ALLOC_CONF is read at CUDA init, the allocator is installed
            before it) with --phase alloc-one; each prints its RESULT phase=alloc line
  alloc-one (only when named) the allocator this process has: --steps plain steps at
            --batch (median ms, peak reserved / peak used), then the largest batch

model: GPT-2 small (12 layers, width 768, 12 heads, vocab 50257, seq 1024); --tiny: 2 layers,
width 32, 2 heads, vocab 64, seq 16 (a CPU run in seconds; --max-cap 1024 unless given);
--layers etc. override either. --allocator oomguard installs oomguard's caching allocator
under libtorch first (oomguard_tch::allocator::install); its Device is then the source.
";

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
    let args = match oomguard_harness::from_env::<NoOptions>(&SPEC) {
        Ok((a, NoOptions {})) => a,
        Err(code) => return code,
    };
    let oomguard_allocator = args.allocator == "oomguard";
    if oomguard_allocator && !args.device.is_cuda() {
        return SPEC
            .usage_error("--allocator oomguard serves CUDA tensors: it needs --device cuda");
    }
    let mut cfg = if args.tiny {
        Config::tiny()
    } else {
        Config::gpt2_small(1024)
    };
    let m = args.model;
    cfg.layers = m.layers.unwrap_or(cfg.layers);
    cfg.width = m.width.unwrap_or(cfg.width);
    cfg.heads = m.heads.unwrap_or(cfg.heads);
    cfg.vocab = m.vocab.unwrap_or(cfg.vocab);
    cfg.seq = m.seq.unwrap_or(cfg.seq);
    if let Err(e) = cfg.check() {
        return SPEC.usage_error(&e);
    }
    let dev = match args.device {
        DeviceArg::Cpu => Device::Cpu,
        DeviceArg::Cuda(i) => Device::Cuda(i),
    };
    install_panic_hook();
    let (charge, source) = match dev {
        // Before anything of libtorch's CUDA starts: the allocator can only be changed then.
        Device::Cuda(i) if oomguard_allocator => match oomguard_tch::allocator::install(i) {
            Ok(dev) => {
                let source: Arc<dyn MemorySource> = Arc::new(dev);
                (Charge::none(), source)
            }
            Err(e) => {
                say!("tch_gpt: oomguard's allocator under libtorch on cuda:{i}: {e}");
                return ExitCode::from(2);
            }
        },
        Device::Cuda(i) => {
            let n = tch::Cuda::device_count();
            if !tch::Cuda::is_available() || i as i64 >= n {
                say!(
                    "tch_gpt: no usable CUDA device cuda:{i} (libtorch sees {n}); use --device cpu"
                );
                return ExitCode::from(2);
            }
            match LibtorchCudaSource::new(i) {
                Ok(s) => (Charge::none(), s.register()),
                Err(e) => {
                    say!("tch_gpt: libtorch's CUDA allocator on cuda:{i}: {e}");
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
    Line::config()
        .text("device", args.device.to_string())
        .flag("tiny", args.tiny)
        .flag("simulated_card", charge.card().is_some())
        .text("allocator", args.allocator.clone())
        .int("layers", cfg.layers)
        .int("width", cfg.width)
        .int("heads", cfg.heads)
        .int("vocab", cfg.vocab)
        .int("seq", cfg.seq)
        .int("parameters", cfg.parameters())
        .text("head", "tied")
        .int("seed", args.seed as i64)
        .float("lr", args.lr, 0)
        .text("phases", args.phases.join(","))
        .emit(args.json);
    let bench = TchBench {
        dev,
        cfg,
        charge,
        source,
        seed: args.seed,
        lr: args.lr,
        sgd_lr: args.sgd_lr,
    };
    Runner::new(bench, args).run(|r, name| match name {
        "grads" => Some(phase_grads::grads(r)),
        "alloc" => Some(phase_alloc::alloc(r)),
        "alloc-one" => Some(phase_alloc::alloc_one(r)),
        _ => None,
    })
}
