//! The commit phase of `#[oom_retry]` (`commit = |value| ...`): it runs once, after every
//! micro-batch of one attempt succeeded; it is never rerun (an out-of-memory inside it is the
//! function's error, recorded as the commit's); a `#[leak_check(action = error)]` of the attempt
//! fails the step before the commit.

use std::cell::Cell;
use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use oomguard::retry::{last_report, BatchPlan};
use oomguard::{leak_check, oom_retry, ByteSize, Device, DeviceBuffer, Error};

const MIB: usize = 1 << 20;

struct Model {
    dev: Device,
    data: Vec<f32>,
    param: f32,
    updates: u32,
    attempts: u32,
    /// Bytes the commit allocates as scratch (an optimizer that allocates).
    commit_scratch: usize,
    kept: Vec<DeviceBuffer<u8>>,
    leak: bool,
}

impl Model {
    fn new(dev: Device, rows: usize) -> Self {
        Model {
            dev,
            data: (0..rows).map(|i| (i % 13) as f32).collect(),
            param: 10.0,
            updates: 0,
            attempts: 0,
            commit_scratch: 0,
            kept: Vec::new(),
            leak: false,
        }
    }

    /// The attempt: the mean of the rows of `plan`, with 1 MiB of activations per row.
    #[oom_retry(plan = plan, commit = |loss| self.apply(loss))]
    #[leak_check(action = error)]
    fn step(&mut self, plan: &BatchPlan) -> Result<f32, Error> {
        self.attempts += 1;
        let mut loss = 0.0;
        for chunk in plan.chunks() {
            let x = self.dev.from_slice(&self.data[chunk.rows()])?;
            let _acts = self.dev.alloc::<u8>(chunk.len() * MIB)?;
            let mean = x.to_vec()?.iter().sum::<f32>() / chunk.len() as f32;
            loss += chunk.weight_f32() * mean;
        }
        if self.leak {
            self.kept.push(self.dev.alloc::<u8>(1024)?);
        }
        Ok(loss)
    }

    /// The commit: the update, once.
    fn apply(&mut self, loss: f32) -> Result<f32, Error> {
        self.updates += 1;
        self.param -= loss;
        let _scratch = self.dev.alloc::<u8>(self.commit_scratch)?;
        Ok(loss)
    }
}

fn mean(data: &[f32]) -> f32 {
    data.iter().sum::<f32>() / data.len() as f32
}

#[test]
fn the_commit_runs_once_after_the_attempt_that_succeeded() {
    let mut m = Model::new(Device::sim(ByteSize::mib(64)), 200);
    let plan = BatchPlan::whole(200).unwrap();
    let loss = m.step(&plan).unwrap();
    let report = last_report().unwrap();
    assert!(report.retries() >= 2, "{report}");
    assert!(report.final_plan.num_chunks() > 1, "{report}");
    assert!(m.attempts >= 3);
    assert_eq!(m.updates, 1, "one update whatever the number of attempts");
    let expected = mean(&m.data);
    assert!(
        (loss - expected).abs() <= 1e-5 * expected,
        "{loss} vs {expected}"
    );
    assert_eq!(m.param, 10.0 - loss);
    assert_eq!(m.dev.stats().allocated_bytes.all.current, 0);
}

#[test]
fn an_oom_in_the_commit_is_not_retried_and_is_reported_as_the_commits() {
    let mut m = Model::new(Device::sim(ByteSize::mib(64)), 8);
    m.commit_scratch = 128 * MIB;
    let plan = BatchPlan::whole(8).unwrap();
    let e = m.step(&plan).unwrap_err();
    // an out-of-memory after the update: marked, so that no outer layer retries it
    assert!(!e.is_oom(), "{e}");
    assert!(
        matches!(&e, Error::AfterCommit { error, .. } if error.is_oom()),
        "{e:?}"
    );
    assert_eq!(
        m.attempts, 1,
        "the attempt is not rerun after the commit failed"
    );
    assert_eq!(m.updates, 1, "the commit ran once");
    let report = last_report().unwrap();
    let c = report
        .commit_error
        .as_ref()
        .expect("the commit's failure is recorded");
    assert!(c.oom);
    assert!(
        report
            .to_string()
            .contains("commit failed (out of memory, not retried)"),
        "{report}"
    );
}

#[test]
fn a_leak_check_error_fails_the_step_before_the_commit() {
    let mut m = Model::new(Device::sim(ByteSize::mib(64)), 8);
    m.leak = true;
    let plan = BatchPlan::whole(8).unwrap();
    let e = m.step(&plan).unwrap_err();
    assert!(matches!(e, Error::Leak(_)), "{e}");
    assert_eq!(m.updates, 0, "no update after a failed leak check");
    assert_eq!(m.param, 10.0);
}

/// A free function: the commit closure sees the parameters; the commit's type is the function's.
#[oom_retry(batch = rows, commit = |sum: u64| { *total += sum; Ok(sum as usize) })]
#[oomguard::no_grad]
fn evaluate(dev: &Device, rows: usize, total: &mut u64, seen: &Cell<u32>) -> Result<usize, Error> {
    seen.set(seen.get() + 1);
    let b = dev.alloc::<u8>(rows * MIB)?;
    Ok((b.len() / MIB) as u64)
}

#[test]
fn the_commit_of_a_free_function_gets_the_value_and_the_parameters() {
    let dev = Device::sim(ByteSize::mib(64));
    let mut total = 0;
    let seen = Cell::new(0);
    assert_eq!(evaluate(&dev, 16, &mut total, &seen).unwrap(), 16);
    assert_eq!(evaluate(&dev, 4, &mut total, &seen).unwrap(), 4);
    assert_eq!(total, 20);
    assert_eq!(seen.get(), 2);
}

#[oom_retry(plan = plan, commit = |n| { *updates += 1; Ok(n) })]
async fn async_step(dev: &Device, plan: &BatchPlan, updates: &mut u32) -> Result<usize, Error> {
    let mut n = 0;
    for c in plan.chunks() {
        n += dev.alloc::<u8>(c.len() * MIB)?.len() / MIB;
    }
    Ok(n)
}

fn block_on<F: Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    let mut cx = Context::from_waker(Waker::noop());
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
    }
}

#[test]
fn an_async_step_commits_once() {
    let dev = Device::sim(ByteSize::mib(64));
    let mut updates = 0;
    let plan = BatchPlan::whole(100).unwrap();
    assert_eq!(
        block_on(async_step(&dev, &plan, &mut updates)).unwrap(),
        100
    );
    assert!(last_report().unwrap().retries() >= 1);
    assert_eq!(updates, 1);
}
