//! A GPT-2-small-shaped decoder (12 layers, width 768, 12 heads, vocabulary 50257, sequence 512,
//! AdamW) trained with candle on seeded synthetic tokens, under oomguard, on a CUDA device.
//!
//! ```text
//! candle_gpt [all|find|oom|equiv|overhead|frag|seeded|snap PREFIX|max|plain] [--big ROWS]
//!            [--steps N] [--device ORDINAL] [--release-threshold BYTES]
//!            [--allocator pool|oomguard] [--batch ROWS] [--factor N] [--json] ...
//! ```
//! The command line and the phases `find` (oomguard-harness's `finder`), `oom`, `equiv`,
//! `overhead`, `max` and `plain` are oomguard-harness's, written once for the GPT examples (their
//! lines are `RESULT phase=NAME key=value ...`, `--help` lists the options); this example gives
//! them candle's model and steps (`CandleBench`) and keeps its own `frag`, `seeded` and `snap`:
//! - `--allocator`: where candle's tensors live: the driver's pool (candle's own, the default)
//!   or oomguard's caching allocator (`oomguard_candle::alloc_hook::install`, feature
//!   `allocator-hook`), installed before the model is made;
//! - `snap PREFIX` (with `--allocator oomguard`): one training step at `--batch` rows with
//!   oomguard's history on (with `--steps N` > 1: the first N steps, without source locations),
//!   written as `PREFIX.pickle` (PyTorch's snapshot format, for
//!   `torch.cuda._memory_viz` and `oomguard view`) and `PREFIX.json`;
//! - `frag`: `--steps` (default 20) plain steps at `--batch` rows: peak reserved / peak used of
//!   the allocator, OOMs, median step time, and the device memory the allocator does not see
//!   (`cuMemGetInfo` used minus the allocator's reserved);
//! - `find`: oomguard's `find_max_batch` on plain steps, `--steps` (default 100) plain steps at
//!   the found batch, then the true maximum by bisection (`max`) and found / true;
//! - `oom`: a batch larger than the card holds (`--big`, default twice the true maximum, which
//!   `max` measures unless known) survives a real driver OOM by accumulation; 3 more steps start
//!   from the remembered plan;
//! - `seeded`: `oomguard_candle::find_max_batch_train` (the training step's own attempt), then
//!   `--steps` (default 20) `train_step`s at `--factor` (default 2) × the batch found from an
//!   engine seeded with `start_from_finder`: each step's retries and plan, and their sum;
//! - `equiv`: parameters after 3 steps of batch 8, whole vs 4 micro-batches of 2, with SGD and
//!   with AdamW (‖a−b‖/‖a‖ over every parameter, f32, TF32 off);
//! - `overhead`: the same steps as a plain candle loop and through `train_step`, interleaved,
//!   on a pool that keeps its cache;
//! - the driver pool's `memory_summary` at the end.
//!
//! Exit status: 0 when every phase ran and its checks held, 1 otherwise, 2 when the device
//! cannot be used, 64 on a bad command line.

#[path = "../common/measure.rs"]
mod measure;
mod model;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW, VarBuilder, VarMap, SGD};
use oomguard::retry::{FinderOptions, RetryEngine};
use oomguard::source::MemorySource;
use oomguard::train::TrainedStep;
use oomguard_candle::train_step;
use oomguard_harness::{say, Bench, DeviceArg, Optim, PhaseResult, Runner, Spec};

use measure::{device_used, is_oom, Allocator, Res};
use model::{synthetic_tokens, Config, Gpt};

const USAGE: &str = "\
candle_gpt: a GPT-2-small-shaped model in candle on a CUDA device, plain and under oomguard

candle_gpt [PHASE [PREFIX]] [options]: the first argument a phase (or --phase NAME, repeatable)

phases (default all = find,oom,equiv,overhead):
  find      find_max_batch on plain steps, --steps (default 100) plain steps at its batch,
            then the true max (as `max`) and found / true
  oom       train_step at --big rows (default 2 x max): the OOM survived, later steps from
            the plan
  equiv     1 x 8 against 4 x 2 micro-batches, SGD then AdamW (TF32 off)
  overhead  train_step vs the plain loop at --batch (default 8), alternated
  max       the largest batch a plain step runs: doubling, then bisection, up to --max-cap
  plain     --steps plain steps at --batch: ms/step median, peaks
  frag      --steps (default 20) plain steps at --batch: peak reserved / peak used, OOMs,
            median step time, device memory outside the allocator
  seeded    find_max_batch_train, then --steps (default 20) train_steps at --factor
            (default 2) x its batch from an engine seeded with the finder's result
  snap PREFIX  (--allocator oomguard) one step at --batch with the history on (--steps N:
            the first N steps): PREFIX.pickle and PREFIX.json
