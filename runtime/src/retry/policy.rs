//! Retry policies: what to try after an out-of-memory (or allocator thrashing).
//!
//! A policy maps the failed plan to the next one, or gives up. Policies compose:
//!
//! ```
//! use oomguard_runtime::retry::advanced::{
//!     EmptyCacheRetry, PolicyExt, Pressure, RetryContext, Shrink,
//! };
//! use oomguard_runtime::retry::{Accumulate, BatchPlan, RetryPolicy};
//! // empty the cache and retry once, then halve micro-batches down to 4 rows, then halve the
//! // batch itself (inference), at most 10 retries in all
//! let policy = EmptyCacheRetry::once()
//!     .then(Accumulate::halving().min_micro_batch(4))
//!     .then(Shrink::halving())
//!     .max_retries(10);
//! let plan = BatchPlan::whole(64).unwrap();
//! let ctx = RetryContext::new(plan, 64, 1, Pressure::Oom);
//! assert_eq!(policy.next_plan(&ctx), Some(plan)); // same plan, after emptying the cache
//! let ctx = RetryContext::new(plan, 64, 2, Pressure::Oom);
//! assert_eq!(policy.next_plan(&ctx).unwrap().micro_batch(), 32);
//! ```
//!
//! In data-parallel runs every rank must reach the same decision from the same context: a policy
//! should depend only on the [`RetryContext`] (not on the error's text, a clock, or randomness).

use std::fmt;
use std::sync::Arc;

use crate::retry_report::{BatchPlan, PlanError};

/// Why the engine asks for a smaller plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Pressure {
    /// The step failed with out-of-memory.
    Oom,
    /// The step succeeded, but the allocator churned in several consecutive steps: it freed its
    /// cache and retried (move down before a hard OOM), or moved pages and synchronised (the
    /// engine tries the smaller plan and keeps the faster per row). A same-plan retry makes no
    /// sense here.
    Thrash,
    /// The step exceeded a memory budget (`#[memory_budget]`, [`crate::guard::thread_budget`]):
    /// emptying the cache cannot help, so a same-plan retry makes no sense here either.
    Budget,
    /// One request was larger than the device's whole capacity, or a budget's whole limit
    /// ([`IsOom::oom_request`](super::IsOom::oom_request)): no emptied cache makes it fit, so a
    /// same-plan retry makes no sense; a smaller plan may shrink the request.
    TooLarge,
}

/// What a policy sees when asked for the next plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryContext {
    /// The plan that failed (or thrashed).
    pub plan: BatchPlan,
    /// The batch the caller asked for.
    pub requested_batch: usize,
    /// Failures so far in this step, this one included (1 on the first failure).
    pub attempt: u32,
    /// Why a smaller plan is needed.
    pub pressure: Pressure,
}

impl RetryContext {
    /// A context (for tests and custom engines).
    pub fn new(plan: BatchPlan, requested_batch: usize, attempt: u32, pressure: Pressure) -> Self {
        Self {
            plan,
            requested_batch,
            attempt,
            pressure,
        }
    }
}

/// Chooses the plan to retry with, or `None` to give up.
///
/// Implemented by the built-in policies, by closures `Fn(&RetryContext) -> Option<BatchPlan>`,
/// and by your own types:
///
/// ```
/// use oomguard_runtime::retry::advanced::RetryContext;
/// use oomguard_runtime::retry::{BatchPlan, RetryPolicy};
/// /// Jumps straight to micro-batches of 1 row.
/// #[derive(Debug)]
/// struct OneRow;
/// impl RetryPolicy for OneRow {
///     fn next_plan(&self, ctx: &RetryContext) -> Option<BatchPlan> {
///         (ctx.plan.micro_batch() > 1).then(|| BatchPlan::with_micro_batch(ctx.plan.batch(), 1).ok()).flatten()
///     }
/// }
/// ```
pub trait RetryPolicy: Send + Sync + fmt::Debug {
    /// The next plan to run, or `None` to give up.
    fn next_plan(&self, ctx: &RetryContext) -> Option<BatchPlan>;

    /// Whether this policy never runs fewer rows than the step asked for ([`KeepsRows`]: a
    /// training step). With several ranks the agreed plan is the smallest of any rank's: when
    /// another rank's plan drops rows, a rank whose policy keeps them does not follow it;
    /// every rank gives up instead ([`StopReason::RanksDisagreeOnRows`](crate::retry::StopReason::RanksDisagreeOnRows)).
    /// `false` by default; `true` for [`EmptyCacheRetry`], [`Accumulate`] and [`KeepsRows`] (so
    /// for `training_policy()`); [`Shrink`] drops rows; the combinators pass their inner
    /// policies' on (a chain keeps rows when every link does).
    fn keeps_rows(&self) -> bool {
        false
    }

