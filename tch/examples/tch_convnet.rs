//! A measuring harness (not an example to copy): tch's own VGG-16 (`tch::vision::vgg::vgg16`, no
//! BatchNorm), f32, 224 × 224 images, SGD with momentum 0.9 and learning rate 1e-3, plain steps (forward, backward, step,
//! zero_grad), under the allocator this process has: libtorch's (native, or expandable segments
//! through `PYTORCH_ALLOC_CONF`) or oomguard's (`--allocator oomguard`, installed under libtorch
//! before CUDA starts). libtorch's autograd engine runs the backward on its own thread, so under
//! oomguard's allocator the frees of the forward's tensors come from another thread.
//!
//! ```text
//! tch_convnet [--allocator libtorch|oomguard] [--batch N] [--steps N] [--warmup N]
//!             [--max LO..HI] [--oom F] [--seeded F] [--classes N] [--size PX] [--check]
//!             [--no-mark-steps]
//! ```
//! - `--batch`: `--warmup` untimed steps, then `--steps` timed ones: one `STEP` line each (ms,
//!   and what the allocator did in it: maps, unmaps, bytes unmapped, synchronisations,
//!   retries inside the allocator), then a `RESULT phase=steps` line (median and min ms, peak
//!   used and reserved, the moves of the timed steps).
//! - `--max LO..HI`: the largest batch of two consecutive plain steps by bisection (LO must run),
//!   each trial from an emptied cache: `RESULT phase=max`.
//! - `--trace PATH` (under `--allocator oomguard`): after the timed steps (none with
//!   `--steps 0`: the recording then starts at the first step), `--trace-steps`
//!   more steps at `--batch` recorded with the allocator's history, written as a CSV trace
//!   `op,id,bytes,stream,thread` (each event's thread: `oomguard replay --threads` replays it
//!   so). History stops the thread caches while it records; the events and their threads are
//!   the program's.
//! - `--oom FACTOR` (instead of the plain steps): `--steps` steps of `oomguard_tch::train_step` at FACTOR
//!   × `--batch` from a fresh engine (the step's memory source: the installed allocator's
//!   `Device`, or libtorch's allocator): one `OOM` line each (ms, the plan that ran, retries,
//!   the allocator's moves, the engine's speed decision), then `RESULT phase=oom`.
//! - `--seeded FACTOR` (instead of the plain steps): `oomguard_tch::find_max_batch_train` (the
//!   training step's own attempt, up to the `--max` bound's HI, 4,096 without one: above
//!   the largest on an H200, 1,951), then
//!   `--steps` `train_step`s at FACTOR × the batch found from an engine seeded with
//!   `start_from_finder`: a `FINDER` line per finder trial and verification run (rows, steps,
//!   seconds, peaks) and one for the allocator's moves over the finder, then one `SEEDED` line
//!   per step (ms, plan, retries), then `RESULT
//!   phase=seeded` (the batch found, the seed, the retries of all steps). A GPU phase: on the
//!   CPU the finder sees no device memory and says so.
//! - `--no-mark-steps`: the plain steps under oomguard's allocator are not marked (by default
//!   each starts with `Device::mark_step`, as `train_step` marks its steps; the mark's time and
//!   moves count in the step it starts).
//! - `--check`: 10 steps on one batch first: every parameter gets a finite non-zero gradient and
//!   the loss falls (`RESULT phase=check`), else the exit status is 1.
//!
//! On the CPU (`--device cpu`, for a build check) the model is shrunk to 32 × 32 images.

use std::process::ExitCode;
use std::time::Instant;

use oomguard_tch::{catch_oom, Error};
use tch::nn::{ModuleT, OptimizerConfig};
use tch::{nn, Device, Kind, Tensor};

/// What the allocator did, cumulatively: one counter per name in [`Moves::NAMES`] (maps,
/// unmaps, bytes unmapped, synchronisations, retries inside the allocator; then oomguard's own:
/// retries that kept the cache, out-of-memory errors, step plans installed, dropped, requests
/// served outside a plan that expected them, plans that could not be mapped, plans shared at
/// page granularity).
#[derive(Clone, Copy, Debug, Default)]
struct Moves([i64; 12]);