";

/// The options only this example has.
#[derive(clap::Args)]
struct Own {
    /// `oom`'s batch (as --oom-batch) [default: 2 x max].
    #[arg(long, value_name = "ROWS")]
    big: Option<i64>,
    /// `seeded`'s batch over the one found.
    #[arg(long, value_name = "N", default_value_t = 2)]
    factor: usize,
    /// The driver pool's release threshold, set before the phases.
    #[arg(long, value_name = "B")]
    release_threshold: Option<u64>,
}

/// The command line.
const SPEC: Spec = Spec {
    program: "candle_gpt",
    usage: USAGE,
    all_phases: &["find", "oom", "equiv", "overhead"],
    extra_phases: &["frag", "seeded", "snap", "max", "plain"],
    allocators: &["pool", "oomguard"],
    max_cap: (1 << 14, 1 << 14),
    defaults: &[],
    positional: true,
    default_phases: &["find", "oom", "equiv", "overhead"],
};

struct Run {
    dev: Device,
    cfg: Config,
    model: Gpt,
    vars: Vec<Var>,
    init: Vec<Tensor>,
}

impl Run {
    /// The run and the memory source its tensors come from.
    fn new(ordinal: usize, allocator: Allocator) -> Res<(Self, Arc<dyn MemorySource>)> {
        let dev = Device::new_cuda(ordinal)?;
        let source = allocator.source(&dev)?;
        dev.set_seed(42)?;
        let cfg = Config::gpt2_small(512);
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
        let model = Gpt::new(cfg, vb, &dev)?;
        let vars = varmap.all_vars();
        let init = vars
            .iter()
            .map(|v| v.as_tensor().copy())
            .collect::<Result<_, _>>()?;
        let n: usize = vars.iter().map(|v| v.elem_count()).sum();
        say!("model: {} parameters, {} tensors", n, vars.len());
        let run = Self {
            dev,
            cfg,
            model,
            vars,
            init,
        };
        Ok((run, source))
    }

    fn reset(&self) -> candle_core::Result<()> {
        for (v, t) in self.vars.iter().zip(&self.init) {
            v.set(t)?;
        }
        Ok(())
    }

    fn adamw(&self) -> candle_core::Result<AdamW> {
        self.adamw_at(3e-4)
    }

    fn adamw_at(&self, lr: f64) -> candle_core::Result<AdamW> {
        AdamW::new(
            self.vars.clone(),
            ParamsAdamW {
                lr,
                ..Default::default()
            },
        )
    }

    fn tokens(&self, seed: u64, rows: usize) -> candle_core::Result<Tensor> {
        synthetic_tokens(seed, rows, &self.cfg, &self.dev)
    }

    /// One plain candle training step (forward, backward, optimizer), synchronised.
    fn plain_step(&self, opt: &mut impl Optimizer, tokens: &Tensor) -> candle_core::Result<f32> {
        let loss = self.model.loss(tokens)?;
        let grads = loss.backward()?;
        opt.step(&grads)?;
        let l = loss.to_scalar::<f32>()?;
        self.dev.synchronize()?;
        Ok(l)
    }
}

/// A session's optimizer.
enum Opt {
    AdamW(AdamW),
    Sgd(SGD),
}

/// candle's side of the harness's phases: the one model (a session resets it to its initial
/// weights), seeded token batches, the plain candle step and `oomguard_candle::train_step`.
struct CandleBench {
    run: Run,
    source: Arc<dyn MemorySource>,
    ordinal: usize,
    lr: f64,
    sgd_lr: f64,
}

impl Bench for CandleBench {
    type Error = candle_core::Error;
    type Session = Opt;
    type Batch = Tensor;
    type Params = Vec<Tensor>;

    fn source(&self) -> &Arc<dyn MemorySource> {
        &self.source
    }

    fn row_len(&self) -> i64 {
        self.run.cfg.seq
    }

    /// The model back at its initial weights (one model: a session lasts until the next).
    fn session(&self, optim: Optim) -> candle_core::Result<Opt> {
        self.run.reset()?;
        Ok(match optim {
            Optim::AdamW => Opt::AdamW(self.run.adamw_at(self.lr)?),
            Optim::Sgd => Opt::Sgd(SGD::new(self.run.vars.clone(), self.sgd_lr)?),
        })
    }

