//! oomguard keeps GPU training code alive through CUDA out-of-memory.
//!
//! This facade re-exports the runtime ([`oomguard_runtime`]) and the attribute macros
//! [`oom_retry`](macro@oom_retry), [`memory_budget`](macro@memory_budget),
//! [`leak_check`](macro@leak_check) and [`no_grad`](macro@no_grad), documented here with every
//! option.
//!
//! ```
//! use oomguard::{Device, ByteSize};
//! let dev = Device::sim(ByteSize::gib(1));
//! let buf = dev.zeros::<f32>(1024).unwrap();
//! assert_eq!(buf.len(), 1024);
//! ```
//!
//! # A training step: attempt and commit
//!
//! `#[oom_retry]` reruns the function's body after an out-of-memory, with a smaller plan. The
//! body is therefore the step's **attempt**: it may run several times and must change nothing
//! that lasts (it computes losses and gradients). The optimizer update is the **commit**, given
//! as `commit = |value| ...`: a closure of one parameter, the value the body returned. It runs
//! exactly once, after every micro-batch of one attempt succeeded, outside the attempt's guards
//! and after them (a `#[leak_check(action = error)]` of the attempt fails the step before the
//! commit). It is never rerun: an error inside it, an out-of-memory included, is the function's
//! error, and [`retry::last_report`] records it as the commit's
//! ([`retry::RetryReport::commit_error`]). The closure may use the function's parameters
//! (`self` included); the `batch = n` and `plan = p` parameters hold what the successful
//! attempt ran (a shrunk evaluation batch, the micro-batch plan), not what the caller passed, so
//! a commit that advances a cursor by `n` skips no rows. It returns the function's return type;
//! the body returns `Result<V, E>` with `V` the closure's parameter type and `E` the function's
//! error type.
//!
//! ```
//! use oomguard::{oom_retry, retry::BatchPlan, ByteSize, Device, Error};
//!
//! struct Model { dev: Device, data: Vec<f32>, param: f32, updates: u32 }
//!
//! impl Model {
//!     #[oom_retry(plan = plan, commit = |loss| self.apply(loss))]
//!     fn step(&mut self, plan: &BatchPlan) -> Result<f32, Error> {
//!         let mut loss = 0.0;
//!         for chunk in plan.chunks() {
//!             let x = self.dev.from_slice(&self.data[chunk.rows()])?;
//!             let _activations = self.dev.alloc::<u8>(chunk.len() << 20)?; // 1 MiB a row
//!             loss += chunk.weight_f32() * x.to_vec()?.iter().sum::<f32>() / chunk.len() as f32;
//!         }
//!         Ok(loss) // the batch's mean, whatever the split
//!     }
//!
//!     fn apply(&mut self, loss: f32) -> Result<f32, Error> {
//!         self.param -= 0.1 * loss; // the update: once per step
//!         self.updates += 1;
//!         Ok(loss)
//!     }
//! }
//!
//! let mut m = Model { dev: Device::sim(ByteSize::mib(64)), data: vec![2.0; 200], param: 1.0, updates: 0 };
//! let loss = m.step(&BatchPlan::whole(200)?)?; // 200 MiB of activations: split into micro-batches
//! assert_eq!(loss, 2.0);
//! assert!(oomguard::retry::last_report().unwrap().final_plan.num_chunks() > 1);
//! assert_eq!(m.updates, 1);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub use oomguard_runtime::*;

