//! The retry engine: runs a step with a plan; on out-of-memory drops what the attempt held,
//! empties the cache, asks the policy for a smaller plan and runs the step again from its start.
//!
//! See [the contract](crate::retry#the-contract) for what an attempt may do.

use std::fmt;
use std::ops::ControlFlow;
use std::panic::Location;
use std::path::Path;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicU64, AtomicU8};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::classify::IsOom;
use super::clock::{Clock, SystemClock};
use super::consensus::{Consensus, ConsensusError, SingleProcess};
use super::decision::{self, Facts, Outcome, Settled, Status, FATAL, MAX_ATTEMPTS, OK};
use super::memory::{Limits, MemoryError, MemoryKey, PlanMemory, StepMode};
use super::oom_request::OomRequest;
use super::plan::{BatchPlan, Chunk};
use super::policy::{training_policy, Pressure, RetryContext, RetryPolicy};
use super::report::{AttemptOutcome, AttemptRecord, Regrow, RetryReport};
use super::result::{FailedAttempt, Retried, RetryError};
use super::thrash::{Observed, SpeedAction, SpeedBook, ThrashDetector};
use crate::source::{Churn, MemorySource};
use crate::Device;

/// A training (or evaluation) step processed micro-batch by micro-batch; see the
/// [contract](crate::retry#the-contract).
///
/// ```
/// # extern crate oomguard_runtime as oomguard; // as the facade re-exports it
/// use oomguard::retry::{BatchPlan, Chunk, RetryEngine, Step};
/// use oomguard::{ByteSize, Device, Error};
///
/// struct MeanStep<'a> { data: &'a [f32], dev: Device, acc: f32, param: f32 }
/// impl Step for MeanStep<'_> {
///     type Error = Error;
///     type Output = f32;
///     fn begin(&mut self, _plan: &BatchPlan) -> Result<(), Error> { self.acc = 0.0; Ok(()) }
///     fn micro_batch(&mut self, c: &Chunk) -> Result<(), Error> {
///         let rows = self.dev.from_slice(&self.data[c.rows()])?; // device memory, freed on drop
///         let host = rows.to_vec()?;
///         self.acc += c.weight_f32() * host.iter().sum::<f32>() / c.len() as f32;
///         Ok(())
///     }
///     fn commit(&mut self) -> f32 { self.param -= self.acc; self.param }
/// }
///
/// let dev = Device::sim(ByteSize::gib(1));
/// let data = [1.0f32, 2.0, 3.0, 6.0];
/// let mut step = MeanStep { data: &data, dev: dev.clone(), acc: 0.0, param: 10.0 };
/// let out = RetryEngine::new().run_step(&dev, data.len(), &mut step).unwrap();
/// assert_eq!(out.value, 7.0);
/// ```
pub trait Step {
    /// The step's error; out-of-memory ones are retried.
    type Error: IsOom + fmt::Display;
    /// What the commit returns.
    type Output;
    /// Starts an attempt with `plan`: reset accumulated gradients here.
    fn begin(&mut self, _plan: &BatchPlan) -> Result<(), Self::Error> {
        Ok(())
    }
    /// Processes one micro-batch; add `chunk.weight()` × its gradients to the accumulator.
    fn micro_batch(&mut self, chunk: &Chunk) -> Result<(), Self::Error>;
    /// The attempt failed (here or on another rank): free what it accumulated, if you like.
    fn abort(&mut self) {}
    /// Applies the update. Called exactly once, after every micro-batch of an attempt succeeded.
    fn commit(&mut self) -> Self::Output;
}

/// The engine's view of an attempt: run it, or clean up after one that does not count.
trait Attempt<G, E> {
    fn attempt(&mut self, plan: &BatchPlan) -> Result<G, E>;
    fn discard(&mut self);
}

struct ClosureAttempt<F>(F);

impl<G, E, F: FnMut(&BatchPlan) -> Result<G, E>> Attempt<G, E> for ClosureAttempt<F> {
    fn attempt(&mut self, plan: &BatchPlan) -> Result<G, E> {
        (self.0)(plan)
    }
    fn discard(&mut self) {}
}

struct StepAttempt<'a, S>(&'a mut S);

impl<S: Step> Attempt<(), S::Error> for StepAttempt<'_, S> {
    fn attempt(&mut self, plan: &BatchPlan) -> Result<(), S::Error> {
        self.0.begin(plan)?;
        for c in plan.chunks() {
            self.0.micro_batch(&c)?;
        }
        Ok(())
    }
    fn discard(&mut self) {
        self.0.abort();
    }
}

type ModeHook = Arc<dyn Fn() -> StepMode + Send + Sync>;

/// Runs steps, retrying out-of-memory with smaller plans, and remembers what worked.
///
/// Cheap to clone; clones share the remembered plans.
///
/// ```
/// # extern crate oomguard_runtime as oomguard; // as the facade re-exports it
/// use oomguard::retry::RetryEngine;
/// use oomguard::{ByteSize, Device};
///
/// let dev = Device::sim(ByteSize::mib(64));
/// let engine = RetryEngine::new();
/// let mut weight = 0.0f32;
/// // 100 rows of 1 MiB activations do not fit in 64 MiB: the engine splits the batch.
/// let out = engine.run(&dev, 100, |plan| {
///     let mut grad = 0.0f32;
///     for chunk in plan.chunks() {
///         let acts = dev.zeros::<u8>(chunk.len() << 20)?; // freed at the end of the iteration
///         grad += chunk.weight_f32() * acts.len() as f32;
///     }
///     Ok::<_, oomguard::Error>(grad)
/// }, |grad| weight -= grad).unwrap();
/// assert!(out.report.retries() > 0);
/// assert_eq!(out.report.final_plan.batch(), 100);
/// assert!(out.report.final_plan.micro_batch() <= 64);
/// ```
#[derive(Clone)]
pub struct RetryEngine {
    /// One reference count to clone (a step's loop holds a clone).
    inner: Arc<EngineParts>,
}

