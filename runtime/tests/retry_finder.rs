//! The predictive batch finder on simulated models whose memory is linear in the batch: at least
//! 95% of the true maximum in at most 4 step runs.

use oomguard_runtime::backend::sim::SimDevice;
use oomguard_runtime::retry::{find_max_batch, FinderError, FinderOptions};
use oomguard_runtime::{AllocatorConfig, ByteSize, Device, Error};

const MIB: u64 = 1 << 20;

struct Model {
    capacity: ByteSize,
    params: u64,
    layers: usize,
    act_per_row: u64,
    workspace: u64,
}

impl Model {
    fn device(&self) -> (Device, oomguard_runtime::DeviceBuffer<u8>) {
        let dev = Device::new(
            SimDevice::address_only(self.capacity),
            AllocatorConfig::default(),
        );
        let weights = dev.alloc::<u8>(self.params as usize).unwrap();
        (dev, weights)
    }
    /// Forward keeps every layer's activations for backward; backward needs gradients and a
    /// workspace.
    fn step(&self, dev: &Device, rows: usize) -> Result<(), Error> {
        let mut acts = Vec::with_capacity(self.layers);
        for _ in 0..self.layers {
            acts.push(dev.alloc::<u8>((self.act_per_row * rows as u64) as usize)?);
        }
        let _grads = dev.alloc::<u8>(self.params as usize)?;
        let _ws = dev.alloc::<u8>(self.workspace as usize)?;
        Ok(())
    }
    fn true_max(&self, dev: &Device) -> usize {
        let (mut lo, mut hi) = (0usize, 1usize);
        while self.step(dev, hi).is_ok() {
            lo = hi;
            hi *= 2;
        }
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            if self.step(dev, mid).is_ok() {
                lo = mid
            } else {
                hi = mid
            }
        }
        lo
    }
}

fn models() -> Vec<(&'static str, Model)> {
    vec![
        (
            "gpt2-like",
            Model {
                capacity: ByteSize::gib(80),
                params: 1024 * MIB,
                layers: 12,
                act_per_row: 60 * MIB,
                workspace: 512 * MIB,
            },
        ),
        (
            "resnet-like",
            Model {
                capacity: ByteSize::gib(24),
                params: 100 * MIB,
                layers: 50,
                act_per_row: 600 << 10,
                workspace: 64 * MIB,
            },
        ),
        (
            "mlp-like",
            Model {
                capacity: ByteSize::gib(8),
                params: 200 * MIB,
                layers: 4,
                act_per_row: 400 << 10,
                workspace: 8 * MIB,
            },
        ),
    ]
}

#[test]
fn finds_95_percent_in_4_runs() {
    for (name, m) in models() {
        let (dev, _weights) = m.device();
        let truth = m.true_max(&dev);
        let report =
            find_max_batch(&dev, FinderOptions::default(), |rows| m.step(&dev, rows)).unwrap();
        let ratio = report.max_batch as f64 / truth as f64;
        println!("{name}: true {truth}, {report}");
        assert!(report.max_batch <= truth, "{name}: {report}");
        assert!(ratio >= 0.95, "{name}: {ratio:.3} of {truth}: {report}");
        assert!(report.runs() <= 4, "{name}: {report}");
        // each trial runs two consecutive steps (issue 26, point 7b): 8 step runs, then one
        // verification of 32 consecutive steps that passes at once on a source that does not
        // fragment
        assert_eq!(report.verification.len(), 1, "{name}: {report}");
        assert_eq!(report.verified_steps(), 32, "{name}: {report}");
        assert!(report.step_runs() <= 8 + 32, "{name}: {report}");
        let fit = report.fit.expect("a fit");
        let per_row = (m.layers as u64 * m.act_per_row) as f64;
        assert!(
            (fit.per_row_bytes / per_row - 1.0).abs() < 0.01,
            "{name}: {fit:?}"
        );
        // the device is left as found
        assert_eq!(
            dev.stats().allocated_bytes.all.current,
            m.params.next_multiple_of(512)
        );
    }
}

#[test]
fn bisects_when_the_prediction_fails() {
    // Memory jumps past 300 rows (a different kernel takes a large workspace): the linear fit
    // overshoots, and the finder bisects down to the real limit.
    let dev = Device::sim(ByteSize::mib(1024));
    let step = |rows: usize| -> Result<(), Error> {
        let _a = dev.alloc::<u8>(rows * (1 << 20))?;
        let _ws = dev.alloc::<u8>(if rows > 300 { 900 << 20 } else { 1 << 20 })?;
        Ok(())
    };
    let r = find_max_batch(&dev, FinderOptions::default(), step).unwrap();
    assert!(r.trials.iter().any(|t| t.peak_bytes.is_none()), "{r}");
    // within the finder's 5% of the limit, never above it
    assert!((285..=300).contains(&r.max_batch), "{r}");
    assert!(step(r.max_batch).is_ok());
}

