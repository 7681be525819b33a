//! oomguard keeps GPU training code alive through CUDA out-of-memory.
//!
//! This facade re-exports the runtime ([`oomguard_runtime`]) and the attribute macros
//! ([`oomguard_macros`]).
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
//! (`self` included) and returns the function's return type; the body returns
//! `Result<V, E>` with `V` the closure's parameter type and `E` the function's error type.
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

#[allow(unused_imports)] // the macros crate is empty until the macros land
pub use oomguard_macros::*;
pub use oomguard_runtime::*;

/// A plan remembered by an `#[oom_retry]` function (see [`remembered_plans`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RememberedPlan {
    /// The `persist` file it is saved in (`None`: remembered in memory only).
    pub file: Option<&'static str>,
    /// Where it applies: the function (`file:line name`, with the generic instance in `<..>`),
    /// the device (name, ordinal, capacity) and the mode (train/eval) inside the function.
    pub key: retry::MemoryKey,
    /// The caps learned: the largest micro-batch (and, for evaluation, batch) known to work.
    pub limits: retry::Limits,
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
pub fn forget_remembered_plans() -> Result<(), retry::MemoryError> {
    __private::forget()
}

/// Items the attribute macros' generated code calls. Not public API: it may change in any
/// release.
#[doc(hidden)]
#[path = "private.rs"]
pub mod __private;