/// Retries the function after an out-of-memory with a smaller footprint.
///
/// The function must return a `Result` (written out, or an alias such as `io::Result<T>` or
/// `anyhow::Result<T>`) whose error type implements [`retry::IsOom`] and `Display`: oomguard's
/// [`Error`], `io::Error` (`?` converts oomguard's errors into it), `Box<dyn Error>`,
/// `anyhow::Error` with the `anyhow` feature, burn's `ExecutionError` with the `burn`
/// feature, or your own type (`Display` too: the retry report quotes each attempt's error).
/// Its body is the step's **attempt**: after an out-of-memory the attempt's locals are dropped,
/// caches emptied, and the body runs again from its start with a smaller plan. It must therefore
/// change nothing that lasts (parameters, optimizer state, a data iterator): put that in the
/// commit phase (`commit = ...`). Parameters are passed again to each attempt: `&T` as is,
/// `&mut T` reborrowed, by-value parameters cloned for every attempt, the first included (they
/// must be `Clone`; the body may consume them, so no attempt can have the original while a retry
/// might still need it: pass large data by reference). `async fn`s are supported; `const fn`s
/// and `self` by value are not.
///
/// # Options
///
/// | option | what it does |
/// |---|---|
/// | (none) | the same call again, once, after emptying the cache; then the error |
/// | `plan = p` | `p: BatchPlan` or `&BatchPlan`: on out-of-memory, one retry after emptying the cache, then the micro-batch is halved (gradient accumulation: every row still processed); remembered per device for the next call |
/// | `batch = n` | `n: usize`/`u64`/`u32`/`u16`/`u8`: for **evaluation** (grad mode off inside the function: `#[no_grad]`, or the caller's `no_grad`): after one retry the batch itself is halved — fewer rows are processed, the body sees the new `n`, and [`retry::last_report`] says how many (`final_plan.batch()` of `requested_batch`). A **training** step is never shrunk: it gets the one retry, then the error (use `plan =`) |
/// | `min = k` | the smallest micro-batch (`plan`) or batch (`batch`) tried (default 1) |
/// | `max_retries = k` | at most `k` retries per call (default 16; bare: 1) |
/// | `policy = expr` | a [`retry::RetryPolicy`] instead of the built-in ladder (`min` and `max_retries` still apply; plans larger than the one that failed are refused; at most [`retry::advanced::MAX_ATTEMPTS`] attempts whatever it says) |
/// | `remember = false` | start every call from the caller's plan (default `true`: from the plan that worked last time) |
/// | `persist = "plans.json"` | remember plans across runs in this JSON file (merged with other writers under a lock; a file that cannot be read or written is reported in every step's `memory_error`) |
/// | `commit = \|v\| expr` | the **commit phase**: runs once with the body's value after an attempt succeeded, never rerun (see below) |
/// | `crate = "path"` | the path of this crate when it is renamed in `Cargo.toml` |
///
/// The final error of a step that gave up carries the retry report where its type can
/// ([`Error::RetriesExhausted`], anyhow's context, an `io::Error` wrapper); the report of every
/// call that returned, failed or not, is in [`retry::last_report`] (cleared when a call
/// starts, so after a call whose attempt panicked it is `None`).
///
/// **Nested steps.** A step with a commit may be called from another retried function (or
/// from a [`retry::RetryEngine`] attempt). Once its commit has started, the update is applied:
/// an error after that point (in the commit, or later in the outer attempt) is never retried by
/// any outer layer, since a retry would apply the update again. The outer step fails at once
/// with that error, and its report's [`retry::RetryReport::nested_commit`] holds the inner
/// step's report (its `commit_error` included). The error is marked where its type can carry a
/// mark ([`retry::IsOom::after_commit`]: [`Error::AfterCommit`], an anyhow context, an
/// `io::Error` wrapper), so that `is_oom` says `false` for it.
///
/// Plans are remembered per function definition (`file:line name`, and per generic instance:
/// its type parameters, a method's `Self`, and its const parameters, which must be integers,
/// `bool` or `char`),
/// per device (the device the thread allocated on: name, ordinal, capacity), and per mode
/// (train/eval, as inside the function). [`remembered_plans`] lists them,
/// [`forget_remembered_plans`] forgets them. Accumulation is exact up to floating-point
/// summation order: an f32 mean over 100,000 rows split into 2 to 1,000 micro-batches
/// (`BatchPlan::new(100_000, k)`) differed from the unsplit one by at most 7.1e-6 relative on
/// rows valued `i % 101`, and 6.8e-6 on uniform random rows (measured 2026-11-29; not
/// bit-identical).
///
/// `#[memory_budget]`, `#[leak_check]` and `#[no_grad]` on the same function apply to each
/// attempt, in whatever order they are written.
///
/// ```
/// use oomguard::{no_grad, oom_retry, BatchPlan, ByteSize, Device, Error};
///
/// /// Accumulation: every row is processed, in micro-batches that fit.
/// #[oom_retry(plan = plan, min = 2, max_retries = 8)]
/// fn train(dev: &Device, plan: &BatchPlan) -> Result<usize, Error> {
///     let mut rows = 0;
///     for c in plan.chunks() {
///         rows += dev.alloc::<u8>(c.len() << 20)?.len() >> 20; // 1 MiB a row
///     }
///     Ok(rows)
/// }
///
/// /// Evaluation: the batch may shrink, and the caller learns the rows processed.
/// #[oom_retry(batch = rows, remember = false)]
/// #[no_grad]
/// fn infer(dev: &Device, rows: usize) -> Result<usize, Error> {
///     Ok(dev.alloc::<u8>(rows << 20)?.len() >> 20)
/// }
///
/// /// Bare: one retry after emptying the cache.
/// #[oom_retry]
/// fn load(dev: &Device) -> Result<(), Error> {
///     dev.alloc::<u8>(1 << 20)?;
///     Ok(())
/// }
///
/// let dev = Device::sim(ByteSize::mib(64));
/// assert_eq!(train(&dev, &BatchPlan::whole(100)?)?, 100);
/// assert_eq!(infer(&dev, 200)?, 50);
/// let r = oomguard::retry::last_report().unwrap();
/// assert_eq!((r.requested_batch, r.final_plan.batch()), (200, 50));
/// load(&dev)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// A custom policy, a persisted memory and a renamed crate:
///
/// ```
/// use oomguard as og;
/// use og::retry::{Accumulate, BatchPlan};
/// use og::{oom_retry, ByteSize, Device, Error};
///
/// #[oom_retry(plan = plan, policy = Accumulate::by(4).unwrap(), persist = "target/doc-plans.json", crate = "og")]
/// fn step(dev: &Device, plan: &BatchPlan) -> Result<usize, Error> {
///     let mut rows = 0;
///     for c in plan.chunks() {
///         rows += dev.alloc::<u8>(c.len() << 20)?.len() >> 20;
///     }
///     Ok(rows)
/// }
///
/// let dev = Device::sim(ByteSize::mib(64));
/// assert_eq!(step(&dev, &BatchPlan::whole(100)?)?, 100);
/// // the custom policy replaces the ladder: micro-batches of 25 at the first retry
/// assert_eq!(og::retry::last_report().unwrap().final_plan.micro_batch(), 25);
/// # let _ = std::fs::remove_file("target/doc-plans.json");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// The commit phase (`commit = |value| ...`) is described, with an example, in
/// [the crate documentation](crate#a-training-step-attempt-and-commit).
pub use oomguard_macros::oom_retry;