#[test]
fn errors_are_reported() {
    let dev = Device::sim(ByteSize::mib(64));
    let nothing = find_max_batch(&dev, FinderOptions::default(), |_| {
        dev.alloc::<u8>(128 << 20).map(|_| ())
    })
    .unwrap_err();
    assert!(matches!(nothing, FinderError::NothingFits(_)), "{nothing}");
    // the 1-row run's request and the device's capacity, and what to change
    let text = nothing.to_string();
    assert!(
        text.contains("the 1-row run made a request of 128.00 MiB against the device's whole capacity of 64.00 MiB: a larger device is needed"),
        "{text}"
    );
    // a request that fits the card but not what the program holds: said so
    let _held = dev.alloc::<u8>(48 << 20).unwrap();
    let e = find_max_batch(&dev, FinderOptions::default(), |_| {
        dev.alloc::<u8>(32 << 20).map(|_| ())
    })
    .unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains("it fits the device's capacity but not what was free"),
        "{text}"
    );
    let bad = FinderOptions {
        start: 0,
        ..FinderOptions::default()
    };
    let e = find_max_batch(&dev, bad, |_| Ok::<_, Error>(())).unwrap_err();
    assert!(e.to_string().contains("start 0"), "{e}");
    let e = find_max_batch(&dev, FinderOptions::default(), |_| {
        Err::<(), _>(Error::InvalidArgument("shape".into()))
    })
    .unwrap_err();
    assert!(matches!(e, FinderError::Step(_)), "{e}");
}

/// A training step behind a retry engine (the way `train_step` runs one): micro-batches of
/// 1 MiB of activations a row. One call site, so the engine remembers its plan.
fn engine_step(
    engine: &oomguard_runtime::retry::RetryEngine,
    dev: &Device,
    rows: usize,
) -> Result<(), oomguard_runtime::retry::RetryError<Error>> {
    engine
        .run(
            dev,
            rows,
            |plan| {
                for c in plan.chunks() {
                    let _acts = dev.alloc::<u8>(c.len() << 20)?;
                }
                Ok::<_, Error>(())
            },
            |_| (),
        )
        .map(|r| r.value)
}

/// Issue 26, point 7: an engine inside the step that remembered a split plan runs every trial
/// above its micro-batch split "from memory", with no retry. The old finder accepted those
/// trials and returned `max` (2^20 rows on a device that holds about 250); now the trial is
/// refused with a reason, nested in another engine's step or not.
#[test]
fn a_step_whose_engine_ran_a_remembered_split_plan_is_refused() {
    use oomguard_runtime::retry::RetryEngine;
    let dev = Device::sim(ByteSize::mib(256));
    let engine = RetryEngine::new();
    // learn: 1000 rows do not fit; the engine splits them and remembers the micro-batch
    let learned = engine_step(&engine, &dev, 1000);
    assert!(learned.is_ok());
    let r = oomguard_runtime::retry::last_report().unwrap();
    assert!(r.final_plan.num_chunks() > 1, "{r}");

    let e = find_max_batch(&dev, FinderOptions::default(), |rows| {
        engine_step(&engine, &dev, rows)
    })
    .unwrap_err();
    println!("{e}");
    assert!(matches!(e, FinderError::SplitInside { .. }), "{e}");
    assert!(e.to_string().contains("remembered"), "{e}");

    // nested: the outer engine's own report is a clean one-pass step
    let outer = RetryEngine::new();
    let e = find_max_batch(&dev, FinderOptions::default(), |rows| {
        outer
            .run(&dev, rows, |_plan| engine_step(&engine, &dev, rows), |_| ())
            .map(|r| r.value)
    })
    .unwrap_err();
    assert!(
        matches!(
            e,
            FinderError::SplitInside { .. } | FinderError::RetriesInside { .. }
        ),
        "{e}"
    );
}

/// Issue 26, point 7: a step whose memory the measured source cannot see (here it allocates on
/// another device) peaks at 0 bytes at every size. The old finder climbed to `max` and
/// returned it; now it is an error after two trials, saying why.
#[test]
fn a_step_the_source_cannot_see_is_an_error() {
    let measured = Device::sim(ByteSize::mib(256));
    let elsewhere = Device::sim(ByteSize::mib(256));
    let e = find_max_batch(&measured, FinderOptions::default(), |rows| {
        elsewhere.alloc::<u8>(rows << 10).map(drop)
    })
    .unwrap_err();
    println!("{e}");
    match &e {
        FinderError::Unmeasured { rows, .. } => assert_eq!(rows, &[1, 8]),
        other => panic!("{other}"),
    }
    // what to do, for each framework and for a simulated card
    for fix in [
        "oomguard_candle::memory_source",
        "LibtorchCudaSource",
        "Device::charge",
    ] {
        assert!(e.to_string().contains(fix), "{fix} in {e}");
    }
    assert!(e.to_string().contains("invisible"), "{e}");
    // `start == max`: one trial, still refused
    let opts = FinderOptions {
        start: 4,
        max: 4,
        ..FinderOptions::default()
    };
    let e = find_max_batch(&measured, opts, |_| Ok::<_, Error>(())).unwrap_err();
    assert!(matches!(e, FinderError::Unmeasured { .. }), "{e}");
}

