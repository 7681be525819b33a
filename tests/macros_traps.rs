//! Traps of `#[oom_retry]` that changed what the user's code computes without saying so, or hid
//! what happened (issue 15): each test fails on the behaviour before the fix.

use std::cell::Cell;

use oomguard::backend::{BackendError, BackendErrorKind};
use oomguard::retry::{last_report, BatchPlan, FnPolicy, PlanError};
use oomguard::{memory_budget, no_grad, oom_retry, ByteSize, Device, DeviceBuffer, Error};

const MIB: usize = 1 << 20;

/// A 256 MiB card with all but `free_mib` MiB held by a buffer that outlives the steps. The
/// requests below fit the card but not what is free, so an out-of-memory gets the retry with
/// the same plan after emptying the cache (a request larger than the whole card skips it,
/// issue 32.12).
fn card_with_free(free_mib: usize) -> (Device, DeviceBuffer<u8>) {
    let dev = Device::sim(ByteSize::mib(256));
    let held = dev.alloc::<u8>((256 - free_mib) * MIB).unwrap();
    (dev, held)
}

/// A step's body: 1 MiB per row, one allocation per micro-batch; the rows processed.
fn rows_of(dev: &Device, plan: &BatchPlan) -> Result<usize, Error> {
    let mut n = 0;
    for c in plan.chunks() {
        n += dev.alloc::<u8>(c.len() * MIB)?.len() / MIB;
    }
    Ok(n)
}

/// A "training" step over `rows` rows of 1 MiB: grad mode is on.
#[oom_retry(batch = rows, remember = false)]
fn train_rows(dev: &Device, rows: usize, attempts: &Cell<u32>) -> Result<usize, Error> {
    attempts.set(attempts.get() + 1);
    Ok(dev.alloc::<u8>(rows * MIB)?.len() / MIB)
}

/// The same as an evaluation step.
#[oom_retry(batch = rows, remember = false)]
#[no_grad]
fn eval_rows(dev: &Device, rows: usize, attempts: &Cell<u32>) -> Result<usize, Error> {
    attempts.set(attempts.get() + 1);
    Ok(dev.alloc::<u8>(rows * MIB)?.len() / MIB)
}

#[test]
fn batch_does_not_shrink_a_training_step() {
    let (dev, _held) = card_with_free(64);
    let attempts = Cell::new(0);
    let e = train_rows(&dev, 200, &attempts).unwrap_err();
    assert!(e.is_oom(), "{e}");
    assert_eq!(
        attempts.get(),
        2,
        "the call, then once after emptying the cache"
    );
    let report = last_report().expect("a failed step has a report");
    assert_eq!(report.final_plan.batch(), 200, "no row dropped");
    // What to change is in the returned error, not only on standard error.
    let text = e.to_string();
    assert!(
        text.contains("hint: `batch =` does not shrink a step with gradients on"),
        "{text}"
    );
    assert!(report.hint.is_some(), "{report}");
    // Under the caller's no_grad it evaluates, and may shrink: the caller sees the rows.
    let _g = oomguard::no_grad();
    attempts.set(0);
    assert_eq!(train_rows(&dev, 200, &attempts).unwrap(), 50);
    let report = last_report().unwrap();
    assert_eq!(
        (report.requested_batch, report.final_plan.batch()),
        (200, 50)
    );
}

#[test]
fn batch_shrinks_an_evaluation_step_and_the_caller_learns_the_rows() {
    let dev = Device::sim(ByteSize::mib(64));
    let attempts = Cell::new(0);
    assert_eq!(eval_rows(&dev, 200, &attempts).unwrap(), 50);
    let report = last_report().unwrap();
    assert_eq!(report.requested_batch, 200);
    assert_eq!(report.final_plan.batch(), 50);
    // a call with nothing to plan leaves no stale report behind
    assert_eq!(eval_rows(&dev, 0, &attempts).unwrap(), 0);
    assert!(last_report().is_none());
}