#[derive(Clone)]
struct EngineParts {
    policy: Arc<dyn RetryPolicy>,
    memory: Arc<Mutex<PlanMemory>>,
    consensus: Arc<dyn Consensus>,
    mode: ModeHook,
    regrow_after: Option<u32>,
    thrash: Option<ThrashDetector>,
    /// Stop when each attempt starts with more memory allocated than the previous.
    stop_on_growth: bool,
    /// The micro-batch a step starts from when nothing is remembered for it.
    start_from: Option<usize>,
    /// The finder's report the seed came from (`start_from_finder`): a larger batch's own
    /// tensors shrink the micro-batch ([`super::FinderReport::micro_batch_for`]).
    start_finder: Option<Arc<super::FinderReport>>,
    /// Times attempts (reports, and the time per row that decides between plans that churn).
    clock: Arc<dyn Clock>,
    /// Times per row of plans that churned, and trials of smaller plans.
    speed: Arc<SpeedBook>,
}

impl fmt::Debug for RetryEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryEngine")
            .field("policy", &self.inner.policy)
            .field("consensus", &self.inner.consensus)
            .field("regrow_after", &self.inner.regrow_after)
            .field("thrash", &self.inner.thrash)
            .field("stop_on_growth", &self.inner.stop_on_growth)
            .field("start_from", &self.inner.start_from)
            .finish_non_exhaustive()
    }
}

impl Default for RetryEngine {
    fn default() -> Self {
        Self::new()
    }
}

/// Steps a regrow waits after the last change, by default.
pub const DEFAULT_REGROW_AFTER: u32 = 100;
/// Consecutive thrashing steps that make the engine move down, by default.
pub const DEFAULT_THRASH_WINDOW: u32 = 3;

impl RetryEngine {
    /// An engine with the [training policy](super::training_policy), plans remembered in memory
    /// only, one process, the step's mode taken from the thread's grad mode
    /// ([`StepMode::current`]: eval under `no_grad`/`inference_mode`), regrow after
    /// [`DEFAULT_REGROW_AFTER`] clean steps, thrash window [`DEFAULT_THRASH_WINDOW`].
    pub fn new() -> Self {
        Self {
            inner: Arc::new(EngineParts {
                policy: Arc::new(training_policy()),
                memory: Arc::new(Mutex::new(PlanMemory::in_memory())),
                consensus: Arc::new(SingleProcess),
                mode: Arc::new(StepMode::current),
                regrow_after: Some(DEFAULT_REGROW_AFTER),
                thrash: Some(ThrashDetector::new(DEFAULT_THRASH_WINDOW)),
                stop_on_growth: true,
                start_from: None,
                start_finder: None,
                clock: Arc::new(SystemClock),
                speed: Arc::new(SpeedBook::default()),
            }),
        }
    }

    /// Uses `policy` to choose plans after an OOM.
    pub fn with_policy(mut self, policy: impl RetryPolicy + 'static) -> Self {
        Arc::make_mut(&mut self.inner).policy = Arc::new(policy);
        self
    }

    /// The policy that chooses plans after an OOM (e.g. to wrap it: `oomguard_candle::train_step`
    /// refuses plans that drop rows with [`KeepsRows`](super::KeepsRows)).
    pub fn policy(&self) -> Arc<dyn RetryPolicy> {
        self.inner.policy.clone()
    }

    /// Remembers plans in `path` (JSON), starting from what it holds.
    pub fn with_memory_file(mut self, path: impl AsRef<Path>) -> Result<Self, MemoryError> {
        Arc::make_mut(&mut self.inner).memory = Arc::new(Mutex::new(PlanMemory::open(path)?));
        Ok(self)
    }

    /// Uses `memory` (shared, e.g. between engines of several threads of one rank).
    pub fn with_memory(mut self, memory: Arc<Mutex<PlanMemory>>) -> Self {
        Arc::make_mut(&mut self.inner).memory = memory;
        self
    }

    /// Agrees on plans with other ranks through `consensus`.
    pub fn with_consensus(mut self, consensus: impl Consensus + 'static) -> Self {
        Arc::make_mut(&mut self.inner).consensus = Arc::new(consensus);
        self
    }

    /// Asks `hook` whether a step trains or evaluates when it starts (e.g. from the thread's
    /// grad mode): plans are remembered separately for each mode.
    pub fn with_mode_hook(mut self, hook: impl Fn() -> StepMode + Send + Sync + 'static) -> Self {
        Arc::make_mut(&mut self.inner).mode = Arc::new(hook);
        self
    }

    /// After `steps` clean steps at a site, try one size up (`None`: never).
    pub fn regrow_after(mut self, steps: Option<u32>) -> Self {
        Arc::make_mut(&mut self.inner).regrow_after = steps;
        self
    }

    /// Move down after `steps` consecutive thrashing steps (`None`: never). A step thrashes when
    /// the allocator churned during it ([`Churn`]: retried after freeing its cache, moved pages,
    /// synchronised streams). When the allocator retried, the engine moves to the next smaller
    /// plan at once; otherwise it tries that plan for one settling step and `steps` measured
    /// steps, and keeps the faster per row ([`RetryReport::speed`](super::RetryReport::speed)).
    pub fn thrash_window(mut self, steps: Option<u32>) -> Self {
        Arc::make_mut(&mut self.inner).thrash = steps.map(ThrashDetector::new);
        self
    }