/// A stand-in for the driver's pool as the H100 showed it (issue 26, point 7b): freed memory
/// stays cached until the pool is trimmed and serves only requests of its exact size; a step's
/// shapes vary from one step to the next (here every other step is 10% larger, as sequence
/// lengths vary). A single step from a trimmed pool says nothing of the next step.
mod fragmenting {
    use oomguard_runtime::retry::IsOom;
    use oomguard_runtime::source::{MemorySource, MemoryUsage, SourceBudget, SourceInfo};
    use std::sync::Mutex;

    #[derive(Debug, Default)]
    struct State {
        used: u64,
        used_peak: u64,
        reserved: u64,
        reserved_peak: u64,
        cached: Vec<u64>,
        steps: u64,
    }

    #[derive(Debug)]
    pub struct Pool {
        cap: u64,
        /// Steps before the sizes repeat (each size is cached apart).
        period: u64,
        /// Every step asks for a size never asked for before: nothing cached is ever reused.
        never_reuses: bool,
        s: Mutex<State>,
    }

    #[derive(Debug)]
    pub struct Oom;
    impl std::fmt::Display for Oom {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("out of memory")
        }
    }
    impl IsOom for Oom {
        fn is_oom(&self) -> bool {
            true
        }
    }

    impl Pool {
        pub fn new(cap: u64) -> Self {
            Self::with_period(cap, 2)
        }
        /// Step `k` asks for `(1 + (k % period) / 10)` MiB a row: a loop of steps holds
        /// `period` sizes at once, which a trial of fewer steps does not see.
        pub fn with_period(cap: u64, period: u64) -> Self {
            Self {
                cap,
                period,
                never_reuses: false,
                s: Mutex::new(State::default()),
            }
        }
        /// Step `k` asks for `rows` MiB plus `k` × 512 B: the held memory of a loop rises at
        /// every step and never settles (what candle's steps did on the driver's pool on an
        /// H100), until the cache is emptied.
        pub fn never_reusing(cap: u64) -> Self {
            Self {
                never_reuses: true,
                ..Self::with_period(cap, 2)
            }
        }
        fn alloc(&self, size: u64) -> Result<u64, Oom> {
            let mut s = self.s.lock().unwrap();
            if let Some(i) = s.cached.iter().position(|c| *c == size) {
                s.cached.swap_remove(i);
            } else if s.reserved + size <= self.cap {
                s.reserved += size;
                s.reserved_peak = s.reserved_peak.max(s.reserved);
            } else {
                return Err(Oom);
            }
            s.used += size;
            s.used_peak = s.used_peak.max(s.used);
            Ok(size)
        }
        fn free(&self, size: u64) {
            let mut s = self.s.lock().unwrap();
            s.used -= size;
            s.cached.push(size);
        }
        /// One training step of `rows` rows: 1 MiB of activations a row, 10% more at each step
        /// of the period (every other step by default).
        pub fn step(&self, rows: usize) -> Result<(), Oom> {
            let k = {
                let mut s = self.s.lock().unwrap();
                s.steps += 1;
                s.steps
            };
            let size = if self.never_reuses {
                ((rows as u64) << 20) + k * 512
            } else {
                ((rows as u64) << 20) * (10 + k % self.period) / 10
            };
            let a = self.alloc(size)?;
            self.free(a);
            Ok(())
        }
    }

    impl MemorySource for Pool {
        fn info(&self) -> SourceInfo {
            SourceInfo {
                device_name: "fragmenting pool".into(),
                ordinal: 0,
                total_bytes: self.cap,
                kind: "driver pool",
            }
        }
        fn usage(&self) -> oomguard_runtime::Result<MemoryUsage> {
            let s = self.s.lock().unwrap();
            Ok(MemoryUsage {
                used: s.used,
                used_peak: s.used_peak,
                reserved: s.reserved,
                reserved_peak: s.reserved_peak,
            })
        }
        fn available(&self) -> oomguard_runtime::Result<u64> {
            let s = self.s.lock().unwrap();
            Ok(self.cap - s.used)
        }
        fn reset_peak(&self) -> oomguard_runtime::Result<()> {
            let mut s = self.s.lock().unwrap();
            s.used_peak = s.used;
            s.reserved_peak = s.reserved;
            Ok(())
        }
        fn empty_cache(&self) -> oomguard_runtime::Result<()> {
            let mut s = self.s.lock().unwrap();
            let cached: u64 = s.cached.drain(..).sum();
            s.reserved -= cached;
            Ok(())
        }
        fn memory_summary(&self) -> String {
            format!("{:?}", self.s.lock().unwrap())
        }
        fn budget(&self, _limit: u64) -> oomguard_runtime::Result<SourceBudget> {
            Err(oomguard_runtime::Error::InvalidArgument(
                "no budgets".into(),
            ))
        }
        fn source_id(&self) -> usize {
            0xf4a6
        }
    }
}

