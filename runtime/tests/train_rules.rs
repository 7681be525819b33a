//! The framework-free rules of a training step (`oomguard_runtime::train`): an update's failure
//! is never retryable by any route, the chunks' losses must cover the batch row by row, and a
//! policy that would drop rows under any pressure is refused before anything runs.

use std::error::Error as StdError;

use oomguard_runtime::retry::{
    chain_is_oom, BatchPlan, FnPolicy, IsOom, Pressure, RetryContext, RetryEngine, RetryError,
    RetryReport,
};
use oomguard_runtime::train::{drops_rows, keep_rows, LossSum, TrainStepError};
use oomguard_runtime::{ByteSize, Device, Error};

fn a_report() -> RetryReport {
    let dev = Device::sim(ByteSize::mib(8));
    RetryEngine::new()
        .run(&dev, 1, |_| Ok::<_, Error>(()), |()| ())
        .unwrap()
        .report
}

fn an_oom() -> Error {
    Device::sim(ByteSize::mib(1))
        .alloc::<u8>(2 << 20)
        .unwrap_err()
}

/// Every way to ask whether an error is a retryable out-of-memory, on `e` and on `e` boxed or
/// wrapped: none may say yes.
fn no_route_says_oom(e: TrainStepError<Error>) {
    let text = e.to_string();
    assert!(!e.is_oom(), "is_oom: {text}");
    assert!(!chain_is_oom(&e), "chain_is_oom: {text}");
    let boxed: Box<dyn StdError + Send + Sync> = Box::new(e);
    assert!(!boxed.is_oom(), "Box<dyn Error + Send + Sync>: {text}");
    assert!(!boxed.is_budget_exceeded(), "budget: {text}");
    assert_eq!(boxed.oom_request(), None, "oom_request: {text}");
    let io = std::io::Error::other(boxed);
    assert!(!io.is_oom(), "io::Error: {text}");
    let plain: Box<dyn StdError> = Box::new(io);
    assert!(!plain.is_oom(), "Box<dyn Error>: {text}");
}

/// An optimizer update that ran out of memory may have been applied in part: no route may call
/// it a retryable out-of-memory. Before: `is_oom` said no, but `chain_is_oom` and a boxed
/// `dyn Error` walked `source()` down to the optimizer's OOM and said yes.
#[test]
fn an_update_that_ran_out_of_memory_is_not_an_oom_by_any_route() {
    let update = || TrainStepError::Update {
        error: an_oom(),
        report: Box::new(a_report()),
    };
    no_route_says_oom(update());
    let e = update();
    assert!(!e.is_budget_exceeded());
    // the mark says why; the optimizer's own error is still in the variant and the message
    let source = e.source().expect("a source").to_string();
    assert!(source.contains("update was already applied"), "{source}");
    assert!(e.to_string().contains("Tried to allocate"), "{e}");
    let TrainStepError::Update { error, .. } = &e else {
        unreachable!()
    };
    assert!(error.is_oom());
    // the micro-batches' out-of-memory stays retryable
    let gave_up = TrainStepError::Retry(RetryError::Step {
        error: an_oom(),
        report: Box::new(a_report()),
    });
    assert!(gave_up.is_oom(), "{gave_up}");
}

/// Parameters that could not be made ready before the first attempt (oomguard-burn's lazy
/// parameters) are not the batch's: no route calls the error a retryable out-of-memory, and its
/// message keeps the framework's error and says that nothing ran.
#[test]
fn parameters_that_ran_out_of_memory_are_not_an_oom_by_any_route() {
    no_route_says_oom(TrainStepError::Parameters(an_oom()));
    let e = TrainStepError::Parameters(an_oom());
    let text = e.to_string();
    assert!(
        text.contains("could not be initialised before the step")
            && text.contains("nothing ran")
            && text.contains("Tried to allocate"),
        "{text}"
    );
    assert!(e.source().is_none());
    let TrainStepError::Parameters(error) = &e else {
        unreachable!()
    };
    assert!(error.is_oom());
}