    /// Times attempts with `clock` instead of the system's monotonic clock (for tests of the
    /// decisions made by time per row, with a [`ManualClock`](super::ManualClock)).
    #[doc(hidden)]
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        Arc::make_mut(&mut self.inner).clock = clock;
        self
    }

    /// Whether a step stops retrying once attempts started with more memory allocated than the
    /// one before twice ([`RetryReport::held_grew`]; default `true`). Each failed attempt's memory is dropped
    /// before the next one starts, so what is allocated when an attempt starts should not
    /// grow; when it does, the step keeps memory across attempts (a tensor pushed into a
    /// collection outside the attempt, a graph kept alive), every retry starts with less room,
    /// and shrinking the plan cannot win. The step then fails with
    /// [`StopReason::HeldGrew`](super::StopReason::HeldGrew), naming the bytes at each start
    /// ([`RetryReport::held_bytes`]). Other threads allocating on the same source between
    /// attempts look the same: turn this off (`false`) when they do; the growth is then still
    /// named in the report.
    ///
    /// ```
    /// use oomguard_runtime::retry::{RetryEngine, StopReason};
    /// use oomguard_runtime::{ByteSize, Device};
    /// let dev = Device::sim(ByteSize::mib(64));
    /// let mut kept = Vec::new(); // outlives the attempts: a leak
    /// let e = RetryEngine::new().run(&dev, 100, |plan| {
    ///     for c in plan.chunks() {
    ///         kept.push(dev.alloc::<u8>(c.len() << 20)?);
    ///     }
    ///     Ok::<_, oomguard_runtime::Error>(())
    /// }, |()| ()).unwrap_err();
    /// let report = e.report().unwrap();
    /// assert!(matches!(report.stopped, Some(StopReason::HeldGrew { .. })), "{report}");
    /// assert!(e.to_string().contains("a leak"), "{e}");
    /// ```
    pub fn stop_when_held_grows(mut self, on: bool) -> Self {
        Arc::make_mut(&mut self.inner).stop_on_growth = on;
        self
    }

    /// Starts every step with nothing remembered for it from `plan`'s micro-batch (at most
    /// `plan.micro_batch()` rows per chunk) instead of the whole batch: for instance the batch
    /// [`find_max_batch`](super::find_max_batch) found, so that the first step does not fail
    /// its way down to it ([`RetryEngine::start_from_finder`]). Opt-in; a step that starts from
    /// it says so in [`RetryReport::seeded`]. Limits remembered for a step (learned from an
    /// out-of-memory, or from a plan file) take precedence; a regrow after clean steps grows
    /// from the seed. `plan.batch()` is not used: every row of a step still runs.
    ///
    /// ```
    /// use oomguard_runtime::retry::{BatchPlan, RetryEngine};
    /// use oomguard_runtime::{ByteSize, Device};
    /// let dev = Device::sim(ByteSize::mib(64));
    /// let engine = RetryEngine::new().start_from(BatchPlan::with_micro_batch(32, 32).unwrap());
    /// let out = engine.run(&dev, 100, |plan| {
    ///     for c in plan.chunks() {
    ///         dev.alloc::<u8>(c.len() << 20)?; // 32 rows fit, 100 do not
    ///     }
    ///     Ok::<_, oomguard_runtime::Error>(())
    /// }, |()| ()).unwrap();
    /// assert_eq!(out.report.retries(), 0);
    /// assert_eq!(out.report.seeded, Some(32));
    /// assert_eq!(out.report.final_plan.num_chunks(), 4); // 100 rows as 4 × 25
    /// ```
    pub fn start_from(mut self, plan: BatchPlan) -> Self {
        let inner = Arc::make_mut(&mut self.inner);
        inner.start_from = Some(plan.micro_batch());
        inner.start_finder = None;
        self
    }

    /// [`RetryEngine::start_from`] the batch `found` reports
    /// ([`FinderReport::max_batch`](super::FinderReport::max_batch)): steps with nothing
    /// remembered start with micro-batches of at most that many rows. The finder measured the
    /// step it was given; a step that needs more memory (a larger model, another optimizer)
    /// still retries from there.
    ///
    /// When the finder ran the training step's own attempt (`find_max_batch_train` of the
    /// framework crates: [`FinderReport::batch_bytes_per_row`](super::FinderReport::batch_bytes_per_row)
    /// is set), a step of a larger batch starts from
    /// [`FinderReport::micro_batch_for`](super::FinderReport::micro_batch_for) its rows: the
    /// whole batch's tensors stay held while each micro-batch runs.
    pub fn start_from_finder(self, found: &super::FinderReport) -> Self {
        let rows = found.max_batch.max(1);
        let mut e = self.start_from(BatchPlan::whole(rows).expect("rows >= 1 gives a plan"));
        if found.batch_bytes_per_row.is_some() || found.accumulation_bytes.is_some() {
            Arc::make_mut(&mut e.inner).start_finder = Some(Arc::new(found.clone()));
        }
        e
    }

    /// The micro-batch steps with nothing remembered start from ([`RetryEngine::start_from`]).
    pub fn starts_from(&self) -> Option<usize> {
        self.inner.start_from
    }

    /// The remembered plans.
    pub fn memory(&self) -> MutexGuard<'_, PlanMemory> {
        self.inner.memory.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The limits remembered for the call site `site` (as in [`RetryReport::site`]) on `device`
    /// in the current mode.
    pub fn remembered(&self, site: &str, device: &(impl MemorySource + Clone)) -> Limits {
        let key = MemoryKey::at(site.to_string(), device, (self.inner.mode)());
        self.memory().limits(&key)
    }

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
        super::commit::note_commit();
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
        super::commit::note_commit();
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

    /// [`RetryEngine::begin_at`] for code that holds no [`Device`] (the attribute macros): an
    /// out-of-memory on any device counts, the cache of every live device ([`Device::all`]) is
    /// emptied before a retry, thrashing is watched through the allocator retries of this
    /// thread's allocations. Plans are remembered per device: the device this thread allocated
    /// on last ([`Device::last_used_on_thread`]; before the step for the lookup, after it for
    /// what is learned), its name, ordinal and capacity; [`DeviceKey::any`](super::DeviceKey::any)
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
    /// ([`PlanMemory::generation`]), the first attempt starts without setting up the loop or
    /// building the memory key, and a first attempt that succeeds without allocator retries
    /// ends the step there (its report is made only when asked for; [`last_report`](super::last_report)
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
        super::report::clear_last_report();
        Ok(RetryLoop {
            state: LoopState::Lazy(LazyLoop {
                engine: self.clone(),
                site,
                mode,
                plan: start,
                started: self.inner.clock.now(),
                churn_before: thread_churn(),
                commits_before: super::commit::commits(),
                elapsed: None,
                report: std::sync::OnceLock::new(),
            }),
        })
    }

    fn begin_on<E: IsOom + fmt::Display>(
        &self,
        key: MemoryKey,
        target: Target,
        batch: usize,
        micro_cap: Option<usize>,
    ) -> Result<RetryLoop<E>, RetryError<E>> {
        super::report::clear_last_report();
        if batch == 0 {
            // Other ranks wait for this rank in the starting agreement: take part, so that they
            // stop too instead of waiting forever.
            let mut v = [FATAL, 0, 0];
            let _ = self.agree(&mut v);
            return Err(RetryError::InvalidArgument(
                "a step of 0 rows: the batch must have at least one row".into(),
            ));
        }
        // A step starts: the source may serve a step that repeats from a fixed layout
        // (`MemorySource::mark_step`). Before the clock and the churn are read: what the mark
        // moves is the boundary's, not this step's.
        target.mark_step();
        let started = self.inner.clock.now();
        let mode = key.mode;

        // Starting plan: remembered limits (else the engine's seed), or one size up after
        // enough clean steps.
        let (limits, from_memory, seeded, mut regrow, memory_error) = {
            let mut mem = self.memory();
            let e = mem.entry(&key);
            let mut limits = e.limits;
            if mode == StepMode::Train && limits.batch.is_some() {
                // A training step never runs fewer rows than asked because of a remembered batch
                // cap (from a plan file, or a policy that shrank): only micro-batch caps apply.
                tracing::warn!(
                    target: "oomguard::retry",
                    site = %key.site,
                    limits = %limits,
                    "a remembered batch cap is ignored for a training step (it would drop rows)"
                );
                limits.batch = None;
            }
            let from_memory = limits != Limits::NONE;
            // Nothing remembered: the engine's seed stands for what would be.
            let seeded = self
                .inner
                .start_from
                .map(|m| {
                    self.inner
                        .start_finder
                        .as_ref()
                        .map_or(m, |f| f.micro_batch_for(batch))
                })
                .filter(|&m| !from_memory && m < batch && micro_cap.is_none_or(|c| m < c));
            if let Some(m) = seeded {
                limits.micro_batch = Some(m);
            }
            let mut regrow = None;
            if let Some(k) = self.inner.regrow_after {
                let wait = u64::from(k) << e.failed_regrows.min(16);
                if u64::from(e.clean_steps) >= wait {
                    e.clean_steps = 0;
                    regrow = limits.one_up(batch);
                }
            }
            (
                limits,
                from_memory,
                seeded,
                regrow,
                mem.error().map(str::to_string),
            )
        };
        let capped = |p: BatchPlan| match micro_cap {
            Some(m) if m < p.micro_batch() => {
                BatchPlan::with_micro_batch(p.batch(), m).unwrap_or(p)
            }
            _ => p,
        };
        let good = capped(limits.plan_for(batch).expect("batch >= 1 gives a plan"));
        let up = regrow.and_then(|l| l.plan_for(batch)).map(capped);
        if up == Some(good) {
            // the caller's micro-batch cap already binds: nothing to grow into
            regrow = None;
        }
        let mut plan = up.filter(|_| regrow.is_some()).unwrap_or(good);
        let (status, agreed) = self
            .agree_on(OK, plan, batch)
            .map_err(RetryError::Consensus)?;
        if status != OK {
            return Err(RetryError::Consensus(ConsensusError(
                "another rank cannot start this step (an empty batch): every rank stops".into(),
            )));
        }
        if agreed != plan {
            // Another rank starts smaller: no regrow this step.
            regrow = None;
            plan = agreed;
        }
        let report = RetryReport {
            from_memory,
            memory_error,
            // what the first attempt starts with (not synchronised: a step's start must not
            // wait for the device)
            held_bytes: vec![target.bytes().0],
            // the first plan is the seed's (not a regrow's, nor a smaller one another rank has)
            seeded: seeded.filter(|_| regrow.is_none() && plan == good),
            ..RetryReport::starting(key.site.clone(), mode, batch, plan)
        };
        Ok(RetryLoop::full(FullLoop {
            device_addr: Device::thread_device_addr(),
            engine: self.clone(),
            churn_before: target.churn(),
            target,
            key,
            batch,
            good,
            plan,
            regrow,
            regrow_plan: regrow.map(|_| plan),
            report,
            failures: Vec::new(),
            oom_count: 0,
            last_too_large: None,
            started,
            attempt_started: started,
            commits_before: super::commit::commits(),
            done: false,
        }))
    }

    fn agree(&self, values: &mut [u64; 3]) -> Result<(), ConsensusError> {
        if self.inner.consensus.world_size() > 1 {
            self.inner.consensus.all_reduce_max(values)?;
        }
        Ok(())
    }

    /// The worst status of every rank and the smallest plan (`status` and `plan` as they are
    /// with one process: nothing to agree with).
    fn agree_on(
        &self,
        status: Status,
        plan: BatchPlan,
        batch: usize,
    ) -> Result<(Status, BatchPlan), ConsensusError> {
        if self.inner.consensus.world_size() <= 1 {
            return Ok((status, plan));
        }
        let mut v = encode(status, &plan, batch);
        self.inner.consensus.all_reduce_max(&mut v)?;
        Ok((v[0], decode(&v, batch)))
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

/// What [`RetryEngine::begin_any_memo`] remembers about one call site between calls: the plan
/// memory's generation and the thread's device at which nothing was remembered for the site.
/// Read and written only under the plan memory's lock.
#[derive(Debug, Default)]
pub struct SiteMemo {
    generation: AtomicU64,
    device_epoch: AtomicU64,
    mode: AtomicU8,
}

impl SiteMemo {
    /// A memo that holds nothing.
    pub const fn new() -> Self {
        Self {
            generation: AtomicU64::new(0),
            device_epoch: AtomicU64::new(0),
            mode: AtomicU8::new(0),
        }
    }

    fn mode_code(mode: StepMode) -> u8 {
        match mode {
            StepMode::Train => 1,
            StepMode::Eval => 2,
        }
    }

    fn holds(&self, generation: u64, epoch: u64, mode: StepMode) -> bool {
        self.generation.load(Relaxed) == generation
            && self.device_epoch.load(Relaxed) == epoch
            && self.mode.load(Relaxed) == Self::mode_code(mode)
    }

    fn set(&self, generation: u64, epoch: u64, mode: StepMode) {
        self.generation.store(generation, Relaxed);
        self.device_epoch.store(epoch, Relaxed);
        self.mode.store(Self::mode_code(mode), Relaxed);
    }

    fn forget(&self) {
        self.generation.store(0, Relaxed);
    }
}

/// Identities of the devices threads allocated on, as cached by [`thread_device_key`]: a
/// number no other (thread, device) pair had.
static DEVICE_EPOCHS: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// This thread's device: its weak handle, key and epoch.
    static DEVICE_CACHE: std::cell::RefCell<Option<(crate::device::WeakDevice, super::memory::DeviceKey, u64)>> =
        const { std::cell::RefCell::new(None) };
}