/// Issue 26, point 7b: the batch found holds for a loop of steps on the source measured. On
/// the fragmenting pool the old finder (one step per trial, from a trimmed pool) returned
/// about 900 rows, and 10 of 20 consecutive steps at it ran out of memory; each trial now runs
/// two steps back to back, and 20 consecutive steps at the batch found all run.
#[test]
fn the_batch_found_holds_for_consecutive_steps() {
    let pool = fragmenting::Pool::new(1024 << 20);
    let r = find_max_batch(&pool, FinderOptions::default(), |rows| pool.step(rows)).unwrap();
    println!("{r}");
    assert!(r.safe_for().contains("32 consecutive steps"), "{r}");
    assert!(r.safe_for().contains("verification"), "{r}");
    assert_eq!((r.steps_per_trial, r.verified_steps()), (2, 32));
    assert!(r.step_runs() >= r.runs());
    let mut ooms = 0;
    for _ in 0..20 {
        if pool.step(r.max_batch).is_err() {
            ooms += 1;
        }
    }
    assert_eq!(
        ooms, 0,
        "consecutive steps at {}: {ooms} of 20 ran out of memory",
        r.max_batch
    );
    // and it is close to the largest batch two consecutive steps fit (1024 / 2.1 MiB)
    assert!(r.max_batch >= (0.95 * 487.0) as usize, "{r}");

    // one step per trial and no verification (the old behaviour, now an opt-out the report
    // names)
    let single = FinderOptions {
        steps_per_trial: 1,
        verify_steps: 0,
        ..FinderOptions::default()
    };
    oomguard_runtime::source::MemorySource::empty_cache(&pool).unwrap();
    let r1 = find_max_batch(&pool, single, |rows| pool.step(rows)).unwrap();
    assert!(r1.safe_for().contains("single steps"), "{r1}");
    let ooms1 = (0..20).filter(|_| pool.step(r1.max_batch).is_err()).count();
    println!(
        "steps_per_trial 1: {} rows, {ooms1} of 20 consecutive steps ran out of memory",
        r1.max_batch
    );
    assert!(ooms1 > 0);
}

/// Issue 26, point 7b, on a source that fragments over more steps than a trial runs: each step
/// of a period of 5 asks for another size, all cached apart, so a loop holds 6 MiB a row
/// (170 rows fit in 1 GiB) while a trial of two steps holds at most 2.5. Without verification
/// the finder returned about 440 rows and a loop at it ran out of memory; the verification
/// steps down to the largest batch that ran 32 consecutive steps, and 50 consecutive steps at it
/// all run.
#[test]
fn verification_steps_down_to_a_batch_that_holds_for_a_loop() {
    let loop_max = 170;
    let pool = fragmenting::Pool::with_period(1024 << 20, 5);
    let unverified = FinderOptions {
        verify_steps: 0,
        ..FinderOptions::default()
    };
    let r0 = find_max_batch(&pool, unverified, |rows| pool.step(rows)).unwrap();
    let ooms0 = (0..50).filter(|_| pool.step(r0.max_batch).is_err()).count();
    println!(
        "without verification: {} rows, {ooms0} of 50 OOM",
        r0.max_batch
    );
    assert!(r0.max_batch > loop_max && ooms0 > 0, "{r0}");
    assert_eq!(r0.verified_steps(), 0);

    oomguard_runtime::source::MemorySource::empty_cache(&pool).unwrap();
    let r = find_max_batch(&pool, FinderOptions::default(), |rows| pool.step(rows)).unwrap();
    println!("{r}");
    oomguard_runtime::source::MemorySource::empty_cache(&pool).unwrap();
    let ooms = (0..50).filter(|_| pool.step(r.max_batch).is_err()).count();
    assert_eq!(
        ooms, 0,
        "50 consecutive steps at {}: {ooms} OOM",
        r.max_batch
    );
    assert!(r.max_batch <= loop_max, "{r}");
    assert!(r.max_batch as f64 >= 0.95 * loop_max as f64, "{r}");
    let last = r.verification.last().unwrap();
    assert_eq!((last.rows, last.steps), (r.max_batch, r.verified_steps()));
    assert!(last.steps >= 32);
    assert!(last.peak_bytes.is_some());
    assert!(r.verification.len() <= oomguard_runtime::retry::MAX_VERIFICATIONS);
    assert!(
        r.verification[0].peak_bytes.is_none(),
        "the search's batch failed the loop"
    );
    let said = format!("{} consecutive steps", r.verified_steps());
    assert!(r.safe_for().contains(&said), "{}", r.safe_for());
}

