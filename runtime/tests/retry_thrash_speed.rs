//! Thrash detection counts every kind of allocator churn (pages moved, synchronisations,
//! retries), and a plan that churns without allocator retries is compared by time per row with
//! the next smaller plan: the faster is kept, and the decision is in the report. Times come
//! from a manual clock that the steps advance: nothing here is timed.

use std::sync::Arc;
use std::time::Duration;

use oomguard_runtime::backend::sim::SimDevice;
use oomguard_runtime::retry::{
    BatchPlan, ManualClock, Retried, RetryEngine, RetryReport, SiteMemo, SpeedDecision,
};
use oomguard_runtime::source::Churn;
use oomguard_runtime::{AllocatorConfig, ByteSize, Device, Error};

const MIB: usize = 1 << 20;
const ROWS: usize = 16;
/// The weights, allocated once.
const WEIGHTS: usize = 64 * MIB;
/// Just above the whole batch's live peak (weights + 7 MiB per row = 176 MiB): the whole batch
/// runs, but its layout needs 240 MiB of pages, so it moves pages in every step; two chunks of
/// 8 rows need 152 MiB and settle.
const LIMIT: u64 = 208 << 20;

/// A device with growable segments and a memory limit of `limit`, its weights allocated.
fn device(limit: Option<u64>) -> (Device, oomguard_runtime::DeviceBuffer<u8>) {
    let dev = Device::new(
        SimDevice::new(ByteSize::gib(4)),
        // (without step plans: with them, the marked steps of the whole batch stop moving
        // pages, which tests/step_plan.rs shows; here the engine's choice is under test)
        AllocatorConfig::parse("expandable_segments:True,step_plans:False").unwrap(),
    );
    dev.allocator().set_memory_limit(limit);
    let weights = dev.alloc::<u8>(WEIGHTS).unwrap();
    (dev, weights)
}

/// One micro-batch of `rows` rows: a 4 MiB/row activation and a 1 MiB/row one after it, the
/// first freed before a 6 MiB/row buffer that its hole cannot hold (so without room the
/// allocator moves the hole's pages behind the second).
fn chunk(dev: &Device, rows: usize) -> Result<usize, Error> {
    let a = dev.alloc::<u8>(4 * MIB * rows)?;
    let b = dev.alloc::<u8>(MIB * rows)?;
    drop(a);
    let c = dev.alloc::<u8>(6 * MIB * rows)?;
    drop(b);
    drop(c);
    Ok(rows)
}

/// The step's time on the manual clock: `per_row(plan)` for each row, plus 40 ms for every page
/// unmap the step made (what moving pages costs on a GPU: a synchronisation, an unmap, a map).
fn timed_attempt(
    dev: &Device,
    clock: &ManualClock,
    plan: &BatchPlan,
    per_row: impl Fn(&BatchPlan) -> Duration,
) -> Result<usize, Error> {
    let unmaps = dev.stats().num_unmap;
    let mut rows = 0;
    for c in plan.chunks() {
        rows += chunk(dev, c.len())?;
    }
    let moved = dev.stats().num_unmap - unmaps;
    clock.advance(per_row(plan) * rows as u32 + Duration::from_millis(40) * moved as u32);
    Ok(rows)
}

fn engine(clock: &Arc<ManualClock>) -> RetryEngine {
    RetryEngine::new().with_clock(clock.clone())
}

/// Runs `steps` steps at one call site; returns their reports.
fn run_steps(
    engine: &RetryEngine,
    dev: &Device,
    clock: &ManualClock,
    steps: usize,
    per_row: impl Fn(&BatchPlan) -> Duration + Copy,
) -> Vec<RetryReport> {
    (0..steps)
        .map(|_| {
            let r: Retried<usize> = engine
                .run(
                    dev,
                    ROWS,
                    |plan| timed_attempt(dev, clock, plan, per_row),
                    |rows| rows,
                )
                .expect("the step completes");
            assert_eq!(r.value, ROWS);
            assert_eq!(
                r.report.retries(),
                0,
                "never an out-of-memory: {}",
                r.report
            );
            r.report
        })
        .collect()
}

/// 2 ms a row in one pass, 6 ms a row split (a model whose small micro-batches waste the GPU).
fn halves_three_times_slower(p: &BatchPlan) -> Duration {
    if p.num_chunks() == 1 {
        Duration::from_millis(2)
    } else {
        Duration::from_millis(6)
    }
}

fn whole() -> BatchPlan {
    BatchPlan::whole(ROWS).unwrap()
}

fn halves() -> BatchPlan {
    BatchPlan::new(ROWS, 2).unwrap()
}