/// The epoch of the device this thread allocated on last (`None`: none yet), cached with its
/// key: equal epochs mean equal device keys.
fn thread_device_epoch() -> Option<u64> {
    let addr = Device::thread_device_addr();
    if addr == 0 {
        return None;
    }
    let cached = || {
        DEVICE_CACHE
            .try_with(|c| {
                c.borrow()
                    .as_ref()
                    .filter(|(w, _, _)| w.addr() == addr && w.alive())
                    .map(|(_, _, e)| *e)
            })
            .ok()
            .flatten()
    };
    cached().or_else(|| {
        // fills the cache
        let _ = thread_device_key();
        cached()
    })
}

/// The device key of a step that holds no device: the device this thread allocated on last.
/// Cached per thread (the device's name is a string the backend builds); the cache holds a
/// weak handle, so the address cannot belong to another device while it is cached.
fn thread_device_key() -> super::memory::DeviceKey {
    use super::memory::DeviceKey;
    let addr = Device::thread_device_addr();
    if addr == 0 {
        // No oomguard allocation on this thread: code on another source (candle on a driver
        // pool). With exactly one such source, its device is the step's; otherwise "any".
        return match crate::source::registered().as_slice() {
            [one] => DeviceKey::of(&**one),
            _ => DeviceKey::any(),
        };
    }
    let cached = DEVICE_CACHE
        .try_with(|c| {
            c.borrow()
                .as_ref()
                .filter(|(w, _, _)| w.addr() == addr && w.alive())
                .map(|(_, k, _)| k.clone())
        })
        .ok()
        .flatten();
    if let Some(k) = cached {
        return k;
    }
    match Device::last_used_on_thread() {
        Some(d) => {
            let k = DeviceKey::of(&d);
            let epoch = DEVICE_EPOCHS.fetch_add(1, Relaxed);
            let _ = DEVICE_CACHE
                .try_with(|c| *c.borrow_mut() = Some((d.downgrade(), k.clone(), epoch)));
            k
        }
        None => DeviceKey::any(),
    }
}