impl Moves {
    /// The counters' names in the `STEP` and `RESULT` lines.
    const NAMES: [&'static str; 12] = [
        "maps",
        "unmaps",
        "unmapped",
        "syncs",
        "alloc_retries",
        "releases_skipped",
        "ooms",
        "plans",
        "plans_dropped",
        "plan_misses",
        "plans_refused",
        "plans_shared",
    ];
    fn minus(self, o: Self) -> Self {
        Moves(std::array::from_fn(|i| self.0[i] - o.0[i]))
    }
    fn plus(self, o: Self) -> Self {
        Moves(std::array::from_fn(|i| self.0[i] + o.0[i]))
    }
    fn text(&self) -> String {
        let pairs = Self::NAMES.iter().zip(self.0);
        pairs
            .map(|(n, v)| format!("{n}={v}"))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// Who serves the CUDA tensors.
enum Alloc {
    Libtorch(usize),
    Oomguard(oomguard::Device),
    Cpu,
}

impl Alloc {
    fn moves(&self) -> Moves {
        match self {
            Alloc::Oomguard(d) => {
                let s = d.stats();
                let syncs = s.num_sync_all_streams + s.num_stream_syncs;
                let counts = [
                    s.num_map,
                    s.num_unmap,
                    s.unmapped_bytes_total,
                    syncs,
                    s.num_alloc_retries,
                    s.num_releases_skipped,
                    s.num_ooms,
                    s.num_plans_installed,
                    s.num_plans_dropped,
                    s.num_plan_misses,
                    s.num_plans_refused,
                    s.num_plans_shared,
                ];
                Moves(counts.map(|c| c as i64))
            }
            // libtorch counts device allocations and frees (maps and unmaps of expandable
            // segments), whole-device synchronisations and its retries
            Alloc::Libtorch(i) => oomguard_tch::cuda_allocator::device_stats(*i)
                .map(|s| {
                    let (maps, unmaps) = (s.num_device_alloc, s.num_device_free);
                    let (syncs, retries) = (s.num_sync_all_streams, s.num_alloc_retries);
                    Moves([
                        maps, unmaps, 0, syncs, retries, 0, s.num_ooms, 0, 0, 0, 0, 0,
                    ])
                })
                .unwrap_or_default(),
            Alloc::Cpu => Moves::default(),
        }
    }
    /// (peak used, peak reserved) since the last reset.
    fn peaks(&self) -> (u64, u64) {
        match self {
            Alloc::Oomguard(d) => {
                let s = d.stats();
                (s.allocated_bytes.all.peak, s.reserved_bytes.all.peak)
            }
            Alloc::Libtorch(i) => oomguard_tch::cuda_allocator::device_stats(*i)
                .map(|s| {
                    let u = s.usage();
                    (u.used_peak, u.reserved_peak)
                })
                .unwrap_or_default(),
            Alloc::Cpu => (0, 0),
        }
    }
    fn reset_peaks(&self) {
        match self {
            Alloc::Oomguard(d) => d.allocator().reset_peak_stats(),
            Alloc::Libtorch(i) => {
                let _ = oomguard_tch::cuda_allocator::reset_peak_stats(*i);
            }
            Alloc::Cpu => {}
        }
    }
    /// A plain step starts (oomguard's allocator: `Device::mark_step`, as `train_step` does).
    fn mark_step(&self) {
        if let Alloc::Oomguard(d) = self {
            d.mark_step();
        }
    }
    fn empty_cache(&self) {
        match self {
            Alloc::Oomguard(d) => {
                let _ = d.empty_cache();
            }
            Alloc::Libtorch(i) => {
                let _ = oomguard_tch::cuda_allocator::empty_cache(*i);
            }
            Alloc::Cpu => {}
        }
    }
}

struct Args {
    oomguard: bool,
    device: Device,
    batch: i64,
    steps: usize,
    warmup: usize,
    max: Option<(i64, i64)>,
    classes: i64,
    size: i64,
    check: bool,
    trace: Option<String>,
    trace_steps: usize,
    oom: Option<f64>,
    seeded: Option<f64>,
    /// mark each plain step's start on oomguard's device (`Device::mark_step`)
    mark_steps: bool,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        oomguard: false,
        device: Device::Cuda(0),
        batch: 128,
        steps: 6,
        warmup: 2,
        max: None,
        classes: 1000,
        size: 224,
        check: false,
        trace: None,
        trace_steps: 3,
        oom: None,
        seeded: None,
        mark_steps: true,
    };
    let mut it = std::env::args().skip(1);
    let num = |v: Option<String>, name: &str| -> Result<i64, String> {
        let v = v.ok_or(format!("{name} needs a value"))?;
        v.parse::<i64>()
            .ok()
            .filter(|&n| n > 0)
            .ok_or(format!("{name}: {v:?} is not a positive integer"))
    };
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--allocator" => match it.next().as_deref() {
                Some("oomguard") => a.oomguard = true,
                Some("libtorch") => a.oomguard = false,
                v => return Err(format!("--allocator: {v:?} is not libtorch or oomguard")),
            },
            "--device" => {
                a.device = match it.next().as_deref() {
                    Some("cpu") => Device::Cpu,
                    Some("cuda") => Device::Cuda(0),
                    Some(d) => match d.strip_prefix("cuda:").and_then(|n| n.parse().ok()) {
                        Some(n) => Device::Cuda(n),
                        None => return Err(format!("--device: {d:?} is not cpu or cuda:N")),
                    },
                    None => return Err("--device needs a value".into()),
                }
            }
            "--batch" => a.batch = num(it.next(), "--batch")?,
            "--steps" => {
                a.steps = match it.next().as_deref() {
                    Some("0") => 0,
                    v => num(v.map(String::from), "--steps")? as usize,
                }
            }
            "--warmup" => a.warmup = num(it.next(), "--warmup")? as usize,
            "--classes" => a.classes = num(it.next(), "--classes")?,
            "--size" => a.size = num(it.next(), "--size")?,
            "--check" => a.check = true,
            "--no-mark-steps" => a.mark_steps = false,
            "--trace" => a.trace = Some(it.next().ok_or("--trace needs a path")?),
            "--oom" => {
                let v = it.next().ok_or("--oom needs a factor")?;
                a.oom = Some(
                    v.parse::<f64>()
                        .ok()
                        .filter(|f| *f >= 1.0)
                        .ok_or(format!("--oom: {v:?} is not a factor of at least 1"))?,
                );
            }
            "--seeded" => {
                let v = it.next().ok_or("--seeded needs a factor")?;
                a.seeded = Some(
                    v.parse::<f64>()
                        .ok()
                        .filter(|f| *f >= 1.0)
                        .ok_or(format!("--seeded: {v:?} is not a factor of at least 1"))?,
                );
            }
            "--trace-steps" => a.trace_steps = num(it.next(), "--trace-steps")? as usize,
            "--max" => {
                let v = it.next().ok_or("--max needs LO..HI")?;
                let (lo, hi) = v
                    .split_once("..")
                    .ok_or(format!("--max: {v:?} is not LO..HI"))?;
                let (lo, hi) = (
                    num(Some(lo.into()), "--max")?,
                    num(Some(hi.into()), "--max")?,
                );
                if lo >= hi {
                    return Err(format!("--max: {lo} is not below {hi}"));
                }
                a.max = Some((lo, hi));
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if a.device == Device::Cpu {
        a.size = a.size.min(32);
    }
    Ok(a)
}

struct Run {
    args: Args,
    alloc: Alloc,
    vs: nn::VarStore,
    model: nn::SequentialT,
    opt: nn::Optimizer,
}

impl Run {
    fn new(args: Args, alloc: Alloc) -> Result<Self, Error> {
        tch::manual_seed(1234);
        let vs = nn::VarStore::new(args.device);
        let model = if args.device == Device::Cpu {
            // a small stand-in on the CPU: the harness's own check, in seconds
            nn::seq_t()
                .add(nn::conv2d(vs.root() / "c1", 3, 8, 3, Default::default()))
                .add_fn(|x| x.relu().max_pool2d_default(2))
                .add_fn(|x| x.flat_view())
                .add(nn::linear(
                    vs.root() / "fc",
                    8 * 15 * 15,
                    args.classes,
                    Default::default(),
                ))
        } else {
            tch::vision::vgg::vgg16(&vs.root(), args.classes)
        };
        let opt = nn::Sgd {
            momentum: 0.9,
            ..Default::default()
        }
        .build(&vs, 1e-3)?;
        Ok(Run {
            args,
            alloc,
            vs,
            model,
            opt,
        })
    }