/// Runs the function inside a memory budget: its allocations on this thread, on every device,
/// may hold at most the budget at any time, counted in the allocator's block sizes (requests
/// are rounded up to 512 bytes at least, as the allocator does: a budget of "1 MB" =
/// 1,000,000 bytes refuses an allocation of exactly 1,000,000 bytes, whose block is 1,000,448);
/// an allocation beyond it fails with
/// [`Error::BudgetExceeded`] (an out-of-memory for [`retry::IsOom`]: under `#[oom_retry]` the
/// step goes straight to a smaller plan, since emptying the cache cannot help a budget).
///
/// | option | budget |
/// |---|---|
/// | `"2 GiB"` | a size literal (B, KiB, MiB, GiB, TiB, KB, MB, GB; not 0) |
/// | `bytes = expr` | an integer number of bytes or a [`ByteSize`], computed at each call (`bytes = self.budget`) |
/// | `fraction = 0.9` | a fraction in (0, 1] of each device's capacity |
/// | `crate = "path"` | the path of this crate when it is renamed |
///
/// Under `#[oom_retry]` the budget applies to each attempt; give it once.
///
/// ```
/// use oomguard::{memory_budget, ByteSize, Device, Error};
///
/// #[memory_budget("1 MiB")]
/// fn small(dev: &Device, bytes: usize) -> Result<(), Error> {
///     dev.alloc::<u8>(bytes)?;
///     Ok(())
/// }
///
/// struct Job { budget: ByteSize }
/// impl Job {
///     #[memory_budget(bytes = self.budget)]
///     fn run(&self, dev: &Device) -> Result<(), Error> {
///         dev.alloc::<u8>(2 << 20)?;
///         Ok(())
///     }
/// }
///
/// #[memory_budget(fraction = 0.5)]
/// fn half(dev: &Device) -> Result<(), Error> {
///     dev.alloc::<u8>(40 << 20)?; // 40 MiB of a 64 MiB card: over half
///     Ok(())
/// }
///
/// let dev = Device::sim(ByteSize::mib(64));
/// small(&dev, 512 << 10)?;
/// assert!(matches!(small(&dev, 2 << 20), Err(Error::BudgetExceeded(_))));
/// assert!(Job { budget: ByteSize::mib(1) }.run(&dev).is_err());
/// Job { budget: ByteSize::mib(4) }.run(&dev)?;
/// assert!(half(&dev).unwrap_err().is_oom());
/// # Ok::<(), Error>(())
/// ```
pub use oomguard_macros::memory_budget;