#[oom_retry]
fn plain(dev: &Device, bytes: usize, attempts: &Cell<u32>) -> Result<(), Error> {
    attempts.set(attempts.get() + 1);
    let _b = dev.alloc::<u8>(bytes)?;
    Ok(())
}

#[test]
fn a_bare_retry_is_bounded_and_its_error_carries_the_report() {
    let (dev, _held) = card_with_free(64);
    let attempts = Cell::new(0);
    let e = plain(&dev, 128 * MIB, &attempts).unwrap_err();
    assert_eq!(
        attempts.get(),
        2,
        "the call and one retry after emptying the cache"
    );
    assert!(e.is_oom());
    let Error::RetriesExhausted { error, report } = &e else {
        panic!("the error carries the report: {e:?}")
    };
    assert!(matches!(**error, Error::Oom(_)));
    // two attempts: the call and one retry; the report says it gave up
    assert_eq!((report.attempts.len(), report.retries()), (2, 1));
    assert!(report.gave_up());
    assert!(
        e.to_string()
            .contains("gave up (out of memory) after 2 attempts (1 retry)"),
        "{e}"
    );
    assert!(
        e.to_string().contains("Tried to allocate 128.00 MiB"),
        "{e}"
    );
    assert!(e.to_string().contains("attempt 2"), "{e}");
    // last_report: set on failure too, and not stale.
    assert!(last_report().unwrap().gave_up());
    plain(&dev, MIB, &attempts).unwrap();
    let ok = last_report().unwrap();
    assert_eq!(ok.retries(), 0);
    assert!(!ok.gave_up());
    plain(&dev, 128 * MIB, &attempts).unwrap_err();
    let failed = last_report().unwrap();
    assert_eq!(
        (failed.attempts.len(), failed.retries(), failed.gave_up()),
        (2, 1, true),
        "the failed step's report"
    );
}

#[oom_retry(plan = plan, remember = false)]
#[memory_budget("8 MiB")]
fn within_budget(dev: &Device, plan: &BatchPlan) -> Result<usize, Error> {
    rows_of(dev, plan)
}

#[test]
fn a_budget_overrun_goes_straight_to_a_smaller_plan() {
    let dev = Device::sim(ByteSize::mib(64));
    let plan = BatchPlan::whole(32).unwrap();
    assert_eq!(within_budget(&dev, &plan).unwrap(), 32);
    let r = last_report().unwrap();
    let first = &r.attempts[0];
    assert!(
        first.next.unwrap().micro_batch() < 32,
        "no same-plan retry after a budget overrun: {r}"
    );
    assert_eq!(r.retries(), 2, "32 → 16 → 8: {r}");
}

#[oom_retry(plan = plan, remember = false, policy = FnPolicy(|ctx: &oomguard::retry::RetryContext| BatchPlan::whole(ctx.requested_batch * 2).ok()))]
fn growing_policy(dev: &Device, plan: &BatchPlan) -> Result<usize, Error> {
    rows_of(dev, plan)
}

#[test]
fn a_policy_that_proposes_more_rows_is_refused_not_run() {
    let dev = Device::sim(ByteSize::mib(64));
    let e = growing_policy(&dev, &BatchPlan::whole(100).unwrap()).unwrap_err();
    assert!(e.is_oom(), "{e}");
    let r = last_report().unwrap();
    assert_eq!(
        (r.attempts.len(), r.retries(), r.gave_up()),
        (1, 0, true),
        "gave up at once: {r}"
    );
}

// --- reach: other error types ---

#[oom_retry(plan = plan, remember = false)]
fn with_anyhow(dev: &Device, plan: &BatchPlan) -> anyhow::Result<usize> {
    let mut n = 0;
    for c in plan.chunks() {
        let b = dev
            .alloc::<u8>(c.len() * MIB)
            .map_err(|e| anyhow::Error::new(e).context("forward pass"))?;
        n += b.len() / MIB;
    }
    Ok(n)
}

