//! [`SiteMemo`]: what a call site's first attempt may skip while nothing is remembered for it.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicU64, AtomicU8};

use crate::retry_report::StepMode;

/// What [`RetryEngine::begin_any_memo`](crate::retry::RetryEngine::begin_any_memo) remembers about one call site between calls: the plan
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

    pub(super) fn holds(&self, generation: u64, epoch: u64, mode: StepMode) -> bool {
        self.generation.load(Relaxed) == generation
            && self.device_epoch.load(Relaxed) == epoch
            && self.mode.load(Relaxed) == Self::mode_code(mode)
    }

    pub(super) fn set(&self, generation: u64, epoch: u64, mode: StepMode) {
        self.generation.store(generation, Relaxed);
        self.device_epoch.store(epoch, Relaxed);
        self.mode.store(Self::mode_code(mode), Relaxed);
    }

    pub(super) fn forget(&self) {
        self.generation.store(0, Relaxed);
    }
}