/// Checks that the function leaks no device memory: every buffer allocated on this thread
/// inside it and still alive when it returns is a leak, reported with the line that allocated
/// it and the function's name.
///
/// | option | what it does |
/// |---|---|
/// | `action = panic` | (default) panic with the report (while already panicking: logged, and printed to stderr without a `tracing` subscriber) |
/// | `action = warn` | log the report as a warning (printed to stderr when no `tracing` subscriber is installed) |
/// | `action = error` | the leak becomes the function's `Err` ([`Error::Leak`]; the function returns a `Result` whose error is `From<Error>`); its own error wins (except an out-of-memory error of an `#[oom_retry]` attempt, see below) |
/// | `allow = "4 KiB"` | tolerate leaks up to this many bytes |
/// | `crate = "path"` | the path of this crate when it is renamed |
///
/// Under `#[oom_retry]` the check covers each attempt; with a commit phase, a failed check
/// fails the step **before** the commit (no update is applied). With `action = error`, a leak
/// in an attempt that ran out of memory wins over the out-of-memory error: the step fails with
/// [`Error::Leak`] instead of being retried (the attempt kept memory alive, so it changed what
/// lasts, and the retry would have hidden the leak). The value the body hands to the
/// commit counts as the attempt's: keep gradient accumulators in state allocated before the
/// first step, or allow for them.
///
/// ```
/// use oomguard::{leak_check, ByteSize, Device, DeviceBuffer, Error};
///
/// #[leak_check(action = error, allow = "1 KiB")]
/// fn step(dev: &Device, cache: &mut Vec<DeviceBuffer<u8>>, keep: usize) -> Result<(), Error> {
///     let _scratch = dev.alloc::<u8>(1 << 20)?; // freed at the end: fine
///     cache.push(dev.alloc::<u8>(keep)?);      // kept alive: a leak beyond the allowance
///     Ok(())
/// }
///
/// #[leak_check(action = warn)]
/// fn tolerant(dev: &Device) -> Result<DeviceBuffer<u8>, Error> {
///     dev.alloc::<u8>(16) // returned: logged as a leak, not an error
/// }
///
/// let dev = Device::sim(ByteSize::mib(64));
/// let mut cache = Vec::new();
/// step(&dev, &mut cache, 512)?;
/// let Err(Error::Leak(report)) = step(&dev, &mut cache, 8192) else { panic!() };
/// assert_eq!(report.function, Some("step"));
/// let _kept = tolerant(&dev)?;
/// # Ok::<(), Error>(())
/// ```
pub use oomguard_macros::leak_check;