/// A loop that settles only after more steps than the verification's 32 (a period of 40 sizes,
/// all cached apart: the loop holds 118 MiB a row, 8 rows in 1 GiB; 32 steps hold about 86):
/// held memory still rises in the second half of the 32 steps, so the verification goes on (up
/// to 64) and meets the out-of-memory that a loop meets after its 32nd step (9 rows failed at
/// step 39); the batch returned (8, the loop's maximum) runs 100 consecutive steps.
#[test]
fn a_verification_whose_held_memory_still_rises_runs_on() {
    let loop_max = 8;
    let pool = fragmenting::Pool::with_period(1024 << 20, 40);
    let r = find_max_batch(&pool, FinderOptions::default(), |rows| pool.step(rows)).unwrap();
    println!("{r}");
    assert!(
        r.verification
            .iter()
            .any(|t| t.peak_bytes.is_none() && t.steps > 32),
        "a verification failed after its 32nd step: {r}"
    );
    // the batch returned ran the extended loop (its held peak was still rising at 64 steps:
    // the report shows by how much)
    let last = r.verification.last().unwrap();
    assert!(last.steps > 32 && last.peak_bytes.is_some(), "{r}");
    assert!(r.to_string().contains("more in the second half"), "{r}");
    oomguard_runtime::source::MemorySource::empty_cache(&pool).unwrap();
    let ooms = (0..100).filter(|_| pool.step(r.max_batch).is_err()).count();
    assert_eq!(
        ooms, 0,
        "100 consecutive steps at {}: {ooms} OOM",
        r.max_batch
    );
    assert_eq!(r.max_batch, loop_max, "{r}");
}

/// When not even one row runs a loop, the finder says so instead of returning a batch.
#[test]
fn a_loop_that_fits_at_no_size_is_an_error() {
    // 1 row: a trial of two steps holds 2.1 MiB, 32 consecutive steps 32 + 0.1 × (1 + … + 31)
    // = 81.6 MiB.
    let pool = fragmenting::Pool::with_period(64 << 20, 40);
    let opts = FinderOptions {
        max: 64,
        ..FinderOptions::default()
    };
    let e = find_max_batch(&pool, opts, |rows| pool.step(rows)).unwrap_err();
    let msg = e.to_string();
    assert!(
        matches!(e, oomguard_runtime::retry::FinderError::LoopFails { .. }),
        "{msg}"
    );
    assert!(msg.contains("consecutive steps"), "{msg}");
}

/// Issue 26, point 7b, on a source whose held memory never settles (candle's GPT-2 on the
/// driver's pool on an H100, docs/GPU.md run 16: 64 verified steps at 15 rows, the held peak
/// still 3 GB higher over their second half, and a loop of 100 failed from step 90). Each step
/// here caches a block no later step reuses, so a loop of `n` steps at `r` rows holds `n × r`
/// MiB: 64 steps fit 15 rows in 1000 MiB, and any loop fails once it is long enough. The report
/// names the batch's own verification (not the larger sizes the bisection tried after it), says
/// the held memory was still rising and how often to empty the cache (every half of the
/// verified steps); a loop that does so runs 300 steps, one that does not fails.
#[test]
fn a_loop_that_never_settles_is_reported_with_how_often_to_empty_the_cache() {
    let pool = fragmenting::Pool::never_reusing(1000 << 20);
    let r = find_max_batch(&pool, FinderOptions::default(), |rows| pool.step(rows)).unwrap();
    println!("{r}");
    assert_eq!(r.max_batch, 15, "{r}");
    let v = r.verified().expect("verified");
    assert_eq!((v.rows, v.steps), (15, 64), "{r}");
    assert_eq!(r.verified_steps(), 64, "{r}");
    // the bisection tried a larger size after the batch passed, and that one failed: the
    // report's step count is the batch's own, not the last run's
    let last = r.verification.last().unwrap();
    assert!(last.peak_bytes.is_none() && last.rows > 15, "{r}");
    assert_ne!(last.steps, 64, "{r}");
    assert!(r.held_still_rising(), "{r}");
    assert_eq!(r.empty_cache_every(), Some(32));
    let said = r.safe_for();
    assert!(said.contains("64 consecutive steps"), "{said}");
    assert!(said.contains("still rising"), "{said}");
    assert!(
        said.contains("empty the cache at least every 32 steps"),
        "{said}"
    );

    use oomguard_runtime::source::MemorySource;
    pool.empty_cache().unwrap();
    let mut ooms = 0;
    for k in 0..300 {
        if k > 0 && k % 32 == 0 {
            pool.empty_cache().unwrap();
        }
        ooms += pool.step(r.max_batch).is_err() as u32;
    }
    assert_eq!(ooms, 0, "300 steps emptying the cache every 32: {ooms} OOM");
    pool.empty_cache().unwrap();
    let first_oom = (1..=300).find(|_| pool.step(r.max_batch).is_err());
    assert!(
        first_oom.is_some_and(|k| k > 64),
        "a loop that never empties the cache fails after the verified 64 steps: {first_oom:?}"
    );
}

/// A loop that settles within its verification is not flagged.
#[test]
fn a_settled_loop_needs_no_emptying() {
    let pool = fragmenting::Pool::new(1024 << 20);
    let r = find_max_batch(&pool, FinderOptions::default(), |rows| pool.step(rows)).unwrap();
    assert!(!r.held_still_rising(), "{r}");
    assert_eq!(r.empty_cache_every(), None);
    assert!(!r.safe_for().contains("still rising"), "{}", r.safe_for());
}