    fn batch(&self, rows: i64, seed: i64) -> (Tensor, Tensor) {
        synthetic_batch(&self.args, rows, seed)
    }

    /// One `train_step` of `x`, `y` on `engine` and `source`, synchronised.
    fn train(
        &mut self,
        engine: &oomguard::retry::RetryEngine,
        source: &std::sync::Arc<dyn oomguard::MemorySource>,
        x: &Tensor,
        y: &Tensor,
    ) -> Result<oomguard_tch::TrainedStep, oomguard_tch::TrainStepError> {
        let model = &self.model;
        let done =
            oomguard_tch::train_step(engine, source, &[x, y], &self.vs, &mut self.opt, |_c, r| {
                Ok(model.forward_t(&r[0], true).cross_entropy_for_logits(&r[1]))
            });
        if let Device::Cuda(i) = self.args.device {
            tch::Cuda::synchronize(i as i64);
        }
        done
    }

    /// One plain step, synchronised: the loss.
    fn step(&mut self, x: &Tensor, y: &Tensor) -> Result<f64, Error> {
        let dev = self.args.device;
        let r = catch_oom(|| {
            let loss = self.model.forward_t(x, true).cross_entropy_for_logits(y);
            loss.f_backward()?;
            self.opt.step();
            let v = loss.f_double_value(&[])?;
            if let Device::Cuda(i) = dev {
                tch::Cuda::synchronize(i as i64);
            }
            Ok::<_, Error>(v)
        });
        let z = catch_oom(|| {
            self.opt.zero_grad();
            Ok::<_, Error>(())
        });
        let v = r?;
        z?;
        Ok(v)
    }

