//! Hostile pass on the reporting layer: figures and classifications that must be true.

use oomguard_runtime::retry::{find_max_batch, FinderError, FinderOptions};
use oomguard_runtime::{ByteSize, Device, Error};

const MIB: u64 = 1 << 20;

/// NothingFits says "out of memory even with 1 row" and quotes "the 1-row run" (a 97-row run),
/// advising "a larger device is needed", when max_trials ended the search before 1 row was ever
/// tried (start 1000 and its bisection failed; 1 row fits the 64 MiB card).
#[test]
fn nothing_fits_is_not_claimed_when_one_row_never_ran() {
    let dev = Device::sim(ByteSize::mib(64));
    let step = |rows: usize| -> Result<(), Error> {
        let _a = dev.alloc::<u8>(rows << 20)?;
        Ok(())
    };
    let opts = FinderOptions {
        start: 1000,
        max: 1000,
        max_trials: 2,
        ..FinderOptions::default()
    };
    let e = find_max_batch(&dev, opts, step).unwrap_err();
    let text = e.to_string();
    let FinderError::NothingFits(trials) = &e else {
        panic!("{text}")
    };
    let rows: Vec<usize> = trials.iter().map(|t| t.rows).collect();
    assert!(!rows.contains(&1), "setup: {rows:?}");
    assert!(
        !text.contains("even with 1 row") && !text.contains("1-row run"),
        "1 row never ran (trials at {rows:?}), yet: {text}"
    );
    assert!(!text.contains("a larger device is needed"), "{text}");
    assert!(text.contains("max_trials"), "{text}");
    // 1 row does fit
    assert!(step(1).is_ok());
}

/// `safe_for` says "no verification" when a verification of 1 step ran (verify_steps 1,
/// steps_per_trial 1): the text contradicts `verification` and `verified_steps()`.
#[test]
fn safe_for_does_not_deny_a_verification_that_ran() {
    let dev = Device::sim(ByteSize::mib(256));
    let opts = FinderOptions {
        steps_per_trial: 1,
        verify_steps: 1,
        ..FinderOptions::default()
    };
    let r = find_max_batch(&dev, opts, |rows| dev.alloc::<u8>(rows << 20).map(drop)).unwrap();
    assert_eq!(r.verified_steps(), 1, "{r}");
    assert!(!r.verification.is_empty());
    let said = r.safe_for();
    assert!(
        !said.contains("no verification"),
        "verification ran 1 step, yet: {said}"
    );
}

/// `safe_for` says "2 consecutive steps ran at it" (steps_per_trial) for a batch that only the
/// verification's bisection ran, for 1 step (verify_steps 1): no trial of 2 steps ran at it.
#[test]
fn safe_for_does_not_claim_steps_that_never_ran_at_the_batch() {
    let dev = Device::sim(ByteSize::mib(256));
    let opts = FinderOptions {
        steps_per_trial: 2,
        verify_steps: 1,
        ..FinderOptions::default()
    };
    // the verification marks its steps: from then on the step needs 100 MiB more (a source
    // whose memory varies between the search and the loop, as the fragmenting pools of
    // retry_finder.rs do)
    let step = |rows: usize| -> Result<(), Error> {
        let extra = if dev.stats().num_step_marks > 0 {
            100 << 20
        } else {
            0
        };
        let _a = dev.alloc::<u8>((rows << 20) + extra)?;
        Ok(())
    };
    let r = find_max_batch(&dev, opts, step).unwrap();
    let searched_at_max = r
        .trials
        .iter()
        .any(|t| t.rows == r.max_batch && t.peak_bytes.is_some());
    assert!(
        !searched_at_max,
        "setup: the search ran {} itself: {r}",
        r.max_batch
    );
    assert_eq!(r.verified_steps(), 1, "{r}");
    let said = r.safe_for();
    assert!(
        !said.contains("2 consecutive steps ran at it"),
        "{} rows ran 1 step (its verification) and no search trial, yet: {said}\n{r}",
        r.max_batch
    );
}

/// `micro_batch_for` a batch larger than the one found returns `max_batch` itself, leaving no
/// room for the whole batch's tensors (`batch_bytes_per_row`), when the report has neither a
/// verification nor a fit (verify_steps 0, the 8-row probe failed): the search's own trial at
/// `max_batch` measured the bytes per row all the same. Its doc promises fewer rows
/// (LARGER_BATCH_SHARE of what fits, at least 1).
#[test]
fn micro_batch_for_a_larger_batch_leaves_room_without_a_fit() {
    let dev = Device::sim(ByteSize::mib(64));
    let opts = FinderOptions {
        verify_steps: 0,
        ..FinderOptions::default()
    };
    // 10 MiB a row: 1 row runs, 8 do not
    let mut r = find_max_batch(&dev, opts, |rows| {
        dev.alloc::<u8>(rows * (10 << 20)).map(drop)
    })
    .unwrap();
    assert!(r.fit.is_none() && r.verification.is_empty(), "setup: {r}");
    // half of each row is the batch's own tensors (what the framework crates set)
    r.batch_bytes_per_row = Some(5 * MIB);
    let m = r.max_batch;
    let got = r.micro_batch_for(10 * m);
    let most = ((m as f64 * oomguard_runtime::retry::LARGER_BATCH_SHARE).floor() as usize).max(1);
    assert!(
        got <= most,
        "micro_batch_for({}) = {got} with max_batch {m}: a split step holds {} rows' tensors of 5 MiB beyond its micro-batch\n{r}",
        10 * m,
        10 * m - got
    );
}