    /// The most retries in one step after which this policy gives up whatever plans are
    /// left (`None`: no such limit, the default). The engine reports a step it gave up on
    /// past this many retries as stopped by the limit
    /// ([`StopReason::RetryLimit`](crate::retry::StopReason::RetryLimit)), not as having no
    /// smaller plan. [`PolicyExt::max_retries`] sets it; the filters ([`PolicyExt::with_floor`],
    /// [`KeepsRows`]) pass their inner policy's on.
    fn retry_limit(&self) -> Option<u32> {
        None
    }
}

/// A closure as a policy.
pub struct FnPolicy<F>(pub F);

impl<F> fmt::Debug for FnPolicy<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FnPolicy")
    }
}

impl<F> RetryPolicy for FnPolicy<F>
where
    F: Fn(&RetryContext) -> Option<BatchPlan> + Send + Sync,
{
    fn next_plan(&self, ctx: &RetryContext) -> Option<BatchPlan> {
        (self.0)(ctx)
    }
}

impl<P: RetryPolicy + ?Sized> RetryPolicy for Arc<P> {
    fn next_plan(&self, ctx: &RetryContext) -> Option<BatchPlan> {
        (**self).next_plan(ctx)
    }
    fn retry_limit(&self) -> Option<u32> {
        (**self).retry_limit()
    }
    fn keeps_rows(&self) -> bool {
        (**self).keeps_rows()
    }
}

impl<P: RetryPolicy + ?Sized> RetryPolicy for Box<P> {
    fn next_plan(&self, ctx: &RetryContext) -> Option<BatchPlan> {
        (**self).next_plan(ctx)
    }
    fn retry_limit(&self) -> Option<u32> {
        (**self).retry_limit()
    }
    fn keeps_rows(&self) -> bool {
        (**self).keeps_rows()
    }
}

/// Retries the same plan (the engine has emptied the cache) on the first `times` failures of a
/// step. Only for [`Pressure::Oom`]: never for [`Pressure::Thrash`], [`Pressure::Budget`] or
/// [`Pressure::TooLarge`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EmptyCacheRetry {
    times: u32,
}

impl EmptyCacheRetry {
    /// One same-plan retry per step.
    pub fn once() -> Self {
        Self { times: 1 }
    }
    /// `times` same-plan retries per step.
    pub fn times(times: u32) -> Self {
        Self { times }
    }
}

impl RetryPolicy for EmptyCacheRetry {
    fn next_plan(&self, ctx: &RetryContext) -> Option<BatchPlan> {
        (ctx.pressure == Pressure::Oom && ctx.attempt <= self.times).then_some(ctx.plan)
    }
    fn retry_limit(&self) -> Option<u32> {
        Some(self.times)
    }
    /// The same plan again: never fewer rows.
    fn keeps_rows(&self) -> bool {
        true
    }
}

/// Gradient accumulation: keeps the batch, divides the micro-batch by `factor` (2: halves it),
/// so the step's result is the same up to float rounding. Gives up at micro-batches of 1 row
/// (or the floor set with [`Accumulate::min_micro_batch`]: no chunk of a plan it proposes has
/// fewer rows).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Accumulate {
    factor: usize,
    min_micro: usize,
}

impl Accumulate {
    /// Halves the micro-batch on each retry.
    pub fn halving() -> Self {
        Self {
            factor: 2,
            min_micro: 1,
        }
    }
    /// Divides the micro-batch by `factor` (at least 2) on each retry.
    pub fn by(factor: usize) -> Result<Self, PlanError> {
        if factor < 2 {
            return Err(PlanError(format!(
                "accumulation factor {factor}: must be at least 2"
            )));
        }
        Ok(Self {
            factor,
            min_micro: 1,
        })
    }
    /// Never proposes a plan with a chunk of fewer than `rows` rows (at least 1): with 200
    /// rows and a floor of 30, the last plan is 6 chunks of 33–34 rows, not 7 of 28–29.
    pub fn min_micro_batch(mut self, rows: usize) -> Self {
        self.min_micro = rows.max(1);
        self
    }
}

