//! Remembered plans: what worked at each call site, per device and per grad mode, optionally
//! persisted to a JSON file so a restarted run starts from the known-good plan.

mod file;
mod key;
mod limits;
mod lock;
mod store;
#[cfg(test)]
mod tests;

pub use file::MemoryError;
pub use key::{DeviceKey, MemoryKey};
pub use limits::Limits;
pub use lock::{LOCK_WAIT, STALE_LOCK};
pub(crate) use store::Entry;
pub use store::PlanMemory;