#[cfg(feature = "anyhow")]
#[test]
fn an_update_that_ran_out_of_memory_is_not_an_oom_through_anyhow() {
    let e = anyhow::Error::from(TrainStepError::Update {
        error: an_oom(),
        report: Box::new(a_report()),
    });
    assert!(!e.is_oom() && !e.is_budget_exceeded(), "{e:#}");
    assert_eq!(e.oom_request(), None, "{e:#}");
}

fn plan(batch: usize, micro: usize) -> BatchPlan {
    BatchPlan::with_micro_batch(batch, micro).unwrap()
}

/// The same chunk added twice covers as many rows as the batch, but rows 4..8 never ran.
/// Before: `covers_batch` counted rows only and passed.
#[test]
fn a_chunk_added_twice_does_not_cover_the_batch() {
    let p = plan(8, 4);
    let first = p.chunk(0).unwrap();
    let mut sum = LossSum::new();
    sum.admit(&first).unwrap();
    sum.add_mean(&first, 1.0);
    sum.add_mean(&first, 1.0);
    let e = sum.covers_batch().unwrap_err();
    assert!(
        e.contains("rows 0..4") && e.contains("more than once"),
        "{e}"
    );
    assert!(e.contains("4..8") && e.contains("never"), "{e}");
    // and admitting it again, before its backward, is refused at once
    let e = sum.admit(&first).unwrap_err();
    assert!(e.contains("0..4"), "{e}");
}

/// Chunks of different plans of one batch whose rows add up to the batch but overlap (0..3
/// twice) and leave a gap (7..10). Before: passed.
#[test]
fn overlapping_chunks_of_two_plans_do_not_cover_the_batch() {
    let (b, c) = (plan(10, 4), plan(10, 3)); // 0..4 4..7 7..10 / 0..3 3..6 6..8 8..10
    let mut sum = LossSum::new();
    for chunk in [
        b.chunk(0).unwrap(),
        b.chunk(1).unwrap(),
        c.chunk(0).unwrap(),
    ] {
        if sum.admit(&chunk).is_ok() {
            sum.add_mean(&chunk, 1.0);
        }
    }
    assert_eq!(sum.rows(), 7, "the overlapping chunk is refused by admit");
    let mut sum = LossSum::new();
    for chunk in [
        b.chunk(0).unwrap(),
        b.chunk(1).unwrap(),
        c.chunk(0).unwrap(),
    ] {
        sum.add_weighted(&chunk, 0.1);
    }
    assert_eq!(sum.rows(), 10);
    let e = sum.covers_batch().unwrap_err();
    assert!(e.contains("rows 0..3") && e.contains("7..10"), "{e}");
}

/// Every chunk of one plan, in any order, covers the batch.
#[test]
fn every_chunk_of_a_plan_in_any_order_covers_the_batch() {
    let p = plan(10, 3);
    let mut chunks: Vec<_> = p.chunks().collect();
    chunks.reverse();
    let mut sum = LossSum::new();
    for c in &chunks {
        sum.admit(c).unwrap();
        sum.add_mean(c, 2.0);
    }
    sum.covers_batch().unwrap();
    assert!((sum.loss() - 2.0).abs() < 1e-12);
    let mut part = LossSum::new();
    part.add_mean(&chunks[0], 1.0);
    let e = part.covers_batch().unwrap_err();
    assert!(e.contains("0..8") && e.contains("never"), "{e}");
}

/// A policy that drops rows only when one request is larger than the card, or only when the
/// allocator thrashes, would still drop rows in a training step. Before: `drops_rows` tried the
/// out-of-memory and budget pressures only, and such a policy was accepted.
#[test]
fn a_policy_that_drops_rows_under_any_pressure_is_refused() {
    for only in [Pressure::TooLarge, Pressure::Thrash] {
        let policy = FnPolicy(move |ctx: &RetryContext| {
            if ctx.pressure != only {
                return None;
            }
            BatchPlan::whole(ctx.plan.batch() / 2).ok()
        });
        let proposed = drops_rows(&policy, 100);
        assert_eq!(proposed.map(|p| p.batch()), Some(50), "{only:?}");
        let engine = RetryEngine::new().with_policy(policy);
        let refused = keep_rows(&engine, 100, "hint").unwrap_err();
        assert_eq!(refused.proposed.batch(), 50, "{only:?}");
    }
}