impl RetryPolicy for Accumulate {
    fn next_plan(&self, ctx: &RetryContext) -> Option<BatchPlan> {
        let batch = ctx.plan.batch();
        let micro = ctx.plan.micro_batch();
        let next = micro.div_ceil(self.factor).max(self.min_micro);
        // Rows are spread evenly over the chunks, so `batch.div_ceil(next)` chunks can hold
        // fewer than `next` rows each: never so many chunks that one falls under the floor.
        let chunks = batch.div_ceil(next).min((batch / self.min_micro).max(1));
        if chunks <= ctx.plan.num_chunks() {
            return None;
        }
        BatchPlan::new(batch, chunks).ok()
    }
    /// The plan's rows in more micro-batches: never fewer rows.
    fn keeps_rows(&self) -> bool {
        true
    }
}

/// Shrinks the batch itself (rows `0..new_batch` are processed; the caller handles the rest):
/// for evaluation and inference, where a smaller batch changes nothing but throughput. Keeps the
/// micro-batch size. Gives up at 1 row (or the floor set with [`Shrink::min_batch`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Shrink {
    factor: f64,
    min_batch: usize,
}

impl Shrink {
    /// Halves the batch on each retry.
    pub fn halving() -> Self {
        Self {
            factor: 0.5,
            min_batch: 1,
        }
    }
    /// Multiplies the batch by `factor` (in `(0, 1)`) on each retry; always shrinks by at least
    /// one row.
    pub fn by(factor: f64) -> Result<Self, PlanError> {
        if !(factor > 0.0 && factor < 1.0) {
            return Err(PlanError(format!(
                "shrink factor {factor}: must be between 0 and 1 (exclusive)"
            )));
        }
        Ok(Self {
            factor,
            min_batch: 1,
        })
    }
    /// Never goes below `rows` rows (at least 1).
    pub fn min_batch(mut self, rows: usize) -> Self {
        self.min_batch = rows.max(1);
        self
    }
}

impl RetryPolicy for Shrink {
    fn next_plan(&self, ctx: &RetryContext) -> Option<BatchPlan> {
        let batch = ctx.plan.batch();
        let scaled = (batch as f64 * self.factor).floor() as usize;
        let next = scaled.min(batch.saturating_sub(1)).max(self.min_batch);
        if next >= batch {
            return None;
        }
        BatchPlan::with_micro_batch(next, ctx.plan.micro_batch()).ok()
    }
}

/// Filters another policy's plans for a training step: a plan that runs fewer rows than the step
/// asked for is refused (the step gives up), because dropping rows changes what a training
/// step computes. The refusal is logged at error level, and printed on standard error when no
/// `tracing` subscriber is installed, with the hint set by [`KeepsRows::hint`]. Used by
/// `#[oom_retry]` on training steps and by `oomguard_candle::train_step`.
///
/// ```
/// use oomguard_runtime::retry::advanced::{KeepsRows, Pressure, RetryContext};
/// use oomguard_runtime::retry::{inference_policy, BatchPlan, RetryPolicy};
/// let p = KeepsRows::new(inference_policy());
/// let plan = BatchPlan::with_micro_batch(8, 1).unwrap(); // nothing left to split
/// let ctx = RetryContext::new(plan, 8, 3, Pressure::Oom);
/// assert_eq!(inference_policy().next_plan(&ctx).map(|p| p.batch()), Some(4)); // would drop rows
/// assert_eq!(p.next_plan(&ctx), None); // refused
/// ```
#[derive(Clone, Debug)]
pub struct KeepsRows<P> {
    inner: P,
    hint: &'static str,
}

impl<P> KeepsRows<P> {
    /// Filters `inner`'s plans.
    pub fn new(inner: P) -> Self {
        Self {
            inner,
            hint: "Use a policy that keeps the batch (`Accumulate`, `training_policy()`)",
        }
    }
    /// What the refusal message tells the user to do instead.
    pub fn hint(mut self, hint: &'static str) -> Self {
        self.hint = hint;
        self
    }
    /// The filtered policy.
    pub fn inner(&self) -> &P {
        &self.inner
    }
}

impl<P: RetryPolicy> RetryPolicy for KeepsRows<P> {
    fn next_plan(&self, ctx: &RetryContext) -> Option<BatchPlan> {
        let next = self.inner.next_plan(ctx)?;
        if next.batch() < ctx.requested_batch {
            let msg = format!(
                "the retry policy {:?} proposed {next} for a training step of {} rows: a \
                 training step never runs fewer rows (it would train on less data); giving up. {}",
                self.inner, ctx.requested_batch, self.hint
            );
            tracing::error!(target: "oomguard::retry", "{msg}");
            if !tracing::dispatcher::has_been_set() {
                eprintln!("oomguard error: {msg}");
            }
            return None;
        }
        Some(next)
    }
    fn retry_limit(&self) -> Option<u32> {
        self.inner.retry_limit()
    }
    fn keeps_rows(&self) -> bool {
        true
    }
}

