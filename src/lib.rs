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

/// Items the attribute macros' generated code calls. Not public API: it may change in any
/// release.
#[doc(hidden)]
#[path = "private.rs"]
pub mod __private;
