//! Nested retried steps (issue 26, point 1): a `#[oom_retry(commit = ..)]` step called from an
//! outer `#[oom_retry]` function. The inner commit applies the update once; an error after it
//! (in the commit, or later in the outer attempt) is never retried by the outer layer (that
//! would apply the update twice), and the inner step's report survives in what the user reads.

use std::cell::Cell;

use oomguard::retry::{last_report, BatchPlan, IsOom};
use oomguard::{oom_retry, ByteSize, Device, Error};

const MIB: usize = 1 << 20;

struct Model {
    dev: Device,
    updates: u32,
    /// Scratch the commit allocates, on its first run only (memory that an emptied cache would
    /// give back: a retry of the whole step would then succeed, and apply the update again).
    first_commit_scratch: usize,
    commits: u32,
}

impl Model {
    fn new(first_commit_scratch: usize) -> Self {
        Model {
            dev: Device::sim(ByteSize::mib(64)),
            updates: 0,
            first_commit_scratch,
            commits: 0,
        }
    }

    #[oom_retry(plan = plan, commit = |g| self.apply(g))]
    fn inner(&mut self, plan: &BatchPlan) -> Result<f32, Error> {
        let mut g = 0.0;
        for c in plan.chunks() {
            let _acts = self.dev.alloc::<u8>(c.len() * MIB)?;
            g += c.weight_f32();
        }
        Ok(g)
    }

    /// The update, then scratch memory that may not be there.
    fn apply(&mut self, g: f32) -> Result<f32, Error> {
        self.updates += 1;
        self.commits += 1;
        let scratch = if self.commits == 1 {
            self.first_commit_scratch
        } else {
            0
        };
        let _scratch = self.dev.alloc::<u8>(scratch)?;
        Ok(g)
    }
}

/// The outer layer: retries once after emptying the cache (bare `#[oom_retry]`).
#[oom_retry]
fn outer(m: &mut Model, plan: &BatchPlan) -> Result<f32, Error> {
    m.inner(plan)
}

thread_local! {
    static OUTER_ALLOC: Cell<usize> = const { Cell::new(0) };
}

/// An outer layer that allocates after the inner step committed, once too much.
#[oom_retry(plan = plan)]
fn outer_then_alloc(m: &mut Model, plan: &BatchPlan) -> Result<f32, Error> {
    let g = m.inner(&BatchPlan::whole(plan.batch()).unwrap())?;
    let bytes = OUTER_ALLOC.with(|a| a.replace(0));
    let _more = m.dev.alloc::<u8>(bytes)?;
    Ok(g)
}

#[test]
fn an_oom_in_a_nested_commit_is_not_retried_by_the_outer_layer() {
    let mut m = Model::new(512 * MIB);
    let r = outer(&mut m, &BatchPlan::whole(8).unwrap());
    assert_eq!(
        m.updates, 1,
        "the update is applied once, not once per outer retry"
    );
    let e = r.expect_err("the commit failed: the step failed");
    // marked: no layer may retry it
    assert!(!IsOom::is_oom(&e), "{e}");
    let Error::AfterCommit { error, report } = &e else {
        panic!("not marked as after a commit: {e:?}")
    };
    assert!(error.is_oom(), "what failed is still said: {error}");
    let c = report
        .commit_error
        .as_ref()
        .expect("the inner commit's failure");
    assert!(c.oom);
    assert!(report.site.contains("inner"), "{report}");
    // what the user reads: the outer step's report holds the inner one
    let last = last_report().unwrap();
    assert!(last.site.contains("outer"), "{last}");
    assert!(
        last.attempts.is_empty(),
        "the outer layer did not retry: {last}"
    );
    let nested = last
        .nested_commit
        .as_ref()
        .expect("the inner report is kept");
    assert_eq!(nested.commit_error.as_ref().map(|c| c.oom), Some(true));
    let text = last.to_string();
    assert!(text.contains("committed during the attempt"), "{text}");
    assert!(
        text.contains("commit failed (out of memory, not retried)"),
        "{text}"
    );
}

#[test]
fn an_oom_after_a_nested_commit_is_not_retried_by_the_outer_layer() {
    let mut m = Model::new(0);
    OUTER_ALLOC.with(|a| a.set(512 * MIB));
    let r = outer_then_alloc(&mut m, &BatchPlan::whole(8).unwrap());
    assert_eq!(m.updates, 1, "the inner update is applied once");
    let e = r.expect_err("the outer attempt failed after the inner commit");
    assert!(!IsOom::is_oom(&e), "{e}");
    assert!(
        matches!(&e, Error::AfterCommit { error, .. } if error.is_oom()),
        "{e:?}"
    );
    let last = last_report().unwrap();
    assert!(last.attempts.is_empty(), "not retried: {last}");
    assert!(last.nested_commit.is_some(), "{last}");
    assert!(last.failure.is_some(), "{last}");
}

/// An outer layer that runs out of memory before the inner step (nothing committed yet).
#[oom_retry(plan = plan)]
fn outer_alloc_first(m: &mut Model, plan: &BatchPlan) -> Result<f32, Error> {
    let bytes = OUTER_ALLOC.with(|a| a.replace(0));
    let _more = m.dev.alloc::<u8>(bytes)?;
    m.inner(&BatchPlan::whole(plan.batch()).unwrap())
}

#[test]
fn without_a_nested_commit_the_outer_layer_still_retries() {
    let mut m = Model::new(0);
    OUTER_ALLOC.with(|a| a.set(512 * MIB));
    let g = outer_alloc_first(&mut m, &BatchPlan::whole(8).unwrap()).unwrap();
    assert_eq!(g, 1.0);
    assert_eq!(m.updates, 1);
    let last = last_report().unwrap();
    assert!(last.site.contains("outer_alloc_first"), "{last}");
    assert_eq!(last.retries(), 1, "{last}");
    assert!(last.nested_commit.is_none());
}