/// Filters another policy's plans: plans with smaller micro-batches or batches than the floor
/// are refused (the policy gives up instead).
#[derive(Clone, Debug)]
pub struct Floor<P> {
    inner: P,
    min_micro: usize,
    min_batch: usize,
}

impl<P: RetryPolicy> RetryPolicy for Floor<P> {
    fn next_plan(&self, ctx: &RetryContext) -> Option<BatchPlan> {
        self.inner
            .next_plan(ctx)
            // the smallest chunk (rows are spread evenly) against the micro-batch floor
            .filter(|p| p.batch() / p.num_chunks() >= self.min_micro && p.batch() >= self.min_batch)
    }
    fn retry_limit(&self) -> Option<u32> {
        self.inner.retry_limit()
    }
    fn keeps_rows(&self) -> bool {
        self.inner.keeps_rows()
    }
}

/// Gives up after `max` retries in one step.
#[derive(Clone, Debug)]
pub struct MaxRetries<P> {
    inner: P,
    max: u32,
}

impl<P: RetryPolicy> RetryPolicy for MaxRetries<P> {
    fn next_plan(&self, ctx: &RetryContext) -> Option<BatchPlan> {
        if ctx.attempt > self.max {
            return None;
        }
        self.inner.next_plan(ctx)
    }
    fn retry_limit(&self) -> Option<u32> {
        Some(
            self.inner
                .retry_limit()
                .map_or(self.max, |m| m.min(self.max)),
        )
    }
    fn keeps_rows(&self) -> bool {
        self.inner.keeps_rows()
    }
}

/// Tries `first`; when it gives up, `second`.
#[derive(Clone, Debug)]
pub struct Chain<A, B> {
    first: A,
    second: B,
}

impl<A: RetryPolicy, B: RetryPolicy> RetryPolicy for Chain<A, B> {
    fn next_plan(&self, ctx: &RetryContext) -> Option<BatchPlan> {
        self.first
            .next_plan(ctx)
            .or_else(|| self.second.next_plan(ctx))
    }
    /// Both parts give up past their limits: the larger one, when both have one.
    fn retry_limit(&self) -> Option<u32> {
        Some(self.first.retry_limit()?.max(self.second.retry_limit()?))
    }
    fn keeps_rows(&self) -> bool {
        self.first.keeps_rows() && self.second.keeps_rows()
    }
}

/// Combinators for every policy.
pub trait PolicyExt: RetryPolicy + Sized {
    /// When this policy gives up, ask `next`.
    fn then<B: RetryPolicy>(self, next: B) -> Chain<Self, B> {
        Chain {
            first: self,
            second: next,
        }
    }
    /// Refuses plans with micro-batches under `min_micro` rows or batches under `min_batch`.
    fn with_floor(self, min_micro: usize, min_batch: usize) -> Floor<Self> {
        Floor {
            inner: self,
            min_micro,
            min_batch,
        }
    }
    /// Gives up after `max` retries in one step.
    fn max_retries(self, max: u32) -> MaxRetries<Self> {
        MaxRetries { inner: self, max }
    }
    /// The policy behind an `Arc`, as the engine stores it.
    fn shared(self) -> Arc<dyn RetryPolicy>
    where
        Self: 'static,
    {
        Arc::new(self)
    }
}

impl<P: RetryPolicy> PolicyExt for P {}

/// The training default: empty the cache and retry once, then gradient accumulation (halving the
/// micro-batch; the batch and the result stay the same), at most 16 retries.
pub fn training_policy() -> impl RetryPolicy {
    EmptyCacheRetry::once()
        .then(Accumulate::halving())
        .max_retries(16)
}

