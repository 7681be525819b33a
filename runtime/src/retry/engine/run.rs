//! The ways to run a step: a closure ([`RetryEngine::run`]), a [`Step`]
//! ([`RetryEngine::run_step`]), or by hand ([`RetryEngine::begin`] and its kin, which make a
//! [`RetryLoop`]).

use std::fmt;
use std::ops::ControlFlow;
use std::panic::Location;
use std::sync::Arc;

use crate::retry::classify::IsOom;
use crate::retry::commit;
use crate::retry::last_report;
use crate::retry::memory::MemoryKey;
use crate::retry::result::{Retried, RetryError};
use crate::retry_report::{BatchPlan, RetryReport};
use crate::source::MemorySource;

use super::config::RetryEngine;
use super::retry_loop::{LazyLoop, LoopState, RetryLoop};
use super::site_memo::SiteMemo;
use super::step::{Attempt, ClosureAttempt, Step, StepAttempt};
use super::target::{thread_churn, Target};
use super::thread_device::{thread_device_epoch, thread_device_key};

impl RetryEngine {
    /// Runs `attempt` with a plan for `batch` rows until it succeeds, then `commit` with its value,
    /// once. On OOM the attempt's value is gone (its locals were dropped when it returned `Err`),
    /// the cache is emptied, and the attempt runs again from its start with the policy's next
    /// plan. Plans are remembered per call site: the next call starts from the plan that worked.
    #[track_caller]
    pub fn run<G, E, R>(
        &self,
        device: &(impl MemorySource + Clone),
        batch: usize,
        attempt: impl FnMut(&BatchPlan) -> Result<G, E>,
        commit: impl FnOnce(G) -> R,
    ) -> Result<Retried<R>, RetryError<E>>
    where
        E: IsOom + fmt::Display,
    {
        let site = Location::caller();
        let (g, report) = self.drive(site, device, batch, &mut ClosureAttempt(attempt))?;
        commit::note_commit();
        Ok(Retried {
            value: commit(g),
            report,
        })
    }

    /// Runs a [`Step`] for `batch` rows: `begin` + `micro_batch` per chunk until an attempt
    /// succeeds, then `commit` once.
    #[track_caller]
    pub fn run_step<S: Step>(
        &self,
        device: &(impl MemorySource + Clone),
        batch: usize,
        step: &mut S,
    ) -> Result<Retried<S::Output>, RetryError<S::Error>> {
        let site = Location::caller();
        let ((), report) = self.drive(site, device, batch, &mut StepAttempt(&mut *step))?;
        commit::note_commit();
        Ok(Retried {
            value: step.commit(),
            report,
        })
    }

    /// Starts a step by hand, as a loop: for macros and for code that cannot be a closure.
    /// [`RetryEngine::run`] and [`RetryEngine::run_step`] are built on it.
    ///
    /// ```
    /// # extern crate oomguard_runtime as oomguard; // as the facade re-exports it
    /// use std::ops::ControlFlow;
    /// use oomguard::retry::RetryEngine;
    /// use oomguard::{ByteSize, Device, Error};
    ///
    /// let dev = Device::sim(ByteSize::mib(64));
    /// let engine = RetryEngine::new();
    /// let mut lp = engine.begin::<Error>(&dev, 100).unwrap();
    /// let (rows, report) = loop {
    ///     let plan = lp.plan();
    ///     let attempt = (|| {
    ///         let mut rows = 0;
    ///         for c in plan.chunks() {
    ///             rows += dev.alloc::<u8>(c.len() << 20)?.len() >> 20;
    ///         }
    ///         Ok(rows)
    ///     })();
    ///     match lp.next(attempt) {
    ///         ControlFlow::Break(done) => break done.unwrap(),
    ///         ControlFlow::Continue(()) => {}
    ///     }
    /// };
    /// assert_eq!(rows, 100);
    /// assert!(report.retries() >= 1);
    /// ```
    #[track_caller]
    pub fn begin<E: IsOom + fmt::Display>(
        &self,
        device: &(impl MemorySource + Clone),
        batch: usize,
    ) -> Result<RetryLoop<E>, RetryError<E>> {
        let site = Location::caller();
        self.begin_at(
            format!("{}:{}:{}", site.file(), site.line(), site.column()),
            device,
            batch,
        )
    }

    /// [`RetryEngine::begin`] with an explicit call-site name (the memory key), e.g.
    /// `"src/train.rs:42 train_step"` from a macro.
    pub fn begin_at<E: IsOom + fmt::Display>(
        &self,
        site: impl Into<String>,
        device: &(impl MemorySource + Clone),
        batch: usize,
    ) -> Result<RetryLoop<E>, RetryError<E>> {
        let key = MemoryKey::at(site.into(), device, (self.inner.mode)());
        self.begin_on(key, Target::One(Arc::new(device.clone())), batch, None)
    }

