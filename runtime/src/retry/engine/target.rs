//! The memory source(s) a step runs on, and the churn its thrash detection reads from them.

use std::sync::Arc;

use crate::source::{Churn, MemorySource};
use crate::Device;

/// The memory source(s) a step runs on.
#[derive(Clone, Debug)]
pub(super) enum Target {
    One(Arc<dyn MemorySource>),
    /// Every live source (for code that holds none): every device and registered pool.
    All,
}

impl Target {
    pub(super) fn sources(&self) -> Vec<Arc<dyn MemorySource>> {
        match self {
            Target::One(s) => vec![s.clone()],
            Target::All => crate::source::all(),
        }
    }
    /// The churn thrash detection watches: the source's, or for a step that holds none, the
    /// allocator retries this thread's allocations caused and the pages moved and
    /// synchronisations on the device this thread allocates on (another thread's device, busy
    /// as it may be, is not what the step uses).
    pub(super) fn churn(&self) -> ChurnMark {
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
    pub(super) fn mark_step(&self) {
        match self {
            Target::One(s) => s.mark_step(),
            Target::All => {
                if let Some(d) = Device::last_used_on_thread() {
                    d.mark_step();
                }
            }
        }
    }
    /// The sources a step's memory is read from (`bytes`, `held`): the step's own; for a step
    /// that holds none, the device this thread allocates on (none before its first allocation)
    /// and the registered sources. Not another thread's device: its allocations made a step
    /// here look as if it kept memory across attempts, and put that device's bytes in the
    /// report.
    fn measured(&self) -> Vec<Arc<dyn MemorySource>> {
        match self {
            Target::One(s) => vec![s.clone()],
            Target::All => {
                let mut v: Vec<Arc<dyn MemorySource>> = Device::last_used_on_thread()
                    .into_iter()
                    .map(|d| Arc::new(d) as Arc<dyn MemorySource>)
                    .collect();
                v.extend(crate::source::registered());
                v
            }
        }
    }
    /// Used and reserved bytes now (sources that cannot be read count 0).
    pub(super) fn bytes(&self) -> (u64, u64) {
        self.measured().iter().fold((0, 0), |(a, r), s| {
            let u = s.usage().unwrap_or_default();
            // saturating: a source may report u64::MAX for "unknown"
            (a.saturating_add(u.used), r.saturating_add(u.reserved))
        })
    }
    /// Bytes used now, after the device ran every queued free (each source synchronised; those
    /// that cannot be read count 0).
    pub(super) fn held(&self) -> u64 {
        self.measured().iter().fold(0, |a, s| {
            if let Err(e) = s.synchronize() {
                tracing::warn!(target: "oomguard::retry", error = %e, source = %s.info(), "synchronize failed");
            }
            a.saturating_add(s.usage().map_or(0, |u| u.used))
        })
    }
    /// Empties the caches of the sources that want it after an out-of-memory
    /// ([`MemorySource::retry_empties_cache`]).
    pub(super) fn empty_cache(&self) {
        for s in self.sources().iter().filter(|s| s.retry_empties_cache()) {
            if let Err(e) = s.empty_cache() {
                tracing::warn!(target: "oomguard::retry", error = %e, source = %s.info(), "empty_cache failed");
            }
        }
    }
}

/// A reading of the churn counters a step's thrash detection watches.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct ChurnMark {
    /// The device read, for a step that holds none (0: the step's own source, or no device).
    device: usize,
    churn: Churn,
}

impl ChurnMark {
    /// The churn between `before` and this reading; of a device that changed in between, only
    /// the thread's allocator retries count (the other counters are another device's).
    pub(super) fn since(&self, before: &ChurnMark) -> Churn {
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
pub(super) fn thread_churn() -> ChurnMark {
    let (device, mut churn) = match Device::last_used_on_thread() {
        Some(d) => (d.identity(), d.churn()),
        None => (0, Churn::default()),
    };
    churn.alloc_retries = crate::alloc::thread_alloc_retries();
    ChurnMark { device, churn }
}