/// The evaluation/inference default: empty the cache and retry once, split into micro-batches,
/// then halve the batch itself, at most 32 retries.
pub fn inference_policy() -> impl RetryPolicy {
    EmptyCacheRetry::once()
        .then(Accumulate::halving())
        .then(Shrink::halving())
        .max_retries(32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(policy: &dyn RetryPolicy, start: BatchPlan) -> Vec<BatchPlan> {
        let mut out = vec![];
        let mut plan = start;
        for attempt in 1..100 {
            let ctx = RetryContext::new(plan, start.batch(), attempt, Pressure::Oom);
            match policy.next_plan(&ctx) {
                Some(p) => {
                    out.push(p);
                    plan = p;
                }
                None => break,
            }
        }
        out
    }

    #[test]
    fn chain_order() {
        let p = inference_policy();
        let seq = run(&p, BatchPlan::whole(8).unwrap());
        let got: Vec<(usize, usize)> = seq.iter().map(|p| (p.batch(), p.micro_batch())).collect();
        assert_eq!(
            got,
            [(8, 8), (8, 4), (8, 2), (8, 1), (4, 1), (2, 1), (1, 1)]
        );
    }

    #[test]
    fn accumulate_keeps_batch_and_floors() {
        let p = Accumulate::halving().min_micro_batch(10);
        let seq = run(&p, BatchPlan::whole(100).unwrap());
        let micro: Vec<usize> = seq.iter().map(|p| p.micro_batch()).collect();
        assert_eq!(micro, [50, 25, 13, 10]);
        assert!(seq.iter().all(|p| p.batch() == 100));
        // the floor holds for every chunk, not just the largest: 200 rows over 7 chunks
        // would be 28-29 rows, under a floor of 30
        let p = Accumulate::halving().min_micro_batch(30);
        let seq = run(&p, BatchPlan::whole(200).unwrap());
        let chunks: Vec<usize> = seq.iter().map(|p| p.num_chunks()).collect();
        assert_eq!(chunks, [2, 4, 6]);
        assert!(seq.iter().all(|p| p.batch() / p.num_chunks() >= 30));
        // a batch under the floor is never split
        assert!(run(&p, BatchPlan::whole(20).unwrap()).is_empty());
        let f = Accumulate::halving().with_floor(30, 1);
        assert_eq!(run(&f, BatchPlan::whole(200).unwrap()).len(), 2);
        assert!(Accumulate::by(1).is_err());
        let p3 = Accumulate::by(3).unwrap();
        assert_eq!(run(&p3, BatchPlan::whole(9).unwrap()).len(), 2);
    }

    #[test]
    fn keeps_rows_refuses_only_plans_that_drop_rows() {
        let p = KeepsRows::new(inference_policy());
        let whole = BatchPlan::whole(8).unwrap();
        // the same plan and accumulation pass through
        let ctx = RetryContext::new(whole, 8, 1, Pressure::Oom);
        assert_eq!(p.next_plan(&ctx), Some(whole));
        let ctx = RetryContext::new(whole, 8, 2, Pressure::Oom);
        assert_eq!(p.next_plan(&ctx).unwrap().batch(), 8);
        // the shrink is refused
        let ones = BatchPlan::with_micro_batch(8, 1).unwrap();
        let ctx = RetryContext::new(ones, 8, 5, Pressure::Oom);
        assert_eq!(inference_policy().next_plan(&ctx).unwrap().batch(), 4);
        assert_eq!(p.next_plan(&ctx), None);
    }

    #[test]
    fn shrink_any_factor_and_floor() {
        let p = Shrink::by(0.9).unwrap().min_batch(5);
        let seq = run(&p, BatchPlan::whole(10).unwrap());
        let b: Vec<usize> = seq.iter().map(|p| p.batch()).collect();
        assert_eq!(b, [9, 8, 7, 6, 5]);
        assert!(Shrink::by(1.0).is_err());
        assert!(Shrink::by(f64::NAN).is_err());
        // floors through the combinator, and max retries
        let p = Shrink::halving().with_floor(1, 3);
        assert_eq!(run(&p, BatchPlan::whole(16).unwrap()).len(), 2);
        let p = Shrink::halving().max_retries(1);
        assert_eq!(run(&p, BatchPlan::whole(16).unwrap()).len(), 1);
    }

    #[test]
    fn empty_cache_only_for_oom_and_closures_work() {
        let plan = BatchPlan::whole(4).unwrap();
        let e = EmptyCacheRetry::once();
        assert_eq!(
            e.next_plan(&RetryContext::new(plan, 4, 1, Pressure::Thrash)),
            None
        );
        assert_eq!(
            e.next_plan(&RetryContext::new(plan, 4, 1, Pressure::Oom)),
            Some(plan)
        );
        let f = FnPolicy(|c: &RetryContext| BatchPlan::new(c.plan.batch(), c.plan.batch()).ok());
        assert_eq!(
            f.next_plan(&RetryContext::new(plan, 4, 1, Pressure::Oom))
                .unwrap()
                .micro_batch(),
            1
        );
    }
}