/// The whole batch moves pages in every step (no allocator retry: it never runs out of
/// memory); two chunks of 8 rows settle. After the thrash window the engine tries the two
/// chunks, measures them faster per row (the moves cost time), keeps them, and says so.
#[test]
fn a_plan_that_moves_pages_in_every_step_gives_way_to_a_faster_smaller_one() {
    let (dev, _w) = device(Some(LIMIT));
    let clock = Arc::new(ManualClock::new());
    let engine = engine(&clock);
    let per_row = |_: &BatchPlan| Duration::from_millis(2);
    let reports = run_steps(&engine, &dev, &clock, 12, per_row);

    // steps 1-3: the whole batch, moving pages each time; the third trips the window
    for (i, r) in reports[..3].iter().enumerate() {
        assert_eq!(r.final_plan, whole(), "step {i}: {r}");
        assert!(r.churn.unmaps > 0 && r.churn.syncs > 0, "step {i}: {r}");
        assert_eq!(r.churn.alloc_retries, 0, "step {i}: {r}");
    }
    assert_eq!(reports[2].thrash_moved_to, Some(halves()), "{}", reports[2]);
    // 2 ms per row, plus 40 ms of moves over 16 rows
    let expected_whole = Duration::from_micros(4500);
    assert_eq!(
        reports[2].speed,
        Some(SpeedDecision::Trying {
            thrashing: whole(),
            smaller: halves(),
            thrashing_per_row: expected_whole,
            steps: 3,
        }),
        "{}",
        reports[2]
    );
    let text = reports[2].to_string();
    assert!(
        text.contains("trying batch 16 in 2 micro-batches of ≤8"),
        "{text}"
    );

    // steps 4-7: the halves (one to settle, three measured); the seventh decides
    for (i, r) in reports[3..7].iter().enumerate() {
        assert_eq!(r.final_plan, halves(), "step {}: {r}", i + 3);
        assert_eq!(r.thrash_moved_to, None, "step {}: {r}", i + 3);
    }
    for r in &reports[4..7] {
        assert_eq!(r.churn, Churn::default(), "settled: {r}");
    }
    let chose = SpeedDecision::Chose {
        thrashing: whole(),
        smaller: halves(),
        thrashing_per_row: expected_whole,
        smaller_per_row: Duration::from_millis(2),
        kept: halves(),
    };
    assert_eq!(reports[6].speed, Some(chose), "{}", reports[6]);
    assert_eq!(chose.moves_to(), None, "the halves run already");
    let text = reports[6].to_string();
    assert!(
        text.contains("kept batch 16 in 2 micro-batches of ≤8 (faster per row)"),
        "{text}"
    );

    // it stays there, remembered, moving nothing
    for r in &reports[7..] {
        assert_eq!(r.final_plan, halves(), "{r}");
        assert!(r.from_memory, "{r}");
        assert_eq!(r.speed, None, "{r}");
        assert_eq!(r.churn, Churn::default(), "{r}");
    }
}

/// The same device, but the halves are slower per row than the whole batch with its moves (a
/// model whose small micro-batches waste the GPU): the engine tries them, moves back to the
/// whole batch, and keeps it through later thrash windows instead of trying again at once.
#[test]
fn a_smaller_plan_slower_per_row_is_not_kept() {
    let (dev, _w) = device(Some(LIMIT));
    let clock = Arc::new(ManualClock::new());
    let engine = engine(&clock);
    let per_row = halves_three_times_slower;
    let reports = run_steps(&engine, &dev, &clock, 16, per_row);
    assert_eq!(reports[2].thrash_moved_to, Some(halves()), "{}", reports[2]);
    for r in &reports[3..7] {
        assert_eq!(r.final_plan, halves(), "{r}");
    }
    let chose = SpeedDecision::Chose {
        thrashing: whole(),
        smaller: halves(),
        thrashing_per_row: Duration::from_micros(4500),
        smaller_per_row: Duration::from_millis(6),
        kept: whole(),
    };
    assert_eq!(reports[6].speed, Some(chose), "{}", reports[6]);
    assert_eq!(chose.moves_to(), Some(whole()));
    let text = reports[6].to_string();
    assert!(
        text.contains("moved back to batch 16 in one pass"),
        "{text}"
    );

    // back to the whole batch, which keeps moving pages; its next windows keep it
    for (i, r) in reports[7..].iter().enumerate() {
        assert_eq!(r.final_plan, whole(), "step {}: {r}", i + 7);
        assert_eq!(r.thrash_moved_to, None, "step {}: {r}", i + 7);
        assert!(r.churn.unmaps > 0, "step {}: {r}", i + 7);
    }
    let stayed: Vec<_> = reports[7..].iter().filter_map(|r| r.speed).collect();
    assert_eq!(stayed.len(), 3, "one decision per window of 3: {stayed:?}");
    for (n, d) in stayed.iter().enumerate() {
        assert_eq!(
            *d,
            SpeedDecision::Stayed {
                thrashing: whole(),
                smaller: halves(),
                thrashing_per_row: Duration::from_micros(4500),
                smaller_per_row: Duration::from_millis(6),
                windows_left: 7 - n as u32,
            }
        );
        assert_eq!(d.moves_to(), None);
    }
    assert!(stayed[0]
        .to_string()
        .contains("kept, as batch 16 in 2 micro-batches of ≤8 took 6.000ms per row"));
}

