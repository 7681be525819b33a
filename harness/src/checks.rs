//! Scenarios every framework crate's tests run against its own `train_step` and finder, written
//! once: the crate builds the framework's model, batch and loop, and passes them in as closures
//! and results; the check asserts what oomguard promises of any framework.

use oomguard_runtime::retry::{FinderReport, RetryEngine, RetryError, StopReason};
use oomguard_runtime::{ByteSize, Device, DeviceBuffer, Error};

/// A `train_step` whose chunk loss keeps each chunk's memory across attempts (a leak behind the
/// retries) failed with `e` (any framework's `TrainStepError`, whose source is the
/// [`RetryError<E>`] of its attempts): the engine stopped early for the growth of held memory (not
/// by halving down to one row), and the error's text names the growth and the leak.
pub fn assert_stopped_for_a_leak<E>(e: &(dyn std::error::Error + 'static))
where
    RetryError<E>: std::error::Error + 'static,
{
    let retry = e.source().and_then(|s| s.downcast_ref::<RetryError<E>>());
    let Some(RetryError::GaveUp { report, .. }) = retry else {
        panic!("not a retry that gave up: {e}");
    };
    assert!(
        matches!(report.stopped, Some(StopReason::HeldGrew { .. })),
        "not stopped for the growth: {report}"
    );
    assert!(report.final_plan.micro_batch() > 1, "{report}");
    let text = e.to_string();
    assert!(text.contains("allocated grew"), "{text}");
    assert!(
        text.contains("keeps memory across attempts (a leak)"),
        "{text}"
    );
}

/// The finder's seeding scenario, on a simulated 256 MiB card where a loop's batch holds 1 MiB
/// per row for the whole step and a chunk's activations take 2 MiB per row (about 85 rows fit
/// `train_step`'s attempt):
/// - `found_old`, the finder over a step written by hand that holds no batch, finds more than
///   100 rows, and a loop seeded from it retries;
/// - `found`, `find_max_batch_train` over the loop's own attempt, finds 76 to 85 rows, knows
///   the batch's 1 MiB per row and `accumulation_bytes` of summed gradients, and a loop seeded
///   from it never retries, at its batch or at twice it (starting from smaller micro-batches);
/// - the same seed without the batch's bytes (what the engine did before) retries at twice the
///   batch.
///
/// `seeded_step(engine, rows)` runs one `train_step` of a fresh batch of `rows` rows on `engine`
/// and returns the rows it trained and its retries; each loop is 20 of them, from an engine
/// seeded with the report ([`RetryEngine::start_from_finder`]).
pub fn check_train_finder_seeding(
    found_old: &FinderReport,
    found: &FinderReport,
    accumulation_bytes: u64,
    mut seeded_step: impl FnMut(&RetryEngine, usize) -> (usize, usize),
) {
    let mut seeded_loop_retries = |seed: &FinderReport, rows: usize| -> usize {
        let engine = RetryEngine::new().start_from_finder(seed);
        (0..20)
            .map(|_| {
                let (done, retries) = seeded_step(&engine, rows);
                assert_eq!(done, rows, "the step trained another number of rows");
                retries
            })
            .sum()
    };
    assert!(found_old.max_batch > 100, "{found_old}");
    let old_retries = seeded_loop_retries(found_old, found_old.max_batch);
    assert!(
        old_retries > 0,
        "the old route's seed fits train_step's attempt?"
    );

    assert!((76..=85).contains(&found.max_batch), "{found}");
    let retries = seeded_loop_retries(found, found.max_batch);
    assert_eq!(retries, 0, "20 seeded steps at {} rows", found.max_batch);

    // Twice the batch from the same report: the whole batch's tensors stay held while each
    // micro-batch runs, so the micro-batches start smaller.
    assert_eq!(found.batch_bytes_per_row, Some(1 << 20), "{found}");
    assert_eq!(
        found.accumulation_bytes,
        Some(accumulation_bytes),
        "{found}"
    );
    let twice = 2 * found.max_batch;
    let start = found.micro_batch_for(twice);
    assert!(start < found.max_batch, "{start}");
    let retries = seeded_loop_retries(found, twice);
    assert_eq!(
        retries, 0,
        "20 seeded steps at {twice} rows from micro-batches of {start}"
    );
    let unaware = FinderReport {
        batch_bytes_per_row: None,
        ..found.clone()
    };
    let retries = seeded_loop_retries(&unaware, twice);
    assert!(
        retries > 0,
        "micro-batches of {} rows fit {twice} rows' tensors?",
        found.max_batch
    );
}

/// One search of [`check_finder_through_oom_panics`]: what the framework's step holds on the
/// simulated card, and past how many rows it raises the framework's own out-of-memory panic.
#[derive(Clone, Copy, Debug)]
pub struct FinderCase {
    workspace: bool,
    oom_panic_above: Option<usize>,
}

impl FinderCase {
    /// The memory a step of `rows` rows holds on `card` while it runs: 1 MiB of activations per
    /// row, and 16 MiB of workspace in the first search.
    pub fn hold(&self, card: &Device, rows: usize) -> Result<Vec<DeviceBuffer<u8>>, Error> {
        let mut held = Vec::with_capacity(2);
        if self.workspace {
            held.push(card.alloc::<u8>(16 << 20)?);
        }
        held.push(card.alloc::<u8>(rows << 20)?);
        Ok(held)
    }

    /// Whether a step of `rows` rows must raise the framework's out-of-memory panic (as its
    /// device would past some rows) instead of running.
    pub fn panics_at(&self, rows: usize) -> bool {
        self.oom_panic_above.is_some_and(|n| rows > n)
    }
}

/// A framework's `find_max_batch` on a simulated 256 MiB card: `find(card, case)` runs it with a
/// step of `rows` rows that holds [`FinderCase::hold`] while it runs the framework's step, and
/// raises the framework's own out-of-memory panic where [`FinderCase::panics_at`] says so.
/// - With 16 MiB of workspace and 1 MiB a row, 228 to 240 rows fit, found in at most 4 runs;
/// - with an out-of-memory panic past 100 rows, 95 to 100: the panic is a failed run of the
///   search, not a crash. (One test runs both: the count of out-of-memory panics is
///   process-wide, so the two searches must not run at once.)
pub fn check_finder_through_oom_panics(mut find: impl FnMut(&Device, FinderCase) -> FinderReport) {
    let card = Device::sim(ByteSize::mib(256));
    let report = find(
        &card,
        FinderCase {
            workspace: true,
            oom_panic_above: None,
        },
    );
    assert!((228..=240).contains(&report.max_batch), "{report}");
    assert!(report.runs() <= 4, "{report}");
    let report = find(
        &card,
        FinderCase {
            workspace: false,
            oom_panic_above: Some(100),
        },
    );
    assert!((95..=100).contains(&report.max_batch), "{report}");
}