    fn conf(&self) -> String {
        match &self.alloc {
            Alloc::Oomguard(_) => format!(
                "oomguard:{}",
                std::env::var("OOMGUARD_ALLOC_CONF").unwrap_or_else(|_| "default".into())
            ),
            _ => std::env::var("PYTORCH_ALLOC_CONF").unwrap_or_else(|_| "native".into()),
        }
    }

    /// Every parameter gets a finite non-zero gradient, and the loss falls on one batch.
    fn check(&mut self) -> Result<bool, Error> {
        let (x, y) = self.batch(8, 7);
        let loss = self.model.forward_t(&x, true).cross_entropy_for_logits(&y);
        loss.f_backward()?;
        let vars = self.vs.trainable_variables();
        let with_grad = vars
            .iter()
            .filter(|v| {
                let g = v.grad();
                g.defined()
                    && g.isfinite().all().int64_value(&[]) == 1
                    && g.abs().sum(Kind::Double).double_value(&[]) > 0.0
            })
            .count();
        self.opt.zero_grad();
        let first = self.step(&x, &y)?;
        let mut last = first;
        for _ in 0..9 {
            last = self.step(&x, &y)?;
        }
        let ok = with_grad == vars.len() && last < first;
        println!(
            "RESULT phase=check parameters={} with_gradient={with_grad} loss_first={first:.4} loss_last={last:.4} ok={ok}",
            vars.len()
        );
        Ok(ok)
    }