/// The memory source(s) a step runs on.
#[derive(Clone, Debug)]
enum Target {
    One(Arc<dyn MemorySource>),
    /// Every live source (for code that holds none): every device and registered pool.
    All,
}

impl Target {
    fn sources(&self) -> Vec<Arc<dyn MemorySource>> {
        match self {
            Target::One(s) => vec![s.clone()],
            Target::All => crate::source::all(),
        }
    }
    /// The churn thrash detection watches: the source's, or for a step that holds none, the
    /// allocator retries this thread's allocations caused and the pages moved and
    /// synchronisations on the device this thread allocates on (another thread's device, busy
    /// as it may be, is not what the step uses).
    fn churn(&self) -> ChurnMark {
        match self {
            Target::One(s) => ChurnMark {
                device: 0,
                churn: s.churn(),
            },
            Target::All => thread_churn(),
        }
    }
    /// Marks a step's start on the source, or on the device this thread allocates on (not on
    /// every live source: another thread's loop marks its own).
    fn mark_step(&self) {
        match self {
            Target::One(s) => s.mark_step(),
            Target::All => {
                if let Some(d) = Device::last_used_on_thread() {
                    d.mark_step();
                }
            }
        }
    }
    /// Used and reserved bytes now (sources that cannot be read count 0).
    fn bytes(&self) -> (u64, u64) {
        self.sources().iter().fold((0, 0), |(a, r), s| {
            let u = s.usage().unwrap_or_default();
            (a + u.used, r + u.reserved)
        })
    }
    /// Bytes used now, after the device ran every queued free (each source synchronised; those
    /// that cannot be read count 0).
    fn held(&self) -> u64 {
        self.sources().iter().fold(0, |a, s| {
            if let Err(e) = s.synchronize() {
                tracing::warn!(target: "oomguard::retry", error = %e, source = %s.info(), "synchronize failed");
            }
            a + s.usage().map_or(0, |u| u.used)
        })
    }
    /// Empties the caches of the sources that want it after an out-of-memory
    /// ([`MemorySource::retry_empties_cache`]).
    fn empty_cache(&self) {
        for s in self.sources().iter().filter(|s| s.retry_empties_cache()) {
            if let Err(e) = s.empty_cache() {
                tracing::warn!(target: "oomguard::retry", error = %e, source = %s.info(), "empty_cache failed");
            }
        }
    }
}