#[test]
fn anyhow_results_are_retried_and_carry_the_report() {
    let (dev, _held) = card_with_free(64);
    assert_eq!(
        with_anyhow(&dev, &BatchPlan::whole(100).unwrap()).unwrap(),
        100
    );
    assert!(last_report().unwrap().retries() >= 2);
    let small = Device::sim(ByteSize::mib(1));
    let e = with_anyhow(&small, &BatchPlan::whole(4).unwrap()).unwrap_err();
    assert!(oomguard::retry::IsOom::is_oom(&e));
    assert!(
        e.downcast_ref::<oomguard::retry::RetryReport>().is_some(),
        "the report is in the chain: {e:?}"
    );
    // The final error does not repeat its context: the report attached as context leaves out
    // the last attempt's error (it is the error below it). "forward pass" is in the line of
    // each earlier attempt, and once in the chain.
    let attempts = last_report().unwrap().attempts.len();
    assert!(attempts >= 2);
    for text in [format!("{e:#}"), format!("{e:?}")] {
        assert_eq!(text.matches("forward pass").count(), attempts, "{text}");
        assert!(!text.contains("forward pass: forward pass"), "{text}");
    }
}

/// A step that fails with an error that is not an out-of-memory.
#[oom_retry(plan = plan, remember = false)]
fn bad_input(plan: &BatchPlan) -> Result<usize, Error> {
    Err(Error::InvalidArgument(format!(
        "row {} is malformed",
        plan.batch()
    )))
}

#[test]
fn a_failed_steps_report_says_it_failed() {
    let e = bad_input(&BatchPlan::whole(64).unwrap()).unwrap_err();
    assert!(!e.is_oom());
    let r = last_report().unwrap();
    assert_eq!(r.failure.as_deref(), Some(e.to_string().as_str()));
    let text = r.to_string();
    assert!(
        !text.contains("batch 64 in one pass after 0 retries"),
        "reads like a success: {text}"
    );
    assert!(
        text.contains("failed on attempt 1 (batch 64 in one pass)"),
        "{text}"
    );
    assert!(text.contains("row 64 is malformed"), "{text}");
}

type StepResult<T> = Result<T, std::io::Error>;

/// A `Result` alias, and an OOM boxed in an `io::Error`.
#[oom_retry(plan = plan, remember = false)]
fn with_io(dev: &Device, plan: &BatchPlan) -> StepResult<usize> {
    let mut n = 0;
    for c in plan.chunks() {
        // `?` converts: oomguard's error into an `io::Error` of kind OutOfMemory
        let b = dev.alloc::<u8>(c.len() * MIB)?;
        n += b.len() / MIB;
    }
    Ok(n)
}

#[test]
fn io_errors_and_result_aliases_work() {
    let (dev, _held) = card_with_free(64);
    assert_eq!(with_io(&dev, &BatchPlan::whole(100).unwrap()).unwrap(), 100);
    assert!(last_report().unwrap().retries() >= 2);
}

#[test]
fn a_backend_oom_is_an_oom_and_plan_errors_convert() {
    let e = Error::Backend(BackendError::new(
        BackendErrorKind::OutOfMemory,
        "cuMemCreate",
        "out of memory",
    ));
    assert!(e.is_oom());
    assert!(oomguard::retry::chain_is_oom(&e));
    fn plan(rows: usize) -> Result<BatchPlan, Error> {
        Ok(BatchPlan::whole(rows)?)
    }
    let e = plan(0).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    let _: PlanError = BatchPlan::whole(0).unwrap_err();
}

// --- a policy of the user's does not shrink a training step either ---

#[oom_retry(plan = plan, remember = false, policy = oomguard::retry::Shrink::halving())]
fn shrink_policy_train(dev: &Device, plan: &BatchPlan) -> Result<usize, Error> {
    rows_of(dev, plan)
}