/// Memory that does not grow with the batch (burn on cubecl 0.10 on an H100, docs/GPU.md run
/// 19: 44 rows ran, 47–50 failed, 53–64 ran): the finder stays below the smallest size that
/// failed and its report says so, with that size.
#[test]
fn memory_that_does_not_grow_with_the_batch_is_searched_below_the_first_failure() {
    let dev = Device::new(
        SimDevice::address_only(ByteSize::mib(1024)),
        AllocatorConfig::default(),
    );
    // 12 MiB per row, but 47..=70 rows need more than the card (a packing gap), and so does
    // anything above 80; 71..=80 run.
    let step = |rows: usize| -> Result<(), Error> {
        let bytes = if (47..=70).contains(&rows) || rows > 80 {
            2048 * MIB
        } else {
            12 * MIB * rows as u64
        };
        dev.alloc::<u8>(bytes as usize).map(drop)
    };
    let r = find_max_batch(&dev, FinderOptions::default(), step).unwrap();
    let failed = r.smallest_failed().expect("a size in the gap failed");
    assert!((47..=70).contains(&failed), "{r}");
    assert!(r.max_batch < failed && r.max_batch >= 44, "{r}");
    assert!(
        r.to_string().contains(&format!(
            "below {failed} rows, the smallest that ran out of memory"
        )),
        "{r}"
    );
    // 75 rows (900 MiB) would run: the search never runs a size above one that failed.
    assert!(step(75).is_ok());
    assert!(
        r.trials
            .iter()
            .all(|t| t.rows < failed || t.peak_bytes.is_none()),
        "{r}"
    );
}

/// A search in which nothing failed names no failing size.
#[test]
fn a_search_where_nothing_failed_names_no_failing_size() {
    let dev = Device::sim(ByteSize::mib(256));
    let opts = FinderOptions {
        max: 4,
        ..FinderOptions::default()
    };
    let r = find_max_batch(&dev, opts, |rows| dev.alloc::<u8>(rows << 20).map(drop)).unwrap();
    assert_eq!(r.max_batch, 4, "{r}");
    assert_eq!(r.smallest_failed(), None);
    assert!(!r.to_string().contains("ran out of memory"), "{r}");
}

/// Issue 32, point 10: `available()` is what a budget leaves, not the card's free memory. On a
/// 64 MiB card holding 6 MiB it was 58 MiB under a 40 MiB `device_budget`, a 40 MiB
/// `MemorySource::budget` and a 40 MiB thread budget alike (only `set_memory_fraction` lowered
/// it); now each gives the budget's room.
#[test]
fn available_is_capped_by_budgets() {
    use oomguard_runtime::source::MemorySource;
    let dev = Device::sim(ByteSize::mib(64));
    let _held = dev.alloc::<u8>(6 << 20).unwrap();
    assert_eq!(dev.available().unwrap(), 58 * MIB);
    {
        let _b = dev.device_budget(ByteSize::mib(40));
        assert_eq!(dev.available().unwrap(), 40 * MIB);
        let _x = dev.alloc::<u8>(10 << 20).unwrap();
        assert_eq!(
            dev.available().unwrap(),
            30 * MIB,
            "the room left, not the limit"
        );
        // nested budgets: the tightest room wins
        let _t = dev.thread_budget(ByteSize::mib(4));
        assert_eq!(dev.available().unwrap(), 4 * MIB);
    }
    dev.empty_cache().unwrap(); // the 10 MiB block stayed cached
    {
        let _b = MemorySource::budget(&dev, 40 * MIB).unwrap();
        assert_eq!(dev.available().unwrap(), 40 * MIB);
    }
    {
        // a budget looser than the card: the card's free memory
        let _b = dev.device_budget(ByteSize::mib(100));
        assert_eq!(dev.available().unwrap(), 58 * MIB);
    }
    dev.set_memory_fraction(40.0 / 64.0).unwrap();
    assert_eq!(
        dev.available().unwrap(),
        34 * MIB,
        "the limit counts what is held"
    );
    dev.set_memory_fraction(1.0).unwrap();
    assert_eq!(dev.available().unwrap(), 58 * MIB, "every cap lifted");
}

/// Issue 32, point 10: the finder aims under the budget, so an affine step under a budget is
/// found in at most 4 trials (8 before: it jumped past the budget to the card's free memory).
#[test]
fn the_finder_aims_under_a_budget() {
    use oomguard_runtime::source::MemorySource;
    for device_wide in [true, false] {
        let dev = Device::sim(ByteSize::mib(64));
        let _held = dev.alloc::<u8>(6 << 20).unwrap();
        let _budget = if device_wide {
            Err(dev.device_budget(ByteSize::mib(40)))
        } else {
            Ok(MemorySource::budget(&dev, 40 * MIB).unwrap())
        };
        // 2 MiB fixed + 1 MiB a row: 38 rows fit in the budget, 56 on the card
        let step = |rows: usize| -> Result<(), Error> {
            let _ws = dev.alloc::<u8>(2 << 20)?;
            let _acts = dev.alloc::<u8>(rows << 20)?;
            Ok(())
        };
        let r = find_max_batch(&dev, FinderOptions::default(), step).unwrap();
        assert_eq!(r.budget_bytes, 40 * MIB, "{r}");
        assert!(r.runs() <= 4, "{} trials: {r}", r.runs());
        assert!(r.max_batch <= 38 && r.max_batch >= 36, "{r}");
        assert_eq!(
            r.smallest_failed(),
            None,
            "nothing jumped past the budget: {r}"
        );
    }
}