/// The state of a loop set up in full (every step but a first attempt that ran without one).
struct FullLoop<E> {
    /// For a step that holds no device: the thread's device when its key was taken.
    device_addr: usize,
    engine: RetryEngine,
    target: Target,
    key: MemoryKey,
    batch: usize,
    good: BatchPlan,
    plan: BatchPlan,
    regrow: Option<Limits>,
    regrow_plan: Option<BatchPlan>,
    report: RetryReport,
    failures: Vec<FailedAttempt<E>>,
    oom_count: u32,
    /// The last failed attempt's request larger than the whole capacity, the bytes in use when
    /// it failed, and its plan.
    last_too_large: Option<(OomRequest, Option<u64>, BatchPlan)>,
    started: Instant,
    attempt_started: Instant,
    /// The churn counters when the attempt started.
    churn_before: ChurnMark,
    /// Commits on the thread when the attempt started: a commit during a failed attempt (of a
    /// step nested in it) makes the failure final ([`super::commit`]).
    commits_before: u64,
    done: bool,
}

/// A loop dropped before its step ended (a panic in the attempt, or a caller that stopped
/// driving it): the other ranks wait for this rank's next agreement, so it takes part as failed
/// and they stop with [`RetryError::PeerFailed`] instead of waiting forever.
impl<E> Drop for FullLoop<E> {
    fn drop(&mut self) {
        if !self.done && self.engine.inner.consensus.world_size() > 1 {
            self.done = true;
            let mut v = [FATAL, 0, 0];
            if let Err(e) = self.engine.agree(&mut v) {
                tracing::error!(target: "oomguard::retry", error = %e, "agreement failed while stopping");
            }
        }
    }
}

impl<E> fmt::Debug for FullLoop<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryLoop")
            .field("site", &self.key.site)
            .field("plan", &self.plan)
            .field("retries", &self.report.attempts.len())
            .finish_non_exhaustive()
    }
}

impl<E: IsOom + fmt::Display> FullLoop<E> {
    /// A policy's plan, if the engine may run it: the rows of the step at most, and no larger
    /// than the plan that failed (a policy that grows plans would never end). Anything else is
    /// logged and treated as giving up: the policy is not trusted to be right.
    fn checked(&self, next: BatchPlan, failed: BatchPlan) -> Option<BatchPlan> {
        let ok = next.batch() <= self.batch
            && next.batch() <= failed.batch()
            && next.micro_batch() <= failed.micro_batch();
        if !ok {
            tracing::error!(
                target: "oomguard::retry",
                site = %self.report.site,
                policy = ?self.engine.inner.policy,
                failed = %failed,
                proposed = %next,
                rows = self.batch,
                "the retry policy proposed a plan larger than the one that failed (or than the \
                 step's rows): giving up"
            );
            return None;
        }
        Some(next)
    }