    fn batch(&self, rows: i64, salt: u64) -> candle_core::Result<Tensor> {
        self.run.tokens(salt, rows.max(0) as usize)
    }

    fn plain_step(&self, s: &mut Opt, b: &Tensor) -> candle_core::Result<f64> {
        match s {
            Opt::AdamW(o) => self.run.plain_step(o, b),
            Opt::Sgd(o) => self.run.plain_step(o, b),
        }
        .map(f64::from)
    }

    fn guarded_step(
        &self,
        engine: &RetryEngine,
        s: &mut Opt,
        b: &Tensor,
    ) -> Result<TrainedStep, String> {
        let run = &self.run;
        let loss = |_: &_, rows: &[Tensor]| run.model.loss(&rows[0]);
        // Each engine meets one optimizer, so one call site per engine.
        let done = match s {
            Opt::AdamW(o) => train_step(engine, &self.source, &[b], &run.vars[..], o, loss),
            Opt::Sgd(o) => train_step(engine, &self.source, &[b], &run.vars[..], o, loss),
        }
        .map_err(|e| e.to_string())?;
        run.dev.synchronize().map_err(|e| e.to_string())?;
        Ok(done)
    }

    fn params(&self, _: &Opt) -> Result<Vec<Tensor>, String> {
        self.run
            .vars
            .iter()
            .map(|v| v.as_tensor().copy())
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())
    }

    /// `‖a − b‖ / ‖a‖` and the largest `|a − b|` over every parameter (f64 sums).
    fn compare(&self, a: &Vec<Tensor>, b: &Vec<Tensor>) -> Result<(f64, f64), String> {
        if a.len() != b.len() {
            return Err("the two models have different parameters".into());
        }
        let f = |t: Tensor| -> candle_core::Result<f64> { t.to_dtype(DType::F64)?.to_scalar() };
        let sums = || -> candle_core::Result<(f64, f64, f64)> {
            let (mut d2, mut n2, mut max) = (0f64, 0f64, 0f64);
            for (x, y) in a.iter().zip(b) {
                let d = (x - y)?;
                d2 += f(d.sqr()?.sum_all()?)?;
                n2 += f(x.sqr()?.sum_all()?)?;
                max = max.max(f(d.abs()?.flatten_all()?.max(0)?)?);
            }
            Ok((d2, n2, max))
        };
        let (d2, n2, max) = sums().map_err(|e| e.to_string())?;
        Ok(((d2 / n2.max(f64::MIN_POSITIVE)).sqrt(), max))
    }

    /// Parameter tensors whose sum is a NaN or an infinity.
    fn non_finite_params(&self, _: &Opt) -> Result<i64, String> {
        let mut n = 0;
        for v in &self.run.vars {
            let s: f64 = v
                .as_tensor()
                .sum_all()
                .and_then(|t| t.to_dtype(DType::F64))
                .and_then(|t| t.to_scalar())
                .map_err(|e| e.to_string())?;
            n += i64::from(!s.is_finite());
        }
        Ok(n)
    }
}

/// `overhead` on a pool that keeps its cache (as a tuned loop would), so that neither loop pays
/// the driver for memory on every step; the threshold restored afterwards.
fn overhead(r: &mut Runner<CandleBench>) -> PhaseResult {
    let pool = oomguard::source::DriverPool::current(r.bench.ordinal).map_err(|e| e.to_string())?;
    let threshold = pool.release_threshold().map_err(|e| e.to_string())?;
    pool.set_release_threshold(u64::MAX)
        .map_err(|e| e.to_string())?;
    let out = r.overhead();
    pool.set_release_threshold(threshold)
        .map_err(|e| e.to_string())?;
    out
}

/// An example phase that reports through `Res`: ok, or its error.
fn own(r: Res<()>) -> PhaseResult {
    r.map(|()| oomguard_harness::Outcome::Pass)
        .map_err(|e| e.to_string())
}