/// Issue 32, point 13: a fit whose fixed part is slightly negative (peaks growing a little
/// faster than the rows) printed "-2 B + 12784 B/row"; it prints 0 and says why.
#[test]
fn a_negative_fixed_cost_is_shown_as_zero_and_explained() {
    use oomguard_runtime::retry::{FinderReport, LinearFit};
    use oomguard_runtime::source::MemorySource;
    let dev = Device::sim(ByteSize::mib(64));
    let report = |fixed: f64| FinderReport {
        max_batch: 10,
        trials: Vec::new(),
        steps_per_trial: 2,
        verification: Vec::new(),
        source: dev.info(),
        fit: Some(LinearFit {
            fixed_bytes: fixed,
            per_row_bytes: 12784.0,
        }),
        budget_bytes: 64 * MIB,
        stopped_by_max_trials: false,
        batch_bytes_per_row: None,
        accumulation_bytes: None,
    };
    let shown = report(-2.0).to_string();
    assert!(!shown.contains("-2 B +"), "{shown}");
    assert!(shown.contains("fit: 0 B + 12784 B/row"), "{shown}");
    assert!(
        shown.contains("crosses 0 rows at -2 B, clamped to 0"),
        "{shown}"
    );
    let shown = report(4096.0).to_string();
    assert!(shown.contains("fit: 4096 B + 12784 B/row)"), "{shown}");
}

/// A training finder's report: 100 rows verified at a peak of 100 MiB (1 MiB a row), the
/// batch holding `held` bytes a row and a split step `accumulation` bytes more.
fn train_report(
    held: Option<u64>,
    accumulation: Option<u64>,
) -> oomguard_runtime::retry::FinderReport {
    use oomguard_runtime::source::MemorySource;
    let dev = Device::sim(ByteSize::mib(256));
    oomguard_runtime::retry::FinderReport {
        max_batch: 100,
        trials: Vec::new(),
        steps_per_trial: 2,
        verification: vec![oomguard_runtime::retry::Trial {
            rows: 100,
            peak_bytes: Some(100 * MIB),
            reserved_peak_bytes: 100 * MIB,
            steps: 2,
            held_rise_bytes: 0,
            elapsed: std::time::Duration::from_millis(1),
            oom_request: None,
        }],
        source: dev.info(),
        fit: None,
        budget_bytes: 128 * MIB,
        stopped_by_max_trials: false,
        batch_bytes_per_row: held,
        accumulation_bytes: accumulation,
    }
}

#[test]
fn a_split_step_leaves_room_for_the_accumulated_gradients() {
    let share = oomguard_runtime::retry::LARGER_BATCH_SHARE;
    let rows = |fits: f64| ((fits * share).floor() as usize).max(1);
    // a batch the finder ran whole: its own micro-batch, whatever a split would hold
    assert_eq!(
        train_report(Some(MIB / 4), Some(10 * MIB)).micro_batch_for(100),
        100
    );
    // the batch's tensors alone: 100 extra rows of 1/4 MiB over 3/4 MiB a row of the rest
    let held_only = train_report(Some(MIB / 4), None).micro_batch_for(200);
    assert_eq!(held_only, rows((100 - 34) as f64));
    // 12 MiB of gradients accumulated: 16 rows of the rest more
    let both = train_report(Some(MIB / 4), Some(12 * MIB)).micro_batch_for(200);
    assert_eq!(both, rows((100 - 34 - 16) as f64));
    // gradients alone (a batch held on the host): 12 MiB over 1 MiB a row
    let grads_only = train_report(None, Some(12 * MIB)).micro_batch_for(200);
    assert_eq!(grads_only, rows((100 - 12) as f64));
    // neither figure: the batch found
    assert_eq!(train_report(None, None).micro_batch_for(200), 100);
    // more to hold than the step's rows leave: one row, never zero
    assert_eq!(train_report(None, Some(1 << 40)).micro_batch_for(200), 1);
}

/// oomguard's growable segments serve any request from their free pages (they move), so the
/// finder keeps their cache between trials rather than unmapping every page for the next trial
/// to map again: the pages are mapped about once over the whole search. Fixed segments (whose
/// free segments serve only what fits them) are still emptied before each trial.
#[test]
fn a_growable_cache_is_kept_between_trials_a_fixed_one_emptied() {
    let run = |cfg: &str| {
        let dev = Device::new(
            SimDevice::new(ByteSize::mib(1024)),
            AllocatorConfig::parse(cfg).unwrap(),
        );
        let report = find_max_batch(&dev, FinderOptions::default(), |rows| {
            let _ws = dev.alloc::<u8>(16 << 20)?;
            let _acts = dev.alloc::<u8>(rows << 20)?;
            Ok::<_, Error>(())
        })
        .unwrap();
        (report, dev.stats())
    };
    let (report, s) = run("expandable_segments:True");
    let held = |t: &oomguard_runtime::retry::Trial| t.reserved_peak_bytes;
    let most = report
        .trials
        .iter()
        .chain(&report.verification)
        .map(held)
        .max()
        .unwrap();
    let runs = report.trials.len() + report.verification.len();
    assert!(runs >= 3, "{report}");
    assert!(
        s.mapped_bytes_total <= most + (64 << 20),
        "{} B mapped over {runs} trials, at most {most} B held in one: {report}",
        s.mapped_bytes_total
    );
    assert!(
        report.max_batch >= 990 && report.max_batch <= 1008,
        "{report}"
    );
    // fixed segments: a segment per trial's blocks, freed by the empty before the next trial
    let (report, s) = run("expandable_segments:False");
    let runs = (report.trials.len() + report.verification.len()) as u64;
    assert!(
        s.segment.all.freed >= runs,
        "{} segments freed over {runs} trials: {report}",
        s.segment.all.freed
    );
}