    fn steps(&mut self) -> Result<(), Error> {
        if self.args.steps == 0 {
            // `--steps 0`: none (with `--trace`, the recording then starts at the first step)
            return Ok(());
        }
        let b = self.args.batch;
        let mut times = Vec::new();
        let mut moved = Moves::default();
        for s in 0..self.args.warmup + self.args.steps {
            if s == self.args.warmup {
                self.alloc.reset_peaks();
            }
            let m0 = self.alloc.moves();
            let t = Instant::now();
            // (inside the step's time and moves: a plan installed here is this step's cost)
            if self.args.mark_steps {
                self.alloc.mark_step();
            }
            let (x, y) = self.batch(b, 100 + s as i64);
            let loss = self.step(&x, &y)?;
            let ms = t.elapsed().as_secs_f64() * 1e3;
            let m = self.alloc.moves().minus(m0);
            println!(
                "STEP batch={b} step={} ms={ms:.1} loss={loss:.5} {}",
                s + 1,
                m.text()
            );
            if s >= self.args.warmup {
                times.push(ms);
                moved = moved.plus(m);
            }
        }
        times.sort_by(f64::total_cmp);
        let (used, reserved) = self.alloc.peaks();
        println!(
            "RESULT phase=steps alloc_conf={} batch={b} steps={} median_ms={:.1} min_ms={:.1} peak_used={used} peak_reserved={reserved} reserved_over_used={:.4} timed_{}",
            self.conf(),
            times.len(),
            times[times.len() / 2],
            times[0],
            reserved as f64 / used.max(1) as f64,
            moved.text().replace(' ', " timed_")
        );
        Ok(())
    }

    /// `--steps` train_steps at `factor` × `--batch` from a fresh engine.
    fn oom(&mut self, factor: f64) -> Result<(), Error> {
        let rows = (self.args.batch as f64 * factor).round() as i64;
        let engine = oomguard::retry::RetryEngine::new();
        let source = self.source()?;
        let mut times = Vec::new();
        for s in 0..self.args.steps {
            let (x, y) = self.batch(rows, 400 + s as i64);
            let m0 = self.alloc.moves();
            let t = Instant::now();
            let done = self.train(&engine, &source, &x, &y);
            let ms = t.elapsed().as_secs_f64() * 1e3;
            let m = self.alloc.moves().minus(m0);
            match done {
                Ok(d) => {
                    let r = &d.report;
                    println!(
                        "OOM rows={rows} step={} ms={ms:.1} plan=\"{}\" retries={} {} speed=\"{}\" thrash_moved_to=\"{}\"",
                        s + 1,
                        r.final_plan,
                        r.retries(),
                        m.text(),
                        r.speed.as_ref().map_or(String::new(), |v| v.to_string()),
                        r.thrash_moved_to.map_or(String::new(), |p| p.to_string()),
                    );
                    times.push(ms);
                }
                Err(e) => {
                    println!(
                        "OOM rows={rows} step={} ms={ms:.1} error=\"{}\"",
                        s + 1,
                        e.to_string().lines().next().unwrap_or("")
                    );
                    break;
                }
            }
        }
        let first = times.first().copied().unwrap_or(0.0);
        let mut settled = times.iter().skip(1).copied().collect::<Vec<_>>();
        settled.sort_by(f64::total_cmp);
        println!(
            "RESULT phase=oom alloc_conf={} rows={rows} steps={} first_ms={first:.1} settled_median_ms={:.1} settled_min_ms={:.1}",
            self.conf(),
            times.len(),
            settled.get(settled.len() / 2).copied().unwrap_or(0.0),
            settled.first().copied().unwrap_or(0.0),
        );
        Ok(())
    }

