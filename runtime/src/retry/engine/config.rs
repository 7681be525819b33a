//! [`RetryEngine`]: its parts, and the builder methods that set them.

use std::fmt;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::retry::clock::{Clock, SystemClock};
use crate::retry::consensus::{Consensus, SingleProcess};
use crate::retry::finder::FinderReport;
use crate::retry::memory::{Limits, MemoryError, MemoryKey, PlanMemory};
use crate::retry::policy::{training_policy, RetryPolicy};
use crate::retry::thrash::{SpeedBook, ThrashDetector};
use crate::retry_report::{BatchPlan, StepMode};
use crate::source::MemorySource;

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
    pub(super) inner: Arc<EngineParts>,
}

#[derive(Clone)]
pub(super) struct EngineParts {
    pub(super) policy: Arc<dyn RetryPolicy>,
    pub(super) memory: Arc<Mutex<PlanMemory>>,
    pub(super) consensus: Arc<dyn Consensus>,
    pub(super) mode: ModeHook,
    pub(super) regrow_after: Option<u32>,
    pub(super) thrash: Option<ThrashDetector>,
    /// Stop when each attempt starts with more memory allocated than the previous.
    pub(super) stop_on_growth: bool,
    /// The micro-batch a step starts from when nothing is remembered for it.
    pub(super) start_from: Option<usize>,
    /// The finder's report the seed came from (`start_from_finder`): a larger batch's own
    /// tensors shrink the micro-batch ([`crate::retry::FinderReport::micro_batch_for`]).
    pub(super) start_finder: Option<Arc<FinderReport>>,
    /// Times attempts (reports, and the time per row that decides between plans that churn).
    pub(super) clock: Arc<dyn Clock>,
    /// Times per row of plans that churned, and trials of smaller plans.
    pub(super) speed: Arc<SpeedBook>,
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
    /// An engine with the [training policy](crate::retry::training_policy), plans remembered in memory
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
    /// refuses plans that drop rows with [`KeepsRows`](crate::retry::advanced::KeepsRows)).
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

    /// After `steps` clean steps at a site, try one size up (`None`: never); the wait doubles
    /// after each failed try. `Some(0)` is read as `Some(1)`: a regrow always waits for one
    /// clean step (with no wait, a failed regrow would be tried again at once, an
    /// out-of-memory in every step).
    pub fn regrow_after(mut self, steps: Option<u32>) -> Self {
        Arc::make_mut(&mut self.inner).regrow_after = steps.map(|s| s.max(1));
        self
    }

    /// Move down after `steps` consecutive thrashing steps (`None`: never). A step thrashes when
    /// the allocator churned during it ([`Churn`](crate::source::Churn): retried after freeing its cache, moved pages,
    /// synchronised streams). When the allocator retried, the engine moves to the next smaller
    /// plan at once; otherwise it tries that plan for one settling step and `steps` measured
    /// steps, and keeps the faster per row ([`RetryReport::speed`](crate::retry::RetryReport::speed)).
    pub fn thrash_window(mut self, steps: Option<u32>) -> Self {
        Arc::make_mut(&mut self.inner).thrash = steps.map(ThrashDetector::new);
        self
    }

    /// Times attempts with `clock` instead of the system's monotonic clock (for tests of the
    /// decisions made by time per row, with a [`ManualClock`](crate::retry::ManualClock)).
    #[doc(hidden)]
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        Arc::make_mut(&mut self.inner).clock = clock;
        self
    }

    /// Whether a step stops retrying once attempts started with more memory allocated than the
    /// one before twice ([`RetryReport::held_grew`](crate::retry::RetryReport::held_grew); default `true`). Each failed attempt's memory is dropped
    /// before the next one starts, so what is allocated when an attempt starts should not
    /// grow; when it does, the step keeps memory across attempts (a tensor pushed into a
    /// collection outside the attempt, a graph kept alive), every retry starts with less room,
    /// and shrinking the plan cannot win. The step then fails with
    /// [`StopReason::HeldGrew`](crate::retry::StopReason::HeldGrew), naming the bytes at each start
    /// ([`RetryReport::held_bytes`](crate::retry::RetryReport::held_bytes)). Other threads allocating on the same source between
    /// attempts look the same: turn this off (`false`) when they do; the growth is then still
    /// named in the report.
    ///
    /// ```
    /// use oomguard_runtime::retry::{advanced::StopReason, RetryEngine};
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
    /// [`find_max_batch`](crate::retry::find_max_batch) found, so that the first step does not fail
    /// its way down to it ([`RetryEngine::start_from_finder`]). Opt-in; a step that starts from
    /// it says so in [`RetryReport::seeded`](crate::retry::RetryReport::seeded). Limits remembered for a step (learned from an
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
    /// ([`FinderReport::max_batch`](crate::retry::FinderReport::max_batch)): steps with nothing
    /// remembered start with micro-batches of at most that many rows. The finder measured the
    /// step it was given; a step that needs more memory (a larger model, another optimizer)
    /// still retries from there.
    ///
    /// When the finder ran the training step's own attempt (`find_max_batch_train` of the
    /// framework crates: [`FinderReport::batch_bytes_per_row`](crate::retry::FinderReport::batch_bytes_per_row)
    /// is set), a step of a larger batch starts from
    /// [`FinderReport::micro_batch_for`](crate::retry::FinderReport::micro_batch_for) its rows: the
    /// whole batch's tensors stay held while each micro-batch runs.
    pub fn start_from_finder(self, found: &FinderReport) -> Self {
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

    /// The limits remembered for the call site `site` (as in [`RetryReport::site`](crate::retry::RetryReport::site)) on `device`
    /// in the current mode.
    pub fn remembered(&self, site: &str, device: &(impl MemorySource + Clone)) -> Limits {
        let key = MemoryKey::at(site.to_string(), device, (self.inner.mode)());
        self.memory().limits(&key)
    }
}