fn phase_seeded(run: &Run, source: &Arc<dyn MemorySource>, factor: usize, steps: usize) -> Res<()> {
    candle_core::cuda::set_gemm_reduced_precision_f32(true);
    run.reset()?;
    source.empty_cache()?;
    let t0 = Instant::now();
    let opts = FinderOptions {
        max: 512,
        ..Default::default()
    };
    let found = oomguard_candle::find_max_batch_train(
        &**source,
        opts,
        &run.vars,
        |rows| Ok(vec![run.tokens(3000 + rows as u64, rows)?]),
        |_, rows| run.model.loss(&rows[0]),
    )?;
    let finder_secs = t0.elapsed().as_secs_f64();
    let rows = factor * found.max_batch;
    let seed = found.micro_batch_for(rows);
    let mut opt = run.adamw()?;
    let engine = RetryEngine::new().start_from_finder(&found);
    let mut retries = 0;
    for step in 0..steps {
        let tokens = run.tokens(4000 + step as u64, rows)?;
        let t = Instant::now();
        let done = train_step(&engine, source, &[&tokens], &run.vars, &mut opt, |_, r| {
            run.model.loss(&r[0])
        })?;
        run.dev.synchronize()?;
        retries += done.report.retries();
        say!(
            "SEEDED step {step} batch {rows}: {} retries, plan {} x {}, loss {:.4}, {:.1} ms",
            done.report.retries(),
            done.report.final_plan.chunks().len(),
            done.report.final_plan.micro_batch(),
            done.loss,
            t.elapsed().as_secs_f64() * 1e3
        );
    }
    say!(
        "RESULT seeded: found {} rows ({} trials, {finder_secs:.1} s), batch bytes {:?} a row, accumulation {:?} B; {steps} steps at {rows} rows from micro-batches of at most {seed}: {retries} retries",
        found.max_batch,
        found.trials.len(),
        found.batch_bytes_per_row,
        found.accumulation_bytes,
    );
    Ok(())
}

/// One training step with oomguard's history on, written as a PyTorch snapshot.
#[cfg(feature = "allocator-hook")]
fn phase_snapshot(run: &Run, prefix: &str, batch: usize, steps: usize) -> Res<()> {
    let og = oomguard_candle::alloc_hook::installed_device(&run.dev)
        .ok_or("snap needs --allocator oomguard")?;
    let mut opt = run.adamw()?;
    if steps > 1 {
        // A training loop's trace from its first step (for replaying it through the allocator
        // under other policies): no locations, to keep the file small.
        og.allocator().record_history(1_000_000, false);
        for s in 0..steps {
            run.plain_step(&mut opt, &run.tokens(1 + s as u64, batch)?)?;
        }
    } else {
        run.plain_step(&mut opt, &run.tokens(0, 1)?)?; // optimizer state, as in a running loop
        og.allocator().record_history(200_000, true);
        run.plain_step(&mut opt, &run.tokens(1, batch)?)?;
    }
    let snap = og.memory_snapshot();
    og.allocator().record_history(0, false);
    std::fs::write(format!("{prefix}.pickle"), snap.to_pytorch_pickle())?;
    std::fs::write(format!("{prefix}.json"), snap.to_json()?)?;
    say!(
        "RESULT snap: {steps} step(s) of batch {batch} on oomguard's allocator: {} segments, {} events -> {prefix}.pickle",
        snap.segments.len(),
        snap.device_traces.len()
    );
    Ok(())
}

#[cfg(not(feature = "allocator-hook"))]
fn phase_snapshot(_: &Run, _: &str, _: usize, _: usize) -> Res<()> {
    Err("snap needs the `allocator-hook` feature".into())
}

/// With oomguard's allocator installed: what growable segments did so far (pages mapped and
/// unmapped, device synchronisations), one line per step.
#[cfg(feature = "allocator-hook")]
fn remap_line(run: &Run, step: usize) {
    if let Some(og) = oomguard_candle::alloc_hook::installed_device(&run.dev) {
        let s = og.allocator().stats();
        say!(
            "RESULT remap: after step {step}: {:.2} GiB mapped in {} calls, {:.2} GiB unmapped in {} calls, {} device synchronisations, {} stream synchronisations",
            s.mapped_bytes_total as f64 / (1u64 << 30) as f64,
            s.num_map,
            s.unmapped_bytes_total as f64 / (1u64 << 30) as f64,
            s.num_unmap,
            s.num_sync_all_streams,
            s.num_stream_syncs
        );
    }
}

#[cfg(not(feature = "allocator-hook"))]
fn remap_line(_: &Run, _: usize) {}