    /// The training finder up to `hi` rows, then `--steps` train_steps at `factor` × the batch
    /// found from an engine seeded with it.
    fn seeded(&mut self, factor: f64, hi: usize) -> Result<(), Error> {
        let source = self.source()?;
        let m0 = self.alloc.moves();
        let t = Instant::now();
        let model = &self.model;
        let args = &self.args;
        let opts = oomguard::retry::FinderOptions {
            max: hi,
            ..Default::default()
        };
        let found = oomguard_tch::find_max_batch_train(
            &*source,
            opts,
            &self.vs,
            &mut self.opt,
            |rows| {
                let (x, y) = synthetic_batch(args, rows as i64, 500 + rows as i64);
                Ok(vec![x, y])
            },
            |_c, r| Ok(model.forward_t(&r[0], true).cross_entropy_for_logits(&r[1])),
        )
        .map_err(|e| Error::Batch(format!("the training finder: {e}")))?;
        let finder_secs = t.elapsed().as_secs_f64();
        let moved = self.alloc.moves().minus(m0);
        // each trial and verification run: its rows, steps, time and peaks (where the time goes)
        for (kind, trials) in [("trial", &found.trials), ("verify", &found.verification)] {
            for (i, tr) in trials.iter().enumerate() {
                println!(
                    "FINDER {kind}={} rows={} steps={} secs={:.2} peak={:?} reserved_peak={}",
                    i + 1,
                    tr.rows,
                    tr.steps,
                    tr.elapsed.as_secs_f64(),
                    tr.peak_bytes,
                    tr.reserved_peak_bytes,
                );
            }
        }
        println!("FINDER moves {}", moved.text());
        let rows = (found.max_batch as f64 * factor).round() as usize;
        let seed = found.micro_batch_for(rows);
        let engine = oomguard::retry::RetryEngine::new().start_from_finder(&found);
        let mut retries = 0;
        let mut ran = 0;
        for s in 0..self.args.steps {
            let (x, y) = self.batch(rows as i64, 600 + s as i64);
            let t = Instant::now();
            let done = self
                .train(&engine, &source, &x, &y)
                .map_err(|e| Error::Batch(format!("train_step at {rows} rows: {e}")))?;
            retries += done.report.retries();
            ran += 1;
            println!(
                "SEEDED rows={rows} step={} ms={:.1} plan=\"{}\" retries={} loss={:.4}",
                s + 1,
                t.elapsed().as_secs_f64() * 1e3,
                done.report.final_plan,
                done.report.retries(),
                done.loss,
            );
        }
        println!(
            "RESULT phase=seeded alloc_conf={} max_batch={} finder_trials={} finder_secs={finder_secs:.1} accumulation_bytes={:?} batch_bytes_per_row={:?} rows={rows} seed={seed} steps={ran} retries={retries}",
            self.conf(),
            found.max_batch,
            found.trials.len(),
            found.accumulation_bytes,
            found.batch_bytes_per_row,
        );
        Ok(())
    }

    /// The step's memory source: the installed allocator's `Device`, or libtorch's allocator.
    fn source(&self) -> Result<std::sync::Arc<dyn oomguard::MemorySource>, Error> {
        Ok(match &self.alloc {
            Alloc::Oomguard(d) => std::sync::Arc::new(d.clone()),
            Alloc::Libtorch(i) => oomguard_tch::LibtorchCudaSource::new(*i)?.register(),
            Alloc::Cpu => std::sync::Arc::new(oomguard::Device::sim(oomguard::ByteSize::gib(1))),
        })
    }

    /// `--trace-steps` steps recorded by oomguard's history, written as a CSV trace.
    fn trace(&mut self, path: &str) -> Result<(), Error> {
        let Alloc::Oomguard(d) = &self.alloc else {
            println!("RESULT phase=trace skipped=\"needs --allocator oomguard\"");
            return Ok(());
        };
        let d = d.clone();
        let a = d.allocator();
        a.record_history(4_000_000, false);
        let b = self.args.batch;
        for s in 0..self.args.trace_steps {
            let (x, y) = self.batch(b, 300 + s as i64);
            self.step(&x, &y)?;
        }
        let entries = a.history();
        a.record_history(0, false);
        let mut ids = std::collections::HashMap::new();
        let mut next = 0u64;
        let mut out = String::from("op,id,bytes,stream,thread\n");
        let (mut allocs, mut frees, mut threads) = (0, 0, std::collections::BTreeSet::new());
        for e in entries {
            match e.action {
                oomguard::alloc::TraceAction::Alloc => {
                    ids.insert(e.addr, (next, e.size));
                    out += &format!("a,{next},{},{},{}\n", e.size, e.stream, e.thread);
                    next += 1;
                    allocs += 1;
                    threads.insert(e.thread);
                }
                oomguard::alloc::TraceAction::FreeRequested => {
                    // frees of memory allocated before the recording are left out
                    if let Some((id, bytes)) = ids.remove(&e.addr) {
                        out += &format!("f,{id},{bytes},{},{}\n", e.stream, e.thread);
                        frees += 1;
                        threads.insert(e.thread);
                    }
                }
                _ => {}
            }
        }
        std::fs::write(path, out).map_err(|e| {
            Error::Oomguard(oomguard::Error::InvalidArgument(format!("{path}: {e}")))
        })?;
        println!(
            "RESULT phase=trace path={path} batch={b} steps={} allocs={allocs} frees={frees} threads={threads:?}",
            self.args.trace_steps
        );
        Ok(())
    }