#[oom_retry(plan = plan, remember = false, policy = oomguard::retry::Shrink::halving())]
#[no_grad]
fn shrink_policy_eval(dev: &Device, plan: &BatchPlan) -> Result<usize, Error> {
    rows_of(dev, plan)
}

#[test]
fn a_shrinking_policy_is_refused_for_a_training_step() {
    let dev = Device::sim(ByteSize::mib(64));
    let plan = BatchPlan::whole(100).unwrap();
    let e = shrink_policy_train(&dev, &plan).unwrap_err();
    assert!(e.is_oom(), "{e}");
    let r = last_report().unwrap();
    assert!(r.gave_up(), "{r}");
    assert!(
        r.attempts.iter().all(|a| a.plan.batch() == 100),
        "no attempt ran fewer rows: {r}"
    );
    // an evaluation step may shrink, visibly
    assert_eq!(shrink_policy_eval(&dev, &plan).unwrap(), 50);
    assert_eq!(last_report().unwrap().final_plan.batch(), 50);
}

// --- a leak in an attempt that ran out of memory is not retried away ---

/// Keeps 1 MiB alive on its first attempt, then runs out of memory: the attempt changed what
/// lasts.
#[oom_retry(plan = plan, remember = false)]
#[oomguard::leak_check(action = error)]
fn leaks_then_ooms(
    dev: &Device,
    plan: &BatchPlan,
    keep: &mut Vec<oomguard::DeviceBuffer<u8>>,
) -> Result<usize, Error> {
    if keep.is_empty() {
        keep.push(dev.alloc::<u8>(MIB)?);
    }
    let mut n = 0;
    for c in plan.chunks() {
        n += dev.alloc::<u8>(c.len() * MIB)?.len() / MIB;
    }
    Ok(n)
}

#[test]
fn a_leak_before_an_oom_fails_the_step_instead_of_vanishing_in_the_retry() {
    let dev = Device::sim(ByteSize::mib(64));
    let mut keep = Vec::new();
    let e = leaks_then_ooms(&dev, &BatchPlan::whole(100).unwrap(), &mut keep).unwrap_err();
    let Error::Leak(report) = &e else {
        panic!("the leak is the step's error: {e}")
    };
    assert_eq!(report.function, Some("leaks_then_ooms"));
    assert_eq!(report.total_bytes, MIB as u64);
    assert_eq!(keep.len(), 1, "no retry ran after the leaking attempt");
    // without a leak the same OOM is retried as before
    assert_eq!(
        leaks_then_ooms(&dev, &BatchPlan::whole(100).unwrap(), &mut keep).unwrap(),
        100
    );
}

// --- the commit sees the batch and plan that ran ---

/// An evaluation over `rows` rows that advances a cursor in its commit.
#[oom_retry(batch = rows, remember = false, commit = |n| { *cursor += rows; Ok(n) })]
#[no_grad]
fn eval_and_advance(dev: &Device, rows: usize, cursor: &mut usize) -> Result<usize, Error> {
    Ok(dev.alloc::<u8>(rows * MIB)?.len() / MIB)
}

/// A training step whose commit reports the plan it was given.
#[oom_retry(plan = plan, remember = false, commit = |n| Ok((n, plan.num_chunks())))]
fn train_and_report(dev: &Device, plan: &BatchPlan) -> Result<(usize, usize), Error> {
    rows_of(dev, plan)
}

#[test]
fn the_commit_sees_the_batch_and_plan_that_ran() {
    let dev = Device::sim(ByteSize::mib(64));
    let mut cursor = 0;
    assert_eq!(eval_and_advance(&dev, 100, &mut cursor).unwrap(), 50);
    assert_eq!(
        cursor, 50,
        "the cursor moves by the rows processed, not the rows asked"
    );
    let (rows, chunks) = train_and_report(&dev, &BatchPlan::whole(100).unwrap()).unwrap();
    assert_eq!((rows, chunks), (100, 2));
}
