//! A GPT-2-small-shaped decoder (12 layers, width 768, 12 heads, vocabulary 50257, sequence 512,
//! AdamW) trained with candle on seeded synthetic tokens, under oomguard, on a CUDA device.
//!
//! ```text
//! candle_gpt [all|find|oom|equiv|overhead|frag|seeded|snap PREFIX] [--big ROWS] [--steps N]
//!            [--device ORDINAL] [--release-threshold BYTES] [--allocator pool|oomguard]
//!            [--batch ROWS] [--factor N]
//! ```
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
//! - `find`: oomguard's `find_max_batch` on the driver pool (its step runs and found batch);
//!   `--steps` (default 100) plain steps at the found batch, and as many emptying the cache as
//!   often as the report says (`FinderReport::empty_cache_every`, where the held memory had not
//!   settled); the true maximum by bisection over real steps; then the loops again;
//! - `oom`: a batch larger than the card holds (`--big`, default twice the true maximum found,
//!   else 1024) survives a real driver OOM by accumulation; 3 more steps start from the
//!   remembered plan;
//! - `seeded`: `oomguard_candle::find_max_batch_train` (the training step's own attempt), then
//!   `--steps` (default 20) `train_step`s at `--factor` (default 2) × the batch found from an
//!   engine seeded with `start_from_finder`: each step's retries and plan, and their sum;
//! - `equiv`: parameters after 3 steps of batch 8, whole vs 4 micro-batches of 2, with SGD and
//!   with AdamW (‖a−b‖/‖b‖ over every parameter, f32, TF32 off);
//! - `overhead`: the same steps as a plain candle loop and through `train_step`, interleaved;
//! - the driver pool's `memory_summary` at the end.
//!
//! Every figure is printed on a line starting with `RESULT`.

mod model;

use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW, VarBuilder, VarMap, SGD};
use oomguard::retry::{find_max_batch, BatchPlan, FinderOptions, RetryEngine};
use oomguard::source::MemorySource;
use oomguard_candle::{chunk_rows, memory_source, train_step, GradAccumulator};

use model::{synthetic_tokens, Config, Gpt};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

struct Run {
    dev: Device,
    cfg: Config,
    model: Gpt,
    vars: Vec<Var>,
    init: Vec<Tensor>,
}

/// Where candle's tensors live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Allocator {
    /// The driver's stream-ordered pool (candle as it is).
    Pool,
    /// oomguard's caching allocator under candle (the allocator hook).
    Oomguard,
}

impl Run {
    /// The run and the memory source its tensors come from.
    fn new(ordinal: usize, allocator: Allocator) -> Res<(Self, Arc<dyn MemorySource>)> {
        let dev = Device::new_cuda(ordinal)?;
        let source: Arc<dyn MemorySource> = match allocator {
            Allocator::Pool => memory_source(&dev)?,
            #[cfg(feature = "allocator-hook")]
            Allocator::Oomguard => Arc::new(oomguard_candle::alloc_hook::install(&dev)?),
            #[cfg(not(feature = "allocator-hook"))]
            Allocator::Oomguard => {
                return Err("--allocator oomguard needs the `allocator-hook` feature".into())
            }
        };
        dev.set_seed(42)?;
        let cfg = Config::gpt2_small();
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
        let model = Gpt::new(cfg, vb, &dev)?;
        let vars = varmap.all_vars();
        let init = vars
            .iter()
            .map(|v| v.as_tensor().copy())
            .collect::<Result<_, _>>()?;
        let n: usize = vars.iter().map(|v| v.elem_count()).sum();
        println!("model: {} parameters, {} tensors", n, vars.len());
        let run = Self {
            dev,
            cfg,
            model,
            vars,
            init,
        };
        Ok((run, source))
    }

    fn reset(&self) -> Res<()> {
        for (v, t) in self.vars.iter().zip(&self.init) {
            v.set(t)?;
        }
        Ok(())
    }