/// Runs the function with gradient tracking off (as PyTorch's `torch.no_grad()`), restored when
/// it returns or panics; takes only `crate = "path"`. Under `#[oom_retry]` it also makes the
/// step an evaluation (so `batch =` may shrink it, and its plans are remembered apart from
/// training's).
///
/// ```
/// use oomguard::{is_grad_enabled, no_grad};
///
/// #[no_grad]
/// fn evaluate() -> bool {
///     is_grad_enabled()
/// }
///
/// assert!(is_grad_enabled());
/// assert!(!evaluate());
/// assert!(is_grad_enabled());
/// ```
pub use oomguard_macros::no_grad;

/// A plan remembered by an `#[oom_retry]` function (see [`remembered_plans`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RememberedPlan {
    /// The `persist` file it is saved in (`None`: remembered in memory only: no `persist`, or
    /// the file could not be read or its last write failed, which every step's
    /// [`RetryReport::memory_error`](retry::RetryReport::memory_error) says).
    pub file: Option<&'static str>,
    /// Where it applies: the function (`file:line name`, with the generic instance in `<..>`),
    /// the device (name, ordinal, capacity) and the mode (train/eval) inside the function.
    pub key: retry::advanced::MemoryKey,
    /// The caps learned: the largest micro-batch (and, for evaluation, batch) known to work.
    pub limits: retry::advanced::Limits,
}

/// Every plan the `#[oom_retry]` functions of this process remember (those with
/// `remember = false` remember none), sorted by file and function.
///
/// ```
/// use oomguard::{oom_retry, BatchPlan, ByteSize, Device, Error};
///
/// #[oom_retry(plan = plan)]
/// fn step(dev: &Device, plan: &BatchPlan) -> Result<(), Error> {
///     for c in plan.chunks() {
///         dev.alloc::<u8>(c.len() << 20)?; // 1 MiB a row
///     }
///     Ok(())
/// }
///
/// let dev = Device::sim(ByteSize::mib(64));
/// step(&dev, &BatchPlan::whole(100)?)?;
/// let plans = oomguard::remembered_plans();
/// let mine = plans.iter().find(|p| p.key.site.ends_with(" step")).unwrap();
/// assert_eq!(mine.key.device.total_bytes, 64 << 20);
/// assert!(mine.limits.micro_batch.unwrap() <= 64);
/// oomguard::forget_remembered_plans()?;
/// assert!(oomguard::remembered_plans().is_empty());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn remembered_plans() -> Vec<RememberedPlan> {
    __private::remembered()
        .into_iter()
        .map(|(file, key, limits)| RememberedPlan { file, key, limits })
        .collect()
}

/// Forgets every plan the `#[oom_retry]` functions remember, and empties their `persist` files.
/// Returns the first error writing a file (every engine is cleared in memory regardless).
pub fn forget_remembered_plans() -> Result<(), retry::advanced::MemoryError> {
    __private::forget()
}

/// What the attribute macros' generated code calls: re-exports of the runtime's
/// `macro_support`, where the glue lives and is tested. Not public API: it may change in any
/// release (the macros, this crate and the runtime are released together).
#[doc(hidden)]
pub mod __private {
    pub use oomguard_runtime as runtime;
    pub use oomguard_runtime::guard::LeakAction;
    pub use oomguard_runtime::macro_support::{
        boxed_policy, budget, budget_bytes, clone_for_retry, forget, guarded, leak_check,
        leak_result, leak_result_of, leak_result_of_retried, leak_result_retried, no_grad,
        remembered, BatchInt, BudgetBytes, BudgetLimit, FnResult, GuardSpec, Retry, RetryConfig,
        RetryKind, Site, SiteCache,
    };
    pub use oomguard_runtime::macro_support::{
        ConstBool, ConstChar, ConstI128, ConstI16, ConstI32, ConstI64, ConstI8, ConstIsize,
        ConstU128, ConstU16, ConstU32, ConstU64, ConstU8, ConstUsize,
    };
}