fn phase_frag(run: &Run, source: &Arc<dyn MemorySource>, batch: usize, steps: usize) -> Res<()> {
    candle_core::cuda::set_gemm_reduced_precision_f32(true);
    run.reset()?;
    let mut opt = run.adamw()?;
    source.empty_cache()?;
    source.reset_peak()?;
    let (mut ooms, mut times, mut unseen_max) = (0, Vec::new(), 0i64);
    for s in 0..steps {
        let t = run.tokens(5000 + s as u64, batch)?;
        let t0 = Instant::now();
        match run.plain_step(&mut opt, &t) {
            Ok(_) => times.push(t0.elapsed().as_secs_f64()),
            Err(e) if is_oom(&e) => ooms += 1,
            Err(e) => return Err(e.into()),
        }
        let unseen = device_used()? as i64 - source.usage()?.reserved as i64;
        unseen_max = unseen_max.max(unseen);
        remap_line(run, s);
    }
    let u = source.usage()?;
    times.sort_by(f64::total_cmp);
    let median = times.get(times.len() / 2).copied().unwrap_or(f64::NAN);
    say!(
        "RESULT frag: {}, batch {batch}, {steps} steps: peak reserved {} / peak used {} = {:.4}; \
         {ooms} OOM; median {:.1} ms/step",
        source.info().kind,
        u.reserved_peak,
        u.used_peak,
        u.reserved_peak as f64 / u.used_peak.max(1) as f64,
        median * 1e3
    );
    let used = device_used()?;
    say!(
        "RESULT unseen: device used {used} B, {} reserved {} B: {} B outside it at the end \
         (most after a step: {unseen_max} B); the allocator saw {:.4} of device memory",
        source.info().kind,
        u.reserved,
        used as i64 - u.reserved as i64,
        u.reserved as f64 / used as f64
    );
    Ok(())
}

fn main() -> ExitCode {
    let (mut args, opts) = match oomguard_harness::from_env::<Own>(&SPEC) {
        Ok(a) => a,
        Err(code) => return code,
    };
    let ordinal = match args.device {
        DeviceArg::Cuda(i) => i,
        DeviceArg::Cpu => return SPEC.usage_error("--device cpu: candle_gpt runs on CUDA only"),
    };
    let allocator = if args.allocator == "oomguard" {
        Allocator::Oomguard
    } else {
        Allocator::Pool
    };
    // `--steps` names each phase's own count; unnamed, each has its own default.
    let steps_given = std::env::args().any(|a| a == "--steps" || a.starts_with("--steps="));
    if steps_given {
        args.find_steps = args.steps;
    }
    let factor = opts.factor.max(1);
    if opts.big.is_some() {
        args.oom_batch = opts.big;
    }
    let (run, source) = match Run::new(ordinal, allocator) {
        Ok(r) => r,
        Err(e) => {
            say!("candle_gpt: cuda:{ordinal}: {e}");
            return ExitCode::from(2);
        }
    };
    // The pool as candle leaves it: the driver's default release threshold (0) hands unused
    // memory back at every synchronisation, so every step starts from an empty pool. With a
    // high threshold the pool keeps the previous step's blocks, and a step near the card's
    // limit can fail on the cached blocks' fragmentation (seen at 70 rows: 99 of 100 steps).
    if let Some(t) = opts.release_threshold {
        let set =
            oomguard::source::DriverPool::current(ordinal).and_then(|p| p.set_release_threshold(t));
        if let Err(e) = set {
            say!("candle_gpt: --release-threshold {t}: {e}");
            return ExitCode::from(2);
        }
    }
    say!("memory source: {}", source.info());
    let bench = CandleBench {
        run,
        source,
        ordinal,
        lr: args.lr,
        sgd_lr: args.sgd_lr,
    };
    let mut runner = Runner::new(bench, args);
    let code = runner.run(|r, name| {
        // TF32 matmuls everywhere but in `equiv`, which compares sums to 1e-5.
        candle_core::cuda::set_gemm_reduced_precision_f32(name != "equiv");
        let (batch, steps) = (r.args.batch as usize, r.args.steps);
        Some(match name {
            "find" => r.finder(),
            "overhead" => overhead(r),
            "frag" => own(phase_frag(&r.bench.run, &r.bench.source, batch, steps)),
            "seeded" => own(phase_seeded(&r.bench.run, &r.bench.source, factor, steps)),
            "snap" => match r.args.positional.first().cloned() {
                Some(prefix) => own(phase_snapshot(
                    &r.bench.run,
                    &prefix,
                    batch,
                    if steps_given { steps } else { 1 },
                )),
                None => Err("snap needs an output PREFIX".into()),
            },
            _ => return None,
        })
    });
    say!("{}", runner.bench.source.memory_summary());
    code
}