    fn adamw(&self) -> Res<AdamW> {
        Ok(AdamW::new(
            self.vars.clone(),
            ParamsAdamW {
                lr: 3e-4,
                ..Default::default()
            },
        )?)
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

fn is_oom(e: &candle_core::Error) -> bool {
    oomguard::IsOom::is_oom(e)
}

/// Runs one step of `rows`; `Ok(false)` on OOM, an error on anything else.
fn fits(run: &Run, source: &dyn MemorySource, opt: &mut AdamW, rows: usize) -> Res<bool> {
    source.empty_cache()?;
    let r = run
        .tokens(rows as u64, rows)
        .and_then(|t| run.plain_step(opt, &t));
    source.empty_cache()?;
    match r {
        Ok(_) => Ok(true),
        Err(e) if is_oom(&e) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// `steps` plain steps of `rows` (tokens seeded from `seed`) after emptying the cache, and
/// again before every `empty_every`-th step when given (1: before each): the out-of-memory
/// count, seconds per step, and which steps failed ('X') or ran ('.').
fn train_at(
    run: &Run,
    source: &dyn MemorySource,
    opt: &mut AdamW,
    rows: usize,
    steps: usize,
    empty_every: Option<usize>,
    seed: u64,
) -> Res<(usize, f64, String)> {
    source.empty_cache()?;
    let t0 = Instant::now();
    let mut pattern = String::new();
    for s in 0..steps {
        if empty_every.is_some_and(|n| s > 0 && s % n == 0) {
            source.empty_cache()?;
        }
        let t = run.tokens(seed + s as u64, rows)?;
        match run.plain_step(opt, &t) {
            Ok(_) => pattern.push('.'),
            Err(e) if is_oom(&e) => pattern.push('X'),
            Err(e) => return Err(e.into()),
        }
    }
    let ooms = pattern.matches('X').count();
    Ok((ooms, t0.elapsed().as_secs_f64() / steps as f64, pattern))
}

fn phase_find(run: &Run, source: &Arc<dyn MemorySource>, steps: usize) -> Res<usize> {
    candle_core::cuda::set_gemm_reduced_precision_f32(true);
    let mut opt = run.adamw()?;
    // Optimizer state exists before the search, as in a run that is already training.
    run.plain_step(&mut opt, &run.tokens(0, 1)?)?;
    let t0 = Instant::now();
    let report = find_max_batch(
        source,
        FinderOptions {
            start: 4,
            max: 1 << 14,
            ..Default::default()
        },
        |rows| {
            let t = run.tokens(rows as u64, rows)?;
            run.plain_step(&mut opt, &t)
        },
    )?;
    let found = report.max_batch;
    println!("{report}");
    println!(
        "RESULT find: oomguard found batch {found} in {} step runs ({:.1} s)",
        report.step_runs(),
        t0.elapsed().as_secs_f64()
    );

    // The found batch as a loop right after the search (the state the finder leaves), before
    // any step of the bisection below runs out of memory: which steps fail ('X') or run ('.').
    let (ooms, _, pattern) = train_at(run, &**source, &mut opt, found, steps, None, 500)?;
    println!("RESULT find: {steps} plain steps at the found batch {found} right after the search: {ooms} OOM [{pattern}]");
    // Where the report says the held memory had not settled: the same loop, emptying the cache
    // as often as it says.
    if let Some(every) = report.empty_cache_every() {
        let every = every as usize;
        let (ooms, per, pattern) =
            train_at(run, &**source, &mut opt, found, steps, Some(every), 500)?;
        println!("RESULT find: {steps} steps at the found batch {found}, cache emptied every {every} as the report says: {ooms} OOM ({per:.2} s/step) [{pattern}]");
    }

    // The true maximum: grow from the found batch until a step fails, then bisect.
    let mut probes = 1; // the found batch itself is checked first
    let (mut lo, mut hi): (usize, usize);
    if fits(run, &**source, &mut opt, found)? {
        lo = found;
        let mut k = 1;
        loop {
            probes += 1;
            if fits(run, &**source, &mut opt, lo + k)? {
                lo += k;
                k *= 2;
            } else {
                hi = lo + k;
                break;
            }
        }
    } else {
        hi = found;
        let mut k = 1;
        loop {
            probes += 1;
            let r = found.saturating_sub(k).max(1);
            if fits(run, &**source, &mut opt, r)? {
                lo = r;
                break;
            }
            hi = r;
            if r == 1 {
                return Err("not even one row fits".into());
            }
            k *= 2;
        }
    }
    while hi - lo > 1 {
        probes += 1;
        let mid = lo + (hi - lo) / 2;
        if fits(run, &**source, &mut opt, mid)? {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    println!(
        "RESULT find: true maximum {lo} (bisection, {probes} step runs); found / true = {:.3}",
        found as f64 / lo as f64
    );

    // The found batch trains: first as a plain loop, then with the pool trimmed before each
    // step. The driver's pool does not defragment: near the card's limit a step can fail on the
    // blocks the previous step left (trimmed or not at synchronisation), and a failed step
    // skips the synchronisation that would have released them.
    let plain_steps = steps;
    let (ooms, per, pattern) = train_at(run, &**source, &mut opt, found, plain_steps, None, 1000)?;
    println!(
        "RESULT find: {plain_steps} plain steps at the found batch {found} after the bisection: {ooms} OOM ({per:.2} s/step) [{pattern}]"
    );
    let trimmed = steps.min(20);
    let (ooms, per, _) = train_at(run, &**source, &mut opt, found, trimmed, Some(1), 1000)?;
    println!(
        "RESULT find: {trimmed} steps at the found batch {found}, cache emptied before each: {ooms} OOM ({per:.2} s/step)"
    );
    Ok(lo)
}

fn phase_oom(run: &Run, source: &Arc<dyn MemorySource>, big: usize) -> Res<()> {
    candle_core::cuda::set_gemm_reduced_precision_f32(true);
    run.reset()?;
    source.empty_cache()?;
    let mut opt = run.adamw()?;
    let engine = RetryEngine::new();
    for step in 0..4u64 {
        let tokens = run.tokens(2000 + step, big)?;
        let t0 = Instant::now();
        let done = train_step(
            &engine,
            source,
            &[&tokens],
            &run.vars,
            &mut opt,
            |_, rows| run.model.loss(&rows[0]),
        )?;
        run.dev.synchronize()?;
        let r = &done.report;
        println!(
            "RESULT oom: step {step} batch {big}: {} retries, plan {} x {} (from memory: {}), rows {}, loss {:.4}, {:.1} s",
            r.retries(),
            r.final_plan.chunks().len(),
            r.final_plan.micro_batch(),
            r.from_memory,
            done.rows,
            done.loss,
            t0.elapsed().as_secs_f64()
        );
        if step == 0 {
            for a in &r.attempts {
                println!("  attempt: plan {:?} -> {:?}", a.plan, a.outcome);
            }
        }
    }
    Ok(())
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
        println!(
            "SEEDED step {step} batch {rows}: {} retries, plan {} x {}, loss {:.4}, {:.1} ms",
            done.report.retries(),
            done.report.final_plan.chunks().len(),
            done.report.final_plan.micro_batch(),
            done.loss,
            t.elapsed().as_secs_f64() * 1e3
        );
    }
    println!(
        "RESULT seeded: found {} rows ({} trials, {finder_secs:.1} s), batch bytes {:?} a row, accumulation {:?} B; {steps} steps at {rows} rows from micro-batches of at most {seed}: {retries} retries",
        found.max_batch,
        found.trials.len(),
        found.batch_bytes_per_row,
        found.accumulation_bytes,
    );
    Ok(())
}

fn rel_diff(a: &[Tensor], b: &[Tensor]) -> Res<f64> {
    let (mut num, mut den) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        num += (x - y)?
            .sqr()?
            .sum_all()?
            .to_dtype(DType::F64)?
            .to_scalar::<f64>()?;
        den += y
            .sqr()?
            .sum_all()?
            .to_dtype(DType::F64)?
            .to_scalar::<f64>()?;
    }
    Ok((num / den).sqrt())
}

fn phase_equiv(run: &Run) -> Res<()> {
    candle_core::cuda::set_gemm_reduced_precision_f32(false);
    let batch = 8;
    for opt_name in ["SGD", "AdamW"] {
        let mut params = Vec::new();
        let mut losses = Vec::new();
        for micro in [batch, 2] {
            run.reset()?;
            let plan = BatchPlan::with_micro_batch(batch, micro)?;
            let mut sgd = SGD::new(run.vars.clone(), 0.05)?;
            let mut adamw = run.adamw()?;
            let mut last = 0.0;
            for step in 0..3u64 {
                let tokens = run.tokens(3000 + step, batch)?;
                let mut acc = GradAccumulator::new(&run.vars);
                for c in plan.chunks() {
                    let loss = run.model.loss(&chunk_rows(&tokens, &c)?)?;
                    acc.backward(&loss, &c)?;
                }
                last = acc.loss();
                let g = acc.into_grads()?;
                match opt_name {
                    "SGD" => sgd.step(&g)?,
                    _ => adamw.step(&g)?,
                }
            }
            losses.push(last);
            params.push(
                run.vars
                    .iter()
                    .map(|v| v.as_tensor().copy())
                    .collect::<Result<Vec<_>, _>>()?,
            );
        }
        println!(
            "RESULT equiv: {opt_name}, 3 steps of batch {batch}: 1 x {batch} vs 4 x 2 micro-batches: \
             ||a-b||/||b|| = {:.3e}; last loss {:.6} vs {:.6}",
            rel_diff(&params[1], &params[0])?,
            losses[0],
            losses[1]
        );
    }
    Ok(())
}

fn phase_overhead(run: &Run, source: &Arc<dyn MemorySource>, ordinal: usize) -> Res<()> {
    candle_core::cuda::set_gemm_reduced_precision_f32(true);
    run.reset()?;
    // Both loops on a pool that keeps its cache (as a tuned loop would), so that neither pays
    // the driver for memory on every step; restored afterwards.
    let pool = oomguard::source::DriverPool::current(ordinal)?;
    let threshold = pool.release_threshold()?;
    pool.set_release_threshold(u64::MAX)?;
    let batch = 8;
    let rounds = 12;
    let per_round = 5;
    let mut opt_plain = run.adamw()?;
    let mut opt_wrapped = run.adamw()?;
    let engine = RetryEngine::new();
    let tokens = run.tokens(4000, batch)?;
    // Warm-up of both paths (kernels, cuBLAS, optimizer state, the remembered plan).
    run.plain_step(&mut opt_plain, &tokens)?;
    train_step(
        &engine,
        source,
        &[&tokens],
        &run.vars,
        &mut opt_wrapped,
        |_, rows| run.model.loss(&rows[0]),
    )?;
    run.dev.synchronize()?;
    let (mut plain, mut wrapped) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        for _ in 0..per_round {
            let t0 = Instant::now();
            run.plain_step(&mut opt_plain, &tokens)?;
            plain.push(t0.elapsed().as_secs_f64());
        }
        for _ in 0..per_round {
            let t0 = Instant::now();
            let done = train_step(
                &engine,
                source,
                &[&tokens],
                &run.vars,
                &mut opt_wrapped,
                |_, rows| run.model.loss(&rows[0]),
            )?;
            run.dev.synchronize()?;
            wrapped.push(t0.elapsed().as_secs_f64());
            assert_eq!(done.report.retries(), 0);
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (p, w) = (median(&mut plain), median(&mut wrapped));
    pool.set_release_threshold(threshold)?;
    println!(
        "RESULT overhead: batch {batch}, {} steps each, interleaved, pool release threshold max: \
         plain {:.2} ms/step, train_step {:.2} ms/step (medians), ratio {:.4}",
        rounds * per_round,
        p * 1e3,
        w * 1e3,
        w / p
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
    println!(
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
        println!(
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

/// Device memory in use (`cuMemGetInfo`: total - free).
fn device_used() -> Res<u64> {
    let (free, total) = oomguard::cudarc::driver::result::mem_get_info()?;
    Ok((total - free) as u64)
}

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
    println!(
        "RESULT frag: {}, batch {batch}, {steps} steps: peak reserved {} / peak used {} = {:.4}; \
         {ooms} OOM; median {:.1} ms/step",
        source.info().kind,
        u.reserved_peak,
        u.used_peak,
        u.reserved_peak as f64 / u.used_peak.max(1) as f64,
        median * 1e3
    );
    let used = device_used()?;
    println!(
        "RESULT unseen: device used {used} B, {} reserved {} B: {} B outside it at the end \
         (most after a step: {unseen_max} B); the allocator saw {:.4} of device memory",
        source.info().kind,
        u.reserved,
        used as i64 - u.reserved as i64,
        u.reserved as f64 / used as f64
    );
    Ok(())
}

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let phase = args
        .first()
        .map(String::as_str)
        .unwrap_or("all")
        .to_string();
    let flag = |name: &str| -> Res<Option<usize>> {
        match args.iter().position(|a| a == name) {
            Some(i) => Ok(Some(
                args.get(i + 1)
                    .ok_or(format!("{name} needs a value"))?
                    .parse()
                    .map_err(|e| format!("{name}: {e}"))?,
            )),
            None => Ok(None),
        }
    };
    let ordinal = flag("--device")?.unwrap_or(0);
    let steps = flag("--steps")?.unwrap_or(100);
    if ![
        "all", "find", "oom", "equiv", "overhead", "frag", "seeded", "snap",
    ]
    .contains(&phase.as_str())
    {
        return Err(format!(
            "unknown phase {phase}: all, find, oom, equiv, overhead, frag, seeded or snap"
        )
        .into());
    }
    let allocator = match args.iter().position(|a| a == "--allocator") {
        None => Allocator::Pool,
        Some(i) => match args.get(i + 1).map(String::as_str) {
            Some("pool") => Allocator::Pool,
            Some("oomguard") => Allocator::Oomguard,
            other => return Err(format!("--allocator: pool or oomguard, not {other:?}").into()),
        },
    };
    let (run, source) = Run::new(ordinal, allocator)?;
    // The pool as candle leaves it: the driver's default release threshold (0) hands unused
    // memory back at every synchronisation, so every step starts from an empty pool. With a
    // high threshold the pool keeps the previous step's blocks, and a step near the card's
    // limit can fail on the cached blocks' fragmentation (seen at 70 rows: 99 of 100 steps).
    if let Some(t) = flag("--release-threshold")? {
        oomguard::source::DriverPool::current(ordinal)?.set_release_threshold(t as u64)?;
    }
    println!("memory source: {}", source.info());
    let mut true_max = None;
    if phase == "all" || phase == "find" {
        true_max = Some(phase_find(&run, &source, steps)?);
    }
    if phase == "all" || phase == "oom" {
        let big = flag("--big")?.or(true_max.map(|m| 2 * m)).unwrap_or(1024);
        phase_oom(&run, &source, big)?;
    }
    if phase == "all" || phase == "equiv" {
        phase_equiv(&run)?;
    }
    if phase == "all" || phase == "overhead" {
        phase_overhead(&run, &source, ordinal)?;
    }
    if phase == "snap" {
        let prefix = args.get(1).ok_or("snap needs an output PREFIX")?;
        let batch = flag("--batch")?.ok_or("snap needs --batch ROWS")?;
        phase_snapshot(&run, prefix, batch, flag("--steps")?.unwrap_or(1))?;
    }
    if phase == "seeded" {
        let factor = flag("--factor")?.unwrap_or(2).max(1);
        phase_seeded(&run, &source, factor, flag("--steps")?.unwrap_or(20))?;
    }
    if phase == "frag" {
        let batch = flag("--batch")?.ok_or("frag needs --batch ROWS")?;
        phase_frag(&run, &source, batch, flag("--steps")?.unwrap_or(20))?;
    }
    println!("{}", source.memory_summary());
    Ok(())
}