    /// Whether two consecutive steps at `rows` run, from an emptied cache.
    fn fits(&mut self, rows: i64) -> Result<bool, Error> {
        self.alloc.empty_cache();
        let t = Instant::now();
        let mut ok = true;
        for s in 0..2 {
            let (x, y) = self.batch(rows, 200 + s);
            match self.step(&x, &y) {
                Ok(_) => {}
                Err(e) if oomguard::retry::IsOom::is_oom(&e) => {
                    ok = false;
                    break;
                }
                Err(e) => return Err(e),
            }
        }
        println!(
            "TRIAL rows={rows} fits={ok} secs={:.1}",
            t.elapsed().as_secs_f64()
        );
        Ok(ok)
    }

    fn max(&mut self, lo: i64, hi: i64) -> Result<(), Error> {
        let t = Instant::now();
        let (mut lo, mut hi) = (lo, hi);
        let mut trials = 0;
        if !self.fits(lo)? {
            println!("RESULT phase=max error=\"{lo} rows do not fit\"");
            return Ok(());
        }
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            trials += 1;
            if self.fits(mid)? {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        self.alloc.empty_cache();
        println!(
            "RESULT phase=max alloc_conf={} max_batch={lo} trials={trials} secs={:.1}",
            self.conf(),
            t.elapsed().as_secs_f64()
        );
        Ok(())
    }
}

/// `rows` seeded random images of `args.size` pixels and their labels, on `args.device`.
fn synthetic_batch(args: &Args, rows: i64, seed: i64) -> (Tensor, Tensor) {
    tch::manual_seed(seed);
    let s = args.size;
    let x = Tensor::randn([rows, 3, s, s], (Kind::Float, args.device));
    let y = Tensor::randint(args.classes, [rows], (Kind::Int64, args.device));
    (x, y)
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("tch_convnet: {e}");
            return ExitCode::from(64);
        }
    };
    let alloc = match args.device {
        Device::Cuda(i) if args.oomguard => match oomguard_tch::allocator::install(i) {
            Ok(d) => Alloc::Oomguard(d),
            Err(e) => {
                eprintln!("tch_convnet: oomguard's allocator on cuda:{i}: {e}");
                return ExitCode::from(2);
            }
        },
        Device::Cuda(i) => Alloc::Libtorch(i),
        _ => Alloc::Cpu,
    };
    let (check, max, trace, oom, seeded) = (
        args.check,
        args.max,
        args.trace.clone(),
        args.oom,
        args.seeded,
    );
    let mut run = match Run::new(args, alloc) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("tch_convnet: {e}");
            return ExitCode::from(2);
        }
    };
    let r = (|| -> Result<bool, Error> {
        let mut ok = true;
        if check {
            ok &= run.check()?;
        }
        // with --oom or --seeded, the plain steps at --batch are left out (they may not fit)
        if oom.is_none() && seeded.is_none() {
            run.steps()?;
        }
        if let Some(p) = &trace {
            run.trace(p)?;
        }
        if let Some((lo, hi)) = max {
            run.max(lo, hi)?;
        }
        if let Some(f) = oom {
            run.oom(f)?;
        }
        if let Some(f) = seeded {
            let hi = max.map_or(4_096, |(_, hi)| hi as usize);
            run.seeded(f, hi)?;
        }
        Ok(ok)
    })();
    match r {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("tch_convnet: {e}");
            ExitCode::from(1)
        }
    }
}