/// The verification loop runs like `train_step`'s loop, which marks each step (so that a loop
/// at the edge of memory settles on a step plan there as in training); the search's trials,
/// two steps at each new size, are left unmarked (a plan laid out for one size would meet the
/// next).
#[test]
fn the_verification_marks_each_step_and_the_trials_do_not() {
    let m = Model {
        capacity: ByteSize::gib(2),
        params: 64 * MIB,
        layers: 8,
        act_per_row: MIB,
        workspace: 32 * MIB,
    };
    let (dev, _weights) = m.device();
    let report = find_max_batch(&dev, FinderOptions::default(), |rows| m.step(&dev, rows)).unwrap();
    assert!(!report.verification.is_empty());
    let verified: u64 = report.verification.iter().map(|t| t.steps as u64).sum();
    let searched: u64 = report.trials.iter().map(|t| t.steps as u64).sum();
    assert!(verified >= 32 && searched > 0, "{verified} {searched}");
    assert_eq!(dev.stats().num_step_marks, verified);
}

/// Memory that the step's first run leaves allocated (a library's workspace made at the first
/// backward, state made lazily) is there in every later step: the fit must see it at every size.
/// Measured above what each trial started from, the first trial carried it and the second did
/// not, so the slope came out too low (or negative) and the first aim overshot the card.
#[test]
fn memory_the_first_trial_leaves_allocated_counts_at_every_size() {
    use std::cell::RefCell;
    let dev = Device::sim(ByteSize::gib(4));
    let kept = RefCell::new(None);
    let step = |rows: usize| -> Result<(), Error> {
        if kept.borrow().is_none() {
            *kept.borrow_mut() = Some(dev.alloc::<u8>(1 << 30)?);
        }
        let _acts = dev.alloc::<u8>(rows * (10 << 20))?;
        Ok(())
    };
    let r = find_max_batch(&dev, FinderOptions::default(), step).unwrap();
    // 3 GiB left after the kept GiB: 307 rows of 10 MiB
    let truth = (3usize << 30) / (10 << 20);
    assert!(r.max_batch <= truth, "{r}");
    assert!(r.max_batch as f64 >= 0.95 * truth as f64, "{r}");
    // the first aim lands below the card: no trial out of memory, and the 4 runs of a
    // linear model (`finds_95_percent_in_4_runs`)
    assert!(r.trials.iter().all(|t| t.peak_bytes.is_some()), "{r}");
    assert!(r.runs() <= 4, "{r}");
    let fit = r.fit.expect("a fit");
    assert!(
        (fit.per_row_bytes / (10u64 << 20) as f64 - 1.0).abs() < 0.01,
        "{fit:?}"
    );
}

/// A step that keeps 1 MiB at every call (pushed into a `Vec`) on a 128 MiB card: the finder
/// reported 10,827 rows "safe for a loop of steps", and a loop at that batch ran out of memory
/// after 2 more steps (found by a newcomer's crate: the held peak was at the card's size and
/// could not rise, and the bytes in use after each step were never compared). Now it says the
/// step keeps memory.
#[test]
fn a_step_that_keeps_memory_between_calls_is_named() {
    let dev = Device::sim(ByteSize::mib(128));
    let kept = std::cell::RefCell::new(Vec::new());
    let e = find_max_batch(&dev, FinderOptions::default(), |rows| {
        let activations = dev.alloc::<u8>(rows * 4096)?;
        kept.borrow_mut().push(dev.alloc::<u8>(1 << 20)?);
        drop(activations);
        Ok::<_, oomguard_runtime::Error>(())
    })
    .unwrap_err();
    match &e {
        FinderError::StepKeepsMemory { kept_bytes, .. } => {
            assert!(*kept_bytes >= 8 << 20, "{e}")
        }
        other => panic!("expected StepKeepsMemory, got {other}"),
    }
    assert!(e.to_string().contains("keeps memory between calls"), "{e}");

    // The same step freeing what it made is measured as before.
    kept.borrow_mut().clear();
    let found = find_max_batch(&dev, FinderOptions::default(), |rows| {
        let activations = dev.alloc::<u8>(rows * 4096)?;
        drop(activations);
        Ok::<_, oomguard_runtime::Error>(())
    })
    .unwrap();
    assert!(found.max_batch > 20_000, "{found}");
}