/// The same slower halves, with one batch of 15 rows during their trial (an epoch's last
/// batch): the trial goes on through it (its limits are the trial's; per row, 15 rows compare
/// with 16) and the engine still moves back to the whole batch. Before, the trial was dropped
/// at the 15-row plan and the slower halves stayed for good, with no decision reported.
#[test]
fn a_smaller_batch_during_a_trial_does_not_keep_the_slower_plan() {
    let (dev, _w) = device(Some(LIMIT));
    let clock = Arc::new(ManualClock::new());
    let engine = engine(&clock);
    let per_row = halves_three_times_slower;
    let mut reports = Vec::new();
    for step in 0..12 {
        let batch = if step == 4 { ROWS - 1 } else { ROWS };
        let r: Retried<usize> = engine
            .run(
                &dev,
                batch,
                |plan| timed_attempt(&dev, &clock, plan, per_row),
                |rows| rows,
            )
            .expect("the step completes");
        assert_eq!(r.value, batch, "every row ran");
        reports.push(r.report);
    }
    assert_eq!(reports[2].thrash_moved_to, Some(halves()), "{}", reports[2]);
    assert_eq!(reports[4].final_plan.num_chunks(), 2, "{}", reports[4]);
    let chose = reports
        .iter()
        .position(|r| matches!(r.speed, Some(SpeedDecision::Chose { .. })))
        .unwrap_or_else(|| {
            panic!(
                "no decision: {:?}",
                reports.iter().map(|r| r.final_plan).collect::<Vec<_>>()
            )
        });
    assert_eq!(
        reports[chose].speed.and_then(|d| d.moves_to()),
        Some(whole()),
        "{}",
        reports[chose]
    );
    for r in &reports[chose + 1..] {
        assert_eq!(r.final_plan, whole(), "{r}");
    }
}

/// With room (no memory limit), the whole batch maps its pages in its first step and then
/// moves nothing: mapping is not churn, the plan is kept.
#[test]
fn a_plan_that_moves_no_pages_is_kept() {
    let (dev, _w) = device(None);
    let clock = Arc::new(ManualClock::new());
    let engine = engine(&clock);
    let maps = dev.stats().num_map;
    let reports = run_steps(&engine, &dev, &clock, 10, |_| Duration::from_millis(2));
    assert!(dev.stats().num_map > maps, "the first step mapped pages");
    for r in &reports {
        assert_eq!(r.final_plan, whole(), "{r}");
        assert_eq!(r.thrash_moved_to, None, "{r}");
        assert_eq!(r.speed, None, "{r}");
        assert_eq!(r.churn, Churn::default(), "{r}");
    }
    assert_eq!(dev.stats().num_unmap, 0);
}

/// A step that holds no device (`#[oom_retry]`'s route, with its first attempt started without
/// a loop) watches the pages moved on the device its thread allocates on: it moves too.
#[test]
fn a_step_without_a_device_watches_the_pages_its_device_moves() {
    static MEMO: SiteMemo = SiteMemo::new();
    let (dev, _w) = device(Some(LIMIT));
    let clock = Arc::new(ManualClock::new());
    let engine = engine(&clock);
    let mut moved = None;
    for i in 0..4 {
        let mut lp = engine
            .begin_any_memo::<Error>("thrash_speed::no_device", whole(), &MEMO)
            .unwrap();
        let report = loop {
            let plan = lp.plan();
            let attempt = timed_attempt(&dev, &clock, &plan, |_| Duration::from_millis(2));
            match lp.next(attempt) {
                std::ops::ControlFlow::Break(done) => break done.unwrap().1,
                std::ops::ControlFlow::Continue(()) => {}
            }
        };
        if i < 3 {
            assert_eq!(report.final_plan, whole(), "{report}");
            assert!(report.churn.unmaps > 0, "{report}");
        }
        if let Some(p) = report.thrash_moved_to {
            moved = Some((i, p));
            break;
        }
    }
    assert_eq!(moved, Some((2, halves())), "after the window of 3 steps");
}