    /// [`RetryLoop::next_value`] of a loop set up in full.
    fn next<G>(&mut self, result: Result<G, E>) -> ControlFlow<Result<G, RetryError<E>>> {
        if self.done {
            return ControlFlow::Break(Err(RetryError::InvalidArgument(
                "RetryLoop::next called after the step finished".into(),
            )));
        }
        // One clock read per attempt: its time and the step's.
        let now = self.engine.inner.clock.now();
        let elapsed = now.saturating_duration_since(self.attempt_started);
        let churn = self.target.churn().since(&self.churn_before);
        let plan = self.plan;
        // Set when this rank's out-of-memory was handled here: the bytes right after the
        // failure (cache emptied after reading them, unless a budget's).
        let mut at_failure = None;
        let mut too_large = None;
        // A step nested in the attempt committed: rerunning the attempt would commit it again.
        let nested_commit = result.is_err() && super::commit::commits() != self.commits_before;
        let outcome = match &result {
            Ok(_) => Outcome::Ok,
            Err(_) if nested_commit => Outcome::FailedAfterCommit,
            Err(e) if e.is_oom() => {
                self.oom_count += 1;
                let budget = e.is_budget_exceeded();
                at_failure = Some(self.target.bytes());
                if !budget {
                    self.target.empty_cache();
                }
                // what the next attempt starts with, its frees run
                self.report.held_bytes.push(self.target.held());
                too_large = e.oom_request().filter(OomRequest::exceeds_capacity);
                Outcome::Oom {
                    budget,
                    too_large,
                    in_use: e.oom_in_use(),
                }
            }
            Err(_) => Outcome::Failed,
        };
        let state = Facts {
            plan,
            batch: self.batch,
            good: self.good,
            regrowing: self.regrow.is_some(),
            oom_count: self.oom_count,
            held: &self.report.held_bytes,
            stop_on_growth: self.engine.inner.stop_on_growth,
            last_too_large: self.last_too_large,
        };
        let policy = &self.engine.inner.policy;
        let vote = decision::vote(outcome, &state, |ctx| {
            policy.next_plan(ctx).and_then(|p| self.checked(p, plan))
        });
        self.last_too_large = vote.last_too_large;
        if let Some(why) = &vote.stop {
            tracing::error!(
                target: "oomguard::retry",
                site = %self.report.site,
                "out of memory: {why}"
            );
            self.report.stopped = Some(why.clone());
        }
        if vote.exhausted {
            tracing::error!(
                target: "oomguard::retry",
                site = %self.report.site,
                "the policy retried {MAX_ATTEMPTS} times: giving up"
            );
        }
        let status = vote.status;
        let (agreed_status, next) = match self.engine.agree_on(status, vote.proposal, self.batch) {
            Ok(agreed) => agreed,
            Err(e) => {
                self.done = true;
                self.report.failure = Some(e.to_string());
                self.report.elapsed = now.saturating_duration_since(self.started);
                super::report::set_last_report(&self.report);
                return ControlFlow::Break(Err(RetryError::Consensus(e)));
            }
        };
        if matches!(self.target, Target::All) && Device::thread_device_addr() != self.device_addr {
            // What the attempt learned belongs to the device it allocated on.
            self.key.device = thread_device_key();
            self.device_addr = Device::thread_device_addr();
        }

        let settled = decision::settle(status, agreed_status);
        if settled == Settled::Commit {
            let Ok(value) = result else {
                unreachable!("status OK on all ranks means this rank succeeded")
            };
            self.done = true;
            self.report.final_plan = plan;
            if let Some(tried) = self.regrow_plan {
                if self.report.regrow.is_none() {
                    self.report.regrow = Some(Regrow {
                        tried,
                        succeeded: true,
                    });
                }
            }
            self.engine.after_success(
                &self.key,
                self.batch,
                &plan,
                &mut self.report,
                churn,
                elapsed,
                self.regrow,
            );
            self.report.elapsed = now.saturating_duration_since(self.started);
            super::report::set_last_report(&self.report);
            return ControlFlow::Break(Ok(value));
        }

        // The attempt does not count on any rank.
        let (allocated_bytes, reserved_bytes) = at_failure.unwrap_or_else(|| self.target.bytes());
        let (outcome, error_text, error) = match result {
            Ok(v) => {
                drop(v);
                (AttemptOutcome::PeerOom, None, None)
            }
            Err(e) => {
                let text = e.to_string();
                if settled == Settled::Fatal {
                    self.done = true;
                    self.report.final_plan = plan;
                    self.report.elapsed = now.saturating_duration_since(self.started);
                    let error = if nested_commit {
                        tracing::error!(
                            target: "oomguard::retry",
                            site = %self.report.site,
                            error = %e,
                            "the attempt failed after a nested step committed: not retried \
                             (a retry would apply its update again)"
                        );
                        let (seq, inner) = super::report::committed_since(self.commits_before)
                            .map_or((super::commit::commits(), None), |(s, r)| (s, Some(r)));
                        self.report.failure = Some(match &inner {
                            Some(_) => text,
                            // a commit noted by hand, without a report of its step
                            None => format!(
                                "a commit ran on this thread during the attempt, so it is not \
                                 retried: {text}"
                            ),
                        });
                        self.report.nested_commit = inner.map(Box::new);
                        super::report::set_last_report(&self.report);
                        // enclosing steps find this report, which holds the nested one
                        super::report::mark_last_committed(seq);
                        e.after_commit(&self.report)
                    } else {
                        self.report.failure = Some(text);
                        super::report::set_last_report(&self.report);
                        e
                    };
                    return ControlFlow::Break(Err(RetryError::Step {
                        error,
                        report: Box::new(self.report.clone()),
                    }));
                }
                (AttemptOutcome::Oom, Some(text), Some(e))
            }
        };
        let continuing = settled == Settled::Retry;
        self.report.attempts.push(AttemptRecord {
            plan,
            outcome,
            error: error_text.clone(),
            next: continuing.then_some(next),
            allocated_bytes,
            reserved_bytes,
            elapsed,
            too_large,
        });
        self.failures.push(FailedAttempt { plan, error });
        if at_failure.is_none() {
            // another rank's out-of-memory: empty this rank's cache too
            self.target.empty_cache();
        }
        if !continuing {
            self.done = true;
            self.report.final_plan = plan;
            self.report.elapsed = now.saturating_duration_since(self.started);
            super::report::set_last_report(&self.report);
            tracing::error!(
                target: "oomguard::retry",
                site = %self.report.site,
                attempts = self.failures.len(),
                plan = %plan,
                "out of memory: giving up"
            );
            let report = Box::new(self.report.clone());
            return ControlFlow::Break(Err(if settled == Settled::PeerFailed {
                RetryError::PeerFailed { report }
            } else {
                RetryError::GaveUp {
                    failures: std::mem::take(&mut self.failures),
                    report,
                }
            }));
        }
        tracing::warn!(
            target: "oomguard::retry",
            site = %self.report.site,
            attempt = self.report.attempts.len(),
            error = error_text.as_deref().unwrap_or("another rank ran out of memory"),
            old_plan = %plan,
            new_plan = %next,
            allocated_bytes,
            reserved_bytes,
            "out of memory: retrying with a smaller plan"
        );
        if let Some(tried) = self.regrow_plan {
            if self.report.regrow.is_none() {
                self.report.regrow = Some(Regrow {
                    tried,
                    succeeded: false,
                });
                self.regrow = None;
                self.engine.memory().entry(&self.key).failed_regrows += 1;
            }
        }
        self.plan = next;
        self.churn_before = self.target.churn();
        self.commits_before = super::commit::commits();
        self.attempt_started = now;
        ControlFlow::Continue(())
    }
}

/// One step in progress, driven by hand: run an attempt with [`RetryLoop::plan`], hand its
/// result to [`RetryLoop::next`], and repeat while it says `Continue`. Made by
/// [`RetryEngine::begin`]. Commit only after `next` returns `Break(Ok(..))`.
///
/// A loop made by [`RetryEngine::begin_any_memo`] may start without being set up: its first
/// attempt runs with the caller's plan, and the loop is set up only if that attempt fails (or
/// the allocator thrashed during it); what it does and reports is the same.
pub struct RetryLoop<E> {
    state: LoopState<E>,
}

enum LoopState<E> {
    /// The first attempt of a step with nothing remembered, not set up yet.
    Lazy(LazyLoop),
    Full(Box<FullLoop<E>>),
}

