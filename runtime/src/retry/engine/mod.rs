//! The retry engine: runs a step with a plan; on out-of-memory drops what the attempt held,
//! empties the cache, asks the policy for a smaller plan and runs the step again from its start.
//!
//! See [the contract](crate::retry#the-contract) for what an attempt may do.

mod agree;
mod config;
mod failure;
mod full_loop;
mod retry_loop;
mod run;
mod site_memo;
mod start;
mod step;
mod success;
mod target;
mod thread_device;

pub use config::{RetryEngine, DEFAULT_REGROW_AFTER, DEFAULT_THRASH_WINDOW};
pub use retry_loop::RetryLoop;
pub use site_memo::SiteMemo;
pub use step::Step;
