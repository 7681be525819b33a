//! [`RetryLoop`]: one step in progress, driven by hand.

use std::fmt;
use std::ops::ControlFlow;
use std::time::Instant;

use crate::retry::classify::IsOom;
use crate::retry::last_report;
use crate::retry::memory::MemoryKey;
use crate::retry::result::RetryError;
use crate::retry_report::{BatchPlan, RetryReport, StepMode};
use crate::Device;

use super::config::RetryEngine;
use super::full_loop::FullLoop;
use super::target::{thread_churn, ChurnMark, Target};
use super::thread_device::thread_device_key;

/// One step in progress, driven by hand: run an attempt with [`RetryLoop::plan`], hand its
/// result to [`RetryLoop::next`], and repeat while it says `Continue`. Made by
/// [`RetryEngine::begin`]. Commit only after `next` returns `Break(Ok(..))`.
///
/// A loop made by [`RetryEngine::begin_any_memo`] may start without being set up: its first
/// attempt runs with the caller's plan, and the loop is set up only if that attempt fails (or
/// the allocator thrashed during it); what it does and reports is the same.
pub struct RetryLoop<E> {
    pub(super) state: LoopState<E>,
}

pub(super) enum LoopState<E> {
    /// The first attempt of a step with nothing remembered, not set up yet.
    Lazy(LazyLoop),
    Full(Box<FullLoop<E>>),
}

/// A first attempt started without a loop (see [`RetryEngine::begin_any_memo`]).
pub(super) struct LazyLoop {
    pub(super) engine: RetryEngine,
    pub(super) site: &'static str,
    pub(super) mode: StepMode,
    pub(super) plan: BatchPlan,
    pub(super) started: Instant,
    /// The churn counters when the attempt started.
    pub(super) churn_before: ChurnMark,
    /// Commits on the thread when the attempt started ([`crate::retry::commit`]).
    pub(super) commits_before: u64,
    /// The step ended: how long it took.
    pub(super) elapsed: Option<std::time::Duration>,
    /// [`RetryLoop::report`], made when asked for.
    pub(super) report: std::sync::OnceLock<Box<RetryReport>>,
}

impl LazyLoop {
    fn make_report(&self) -> RetryReport {
        RetryReport {
            elapsed: self.elapsed.unwrap_or_default(),
            ..RetryReport::starting(
                self.site.to_string(),
                self.mode,
                self.plan.batch(),
                self.plan,
            )
        }
    }

    /// The loop as `RetryEngine::begin_on` would have set it up (nothing was remembered, so
    /// the plan is the caller's), its first attempt under way.
    fn upgrade<E>(&self) -> FullLoop<E> {
        let key = MemoryKey {
            site: self.site.to_string(),
            // the device now: what the attempt learned belongs to the device it allocated on
            device: thread_device_key(),
            mode: self.mode,
        };
        let memory_error = self.engine.memory().error().map(str::to_string);
        let mut report = self.make_report();
        report.elapsed = Default::default();
        report.memory_error = memory_error;
        FullLoop {
            device_addr: Device::thread_device_addr(),
            engine: self.engine.clone(),
            target: Target::All,
            key,
            batch: self.plan.batch(),
            good: self.plan,
            plan: self.plan,
            regrow: None,
            regrow_plan: None,
            report,
            failures: Vec::new(),
            oom_count: 0,
            last_too_large: None,
            started: self.started,
            attempt_started: self.started,
            churn_before: self.churn_before,
            commits_before: self.commits_before,
            done: false,
        }
    }
}

impl<E> fmt::Debug for RetryLoop<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.state {
            LoopState::Full(l) => l.fmt(f),
            LoopState::Lazy(l) => f
                .debug_struct("RetryLoop")
                .field("site", &l.site)
                .field("plan", &l.plan)
                .field("retries", &0)
                .finish_non_exhaustive(),
        }
    }
}

impl<E> RetryLoop<E> {
    pub(super) fn full(l: FullLoop<E>) -> Self {
        Self {
            state: LoopState::Full(Box::new(l)),
        }
    }

    /// The plan the next attempt must run (after the step ended: the plan of its last attempt).
    pub fn plan(&self) -> BatchPlan {
        match &self.state {
            LoopState::Full(l) => l.plan,
            LoopState::Lazy(l) => l.plan,
        }
    }

    /// Rows the next attempt must process (`plan().batch()`).
    pub fn batch(&self) -> usize {
        self.plan().batch()
    }

    /// The report so far.
    pub fn report(&self) -> &RetryReport {
        match &self.state {
            LoopState::Full(l) => &l.report,
            LoopState::Lazy(l) => l.report.get_or_init(|| Box::new(l.make_report())),
        }
    }
}

impl<E: IsOom + fmt::Display> RetryLoop<E> {
    /// Takes an attempt's result. `Break(Ok((value, report)))`: commit `value` now.
    /// `Continue`: the attempt did not count (its OOM, or another rank's); the cache was emptied
    /// and [`RetryLoop::plan`] is the plan to run next. `Break(Err(..))`: stop, commit nothing.
    /// Calling it again after a `Break` returns an error.
    pub fn next<G>(
        &mut self,
        result: Result<G, E>,
    ) -> ControlFlow<Result<(G, RetryReport), RetryError<E>>> {
        match self.next_value(result) {
            ControlFlow::Continue(()) => ControlFlow::Continue(()),
            ControlFlow::Break(Ok(v)) => ControlFlow::Break(Ok((v, self.report().clone()))),
            ControlFlow::Break(Err(e)) => ControlFlow::Break(Err(e)),
        }
    }

    /// [`RetryLoop::next`] without a copy of the report on success (it stays in
    /// [`RetryLoop::report`] and in [`last_report`](crate::retry::last_report)).
    pub fn next_value<G>(&mut self, result: Result<G, E>) -> ControlFlow<Result<G, RetryError<E>>> {
        let mut result = result;
        if let LoopState::Lazy(l) = &mut self.state {
            if l.elapsed.is_some() {
                return ControlFlow::Break(Err(RetryError::InvalidArgument(
                    "RetryLoop::next called after the step finished".into(),
                )));
            }
            // Thrash detection: the allocator churned during the attempt.
            let thrashed = thread_churn().since(&l.churn_before).any();
            result = match result {
                Ok(v) if !thrashed => {
                    // The usual step: nothing remembered, nothing to learn.
                    let elapsed = l
                        .engine
                        .inner
                        .clock
                        .now()
                        .saturating_duration_since(l.started);
                    l.elapsed = Some(elapsed);
                    l.report.take();
                    last_report::set_last_clean(l.site, l.mode, l.plan, elapsed);
                    return ControlFlow::Break(Ok(v));
                }
                other => other,
            };
            // An out-of-memory or an error (or the allocator thrashed): set the loop up as it
            // would have been, and go on from this attempt.
            let full = l.upgrade();
            self.state = LoopState::Full(Box::new(full));
        }
        let LoopState::Full(l) = &mut self.state else {
            unreachable!("set up above")
        };
        l.next(result)
    }
}