/// A first attempt started without a loop (see [`RetryEngine::begin_any_memo`]).
struct LazyLoop {
    engine: RetryEngine,
    site: &'static str,
    mode: StepMode,
    plan: BatchPlan,
    started: Instant,
    /// The churn counters when the attempt started.
    churn_before: ChurnMark,
    /// Commits on the thread when the attempt started ([`super::commit`]).
    commits_before: u64,
    /// The step ended: how long it took.
    elapsed: Option<std::time::Duration>,
    /// [`RetryLoop::report`], made when asked for.
    report: std::sync::OnceLock<Box<RetryReport>>,
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
    fn full(l: FullLoop<E>) -> Self {
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
    /// [`RetryLoop::report`] and in [`last_report`](super::last_report)).
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
                    super::report::set_last_clean(l.site, l.mode, l.plan, elapsed);
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

impl RetryEngine {
    /// Updates the remembered plan after a successful attempt: learned limits, regrow, thrash
    /// (`churn`: the allocator's during the attempt, `elapsed`: the attempt's time).
    #[allow(clippy::too_many_arguments)]
    fn after_success(
        &self,
        key: &MemoryKey,
        batch: usize,
        plan: &BatchPlan,
        report: &mut RetryReport,
        churn: Churn,
        elapsed: Duration,
        regrow: Option<Limits>,
    ) {
        report.churn = churn;
        let mut mem = self.memory();
        let e = mem.entry(key);
        let mut limits = e.limits;
        if let Some(up) = regrow {
            limits = up;
            e.failed_regrows = 0;
        }
        if !report.attempts.is_empty() {
            limits = limits.learned(plan, batch);
        }
        if report.attempts.is_empty() && regrow.is_none() {
            e.clean_steps = e.clean_steps.saturating_add(1);
        } else {
            e.clean_steps = 0;
        }
        if let Some(t) = self.inner.thrash {
            let tripped = t.observe_churn(&mut e.thrash_streak, &churn);
            let smaller = || {
                let ctx = RetryContext::new(*plan, batch, 1, Pressure::Thrash);
                self.inner.policy.next_plan(&ctx)
            };
            if tripped && churn.alloc_retries > 0 {
                // One allocation away from a hard OOM: move down now, whatever the speed.
                if let Some(smaller) = smaller() {
                    tracing::warn!(
                        target: "oomguard::retry",
                        site = %key.site,
                        old_plan = %plan,
                        new_plan = %smaller,
                        churn = %churn,
                        window = t.window(),
                        "allocator thrashing: moving to a smaller plan before a hard OOM"
                    );
                    limits = limits.learned(&smaller, batch);
                    report.thrash_moved_to = Some(smaller);
                    e.clean_steps = 0;
                    self.inner.speed.forget(key);
                }
            } else if self.inner.speed.wants(&churn) {
                let action = self.inner.speed.observe(Observed {
                    key,
                    plan: *plan,
                    per_row: super::thrash::per_row(elapsed, plan.batch()),
                    churn,
                    tripped,
                    limits,
                    smaller: if tripped { smaller() } else { None },
                    window: t.window(),
                });
                match action {
                    SpeedAction::None => {}
                    SpeedAction::Try(smaller, decision) => {
                        tracing::info!(
                            target: "oomguard::retry",
                            site = %key.site,
                            old_plan = %plan,
                            new_plan = %smaller,
                            churn = %churn,
                            window = t.window(),
                            "allocator churn in every step of the window: trying a smaller plan \
                             ({decision})"
                        );
                        limits = limits.learned(&smaller, batch);
                        report.thrash_moved_to = Some(smaller);
                        report.speed = Some(decision);
                        e.clean_steps = 0;
                    }
                    SpeedAction::Chose(decision, restore) => {
                        tracing::info!(
                            target: "oomguard::retry",
                            site = %key.site,
                            "plan chosen by time per row: {decision}"
                        );
                        if let Some(back) = restore {
                            limits = back;
                        }
                        report.speed = Some(decision);
                        e.clean_steps = 0;
                        e.thrash_streak = 0;
                    }
                    SpeedAction::Stayed(decision) => {
                        tracing::debug!(
                            target: "oomguard::retry",
                            site = %key.site,
                            "allocator churn, plan kept: {decision}"
                        );
                        report.speed = Some(decision);
                    }
                }
            }
        }
        if limits == e.limits {
            // nothing learned (the usual step): no second lookup, nothing to save
            return;
        }
        if let Err(err) = mem.set_limits(key, limits) {
            tracing::warn!(target: "oomguard::retry", error = %err, "could not save remembered plans");
            report.memory_error = Some(err.to_string());
        }
    }
}

/// A reading of the churn counters a step's thrash detection watches.
#[derive(Clone, Copy, Debug, Default)]
struct ChurnMark {
    /// The device read, for a step that holds none (0: the step's own source, or no device).
    device: usize,
    churn: Churn,
}

impl ChurnMark {
    /// The churn between `before` and this reading; of a device that changed in between, only
    /// the thread's allocator retries count (the other counters are another device's).
    fn since(&self, before: &ChurnMark) -> Churn {
        if self.device == before.device {
            self.churn.since(&before.churn)
        } else {
            Churn::retries(
                self.churn
                    .alloc_retries
                    .saturating_sub(before.churn.alloc_retries),
            )
        }
    }
}

/// The churn of a step that holds no device: the allocator retries this thread's allocations
/// caused (on any device), and the pages moved and synchronisations of the device this thread
/// allocated on last.
fn thread_churn() -> ChurnMark {
    let (device, mut churn) = match Device::last_used_on_thread() {
        Some(d) => (d.identity(), d.churn()),
        None => (0, Churn::default()),
    };
    churn.alloc_retries = crate::alloc::thread_alloc_retries();
    ChurnMark { device, churn }
}

/// `[status, u64::MAX - micro_batch, rows dropped]`: the max over ranks is the worst status and
/// the smallest micro-batch and batch.
fn encode(status: u64, plan: &BatchPlan, batch: usize) -> [u64; 3] {
    [
        status,
        u64::MAX - plan.micro_batch() as u64,
        (batch - plan.batch()) as u64,
    ]
}

fn decode(v: &[u64; 3], batch: usize) -> BatchPlan {
    let micro = (u64::MAX - v[1]).max(1) as usize;
    let rows = batch.saturating_sub(v[2] as usize).max(1);
    BatchPlan::with_micro_batch(rows, micro).expect("rows >= 1 and micro >= 1")
}