    /// [`RetryEngine::begin_at`] for code that holds no [`Device`](crate::Device) (the attribute macros): an
    /// out-of-memory on any device counts, the cache of every live device ([`Device::all`](crate::Device::all)) is
    /// emptied before a retry, thrashing is watched through the allocator retries of this
    /// thread's allocations. Plans are remembered per device: the device this thread allocated
    /// on last ([`Device::last_used_on_thread`](crate::Device::last_used_on_thread); before the step for the lookup, after it for
    /// what is learned), its name, ordinal and capacity; [`DeviceKey::any`](crate::retry::DeviceKey::any)
    /// when the thread has allocated nothing yet. The step covers `start.batch()` rows in
    /// micro-batches no larger than `start`'s (the remembered plan may split them further).
    pub fn begin_any<E: IsOom + fmt::Display>(
        &self,
        site: impl Into<String>,
        start: BatchPlan,
    ) -> Result<RetryLoop<E>, RetryError<E>> {
        let key = MemoryKey {
            site: site.into(),
            device: thread_device_key(),
            mode: (self.inner.mode)(),
        };
        self.begin_on(key, Target::All, start.batch(), Some(start.micro_batch()))
    }

    /// [`RetryEngine::begin_any`] for a call site named by a `'static` string, with `memo`
    /// remembering between calls what the site's key looked like: while nothing is remembered
    /// for the site on this thread's device in this mode (no limits, no thrash streak, no plan
    /// file error) and the plan memory has not changed since that was checked
    /// ([`PlanMemory::generation`](crate::retry::PlanMemory::generation)), the first attempt starts without setting up the loop or
    /// building the memory key, and a first attempt that succeeds without allocator retries
    /// ends the step there (its report is made only when asked for; [`last_report`](crate::retry::last_report)
    /// has it). Anything else (an out-of-memory, an error, allocator retries) sets the loop up
    /// as [`RetryEngine::begin_any`] would have, and it goes on from that attempt. Use one memo
    /// per call site, engine and mode. Falls back to [`RetryEngine::begin_any`] for more than
    /// one rank and for a thread that allocated nothing on an oomguard device yet.
    pub fn begin_any_memo<E: IsOom + fmt::Display>(
        &self,
        site: &'static str,
        start: BatchPlan,
        memo: &SiteMemo,
    ) -> Result<RetryLoop<E>, RetryError<E>> {
        // a seeded engine's first plan is not the caller's: set the loop up
        let Some(epoch) = (self.inner.consensus.world_size() == 1
            && self.inner.start_from.is_none())
        .then(thread_device_epoch)
        .flatten() else {
            return self.begin_any(site, start);
        };
        let mode = (self.inner.mode)();
        {
            let mem = self.memory();
            if !memo.holds(mem.generation(), epoch, mode) {
                let key = MemoryKey {
                    site: site.to_string(),
                    device: thread_device_key(),
                    mode,
                };
                if !mem.is_pristine(&key) {
                    memo.forget();
                    drop(mem);
                    return self.begin_on(
                        key,
                        Target::All,
                        start.batch(),
                        Some(start.micro_batch()),
                    );
                }
                memo.set(mem.generation(), epoch, mode);
            }
        }
        last_report::clear_last_report();
        Ok(RetryLoop {
            state: LoopState::Lazy(LazyLoop {
                engine: self.clone(),
                site,
                mode,
                plan: start,
                started: self.inner.clock.now(),
                churn_before: thread_churn(),
                commits_before: commit::commits(),
                elapsed: None,
                report: std::sync::OnceLock::new(),
            }),
        })
    }

    fn drive<M: MemorySource + Clone, G, E: IsOom + fmt::Display>(
        &self,
        site: &Location<'_>,
        device: &M,
        batch: usize,
        work: &mut dyn Attempt<G, E>,
    ) -> Result<(G, RetryReport), RetryError<E>> {
        let site = format!("{}:{}:{}", site.file(), site.line(), site.column());
        let mut lp = self.begin_at(site, device, batch)?;
        loop {
            let plan = lp.plan();
            let result = work.attempt(&plan);
            match lp.next(result) {
                ControlFlow::Break(done) => {
                    if done.is_err() {
                        work.discard();
                    }
                    return done;
                }
                ControlFlow::Continue(()) => work.discard(),
            }
        }
    }
}
