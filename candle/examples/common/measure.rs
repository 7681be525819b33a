//! Measurements shared by the H100 examples: fragmentation of a loop, the largest batch a step
//! runs (bisection), and the device memory the allocator does not see. Every figure is printed on
//! a line starting with `RESULT`.

// Included by several examples (`#[path]`), each of which uses part of it.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Instant;

use oomguard::source::MemorySource;

/// The examples' result type.
pub type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Where candle's tensors live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Allocator {
    /// The driver's stream-ordered pool (candle as it is).
    Pool,
    /// oomguard's caching allocator under candle (the allocator hook).
    Oomguard,
}

impl Allocator {
    /// `--allocator pool|oomguard` from the arguments (default: pool).
    pub fn from_args(args: &[String]) -> Res<Self> {
        match args.iter().position(|a| a == "--allocator") {
            None => Ok(Allocator::Pool),
            Some(i) => match args.get(i + 1).map(String::as_str) {
                Some("pool") => Ok(Allocator::Pool),
                Some("oomguard") => Ok(Allocator::Oomguard),
                other => Err(format!("--allocator: pool or oomguard, not {other:?}").into()),
            },
        }
    }

    /// Makes this allocator the memory of `dev` and returns its source. Call before anything is
    /// allocated on the device.
    pub fn source(self, dev: &candle_core::Device) -> Res<Arc<dyn MemorySource>> {
        match self {
            Allocator::Pool => Ok(oomguard_candle::memory_source(dev)?),
            #[cfg(feature = "allocator-hook")]
            Allocator::Oomguard => Ok(Arc::new(oomguard_candle::alloc_hook::install(dev)?)),
            #[cfg(not(feature = "allocator-hook"))]
            Allocator::Oomguard => {
                Err("--allocator oomguard needs the `allocator-hook` feature".into())
            }
        }
    }
}

/// The phase (the first argument, `all` when there is none), one of `phases` or `all`.
pub fn phase(args: &[String], phases: &[&str]) -> Res<String> {
    let phase = args.first().map(String::as_str).unwrap_or("all");
    if phase == "all" || phases.contains(&phase) {
        return Ok(phase.to_string());
    }
    Err(format!("unknown phase {phase}: all, {}", phases.join(", ")).into())
}

/// `--name VALUE` as a number.
pub fn flag(args: &[String], name: &str) -> Res<Option<usize>> {
    match args.iter().position(|a| a == name) {
        Some(i) => Ok(Some(
            args.get(i + 1)
                .ok_or(format!("{name} needs a value"))?
                .parse()
                .map_err(|e| format!("{name}: {e}"))?,
        )),
        None => Ok(None),
    }
}

/// Whether `e` is an out-of-memory error.
pub fn is_oom(e: &candle_core::Error) -> bool {
    oomguard::IsOom::is_oom(e)
}

/// Device memory in use (`cuMemGetInfo`: total - free).
pub fn device_used() -> Res<u64> {
    let (free, total) = oomguard::cudarc::driver::result::mem_get_info()?;
    Ok((total - free) as u64)
}

/// Runs `steps` steps (`step(i)`, synchronised by the caller), each on a fresh batch, from an
/// empty cache: peak reserved / peak used of the source, OOMs, median step time, and the device
/// memory outside the source.
pub fn fragmentation(
    what: &str,
    source: &Arc<dyn MemorySource>,
    steps: usize,
    mut step: impl FnMut(usize) -> candle_core::Result<()>,
) -> Res<f64> {
    source.empty_cache()?;
    source.reset_peak()?;
    let (mut ooms, mut times, mut unseen_max) = (0, Vec::new(), 0i64);
    for s in 0..steps {
        let t0 = Instant::now();
        match step(s) {
            Ok(()) => times.push(t0.elapsed().as_secs_f64()),
            Err(e) if is_oom(&e) => ooms += 1,
            Err(e) => return Err(e.into()),
        }
        let unseen = device_used()? as i64 - source.usage()?.reserved as i64;
        unseen_max = unseen_max.max(unseen);
    }
    let u = source.usage()?;
    times.sort_by(f64::total_cmp);
    let median = times.get(times.len() / 2).copied().unwrap_or(f64::NAN);
    let ratio = u.reserved_peak as f64 / u.used_peak.max(1) as f64;
    oomguard_harness::say!(
        "RESULT frag: {}, {what}, {steps} steps: peak reserved {} / peak used {} = {ratio:.4}; \
         {ooms} OOM; median {:.1} ms/step",
        source.info().kind,
        u.reserved_peak,
        u.used_peak,
        median * 1e3
    );
    let used = device_used()?;
    oomguard_harness::say!(
        "RESULT unseen: device used {used} B, {} reserved {} B: {} B outside it at the end \
         (most after a step: {unseen_max} B)",
        source.info().kind,
        u.reserved,
        used as i64 - u.reserved as i64,
    );
    Ok(ratio)
}

/// The largest batch for which `fits(rows)` holds (a step run from an emptied cache; `Ok(false)`
/// on OOM): doubling from `start`, then bisection.
pub fn max_batch(
    source: &Arc<dyn MemorySource>,
    start: usize,
    mut fits: impl FnMut(usize) -> candle_core::Result<()>,
) -> Res<usize> {
    let mut probe = |rows: usize| -> Res<bool> {
        source.empty_cache()?;
        let r = fits(rows);
        source.empty_cache()?;
        match r {
            Ok(()) => Ok(true),
            Err(e) if is_oom(&e) => Ok(false),
            Err(e) => Err(e.into()),
        }
    };
    let mut runs = 1;
    if !probe(start)? {
        return Err(format!("not even {start} rows fit").into());
    }
    let (mut lo, mut hi) = (start, start * 2);
    loop {
        runs += 1;
        if probe(hi)? {
            lo = hi;
            hi *= 2;
        } else {
            break;
        }
    }
    while hi - lo > 1 {
        runs += 1;
        let mid = lo + (hi - lo) / 2;
        if probe(mid)? {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    oomguard_harness::say!(
        "RESULT max: {} largest batch a single step runs: {lo} (bisection, {runs} step runs)",
        source.info().kind
    );
    Ok(lo)
}
