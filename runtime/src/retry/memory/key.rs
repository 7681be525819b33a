//! Where a plan is remembered: the call site, the device ([`DeviceKey`]) and the grad mode
//! ([`StepMode`]).

use std::panic::Location;

use serde::{Deserialize, Serialize};

use crate::retry_report::StepMode;
use crate::source::MemorySource;

// `current` reads the guards' grad mode, a layer above `StepMode` (plain data, which an
// `Error`'s report holds): it is implemented here, in the retry layer.
impl StepMode {
    /// The mode of the current thread: [`StepMode::Train`] while gradients are recorded
    /// ([`crate::is_grad_enabled`]), [`StepMode::Eval`] under `no_grad` or `inference_mode`.
    ///
    /// ```
    /// use oomguard_runtime::retry::advanced::StepMode;
    /// assert_eq!(StepMode::current(), StepMode::Train);
    /// let _g = oomguard_runtime::no_grad();
    /// assert_eq!(StepMode::current(), StepMode::Eval);
    /// ```
    pub fn current() -> StepMode {
        if crate::is_grad_enabled() {
            StepMode::Train
        } else {
            StepMode::Eval
        }
    }
}

/// The device part of a memory key: stable across restarts.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct DeviceKey {
    /// The device's name (e.g. `"NVIDIA H100 80GB HBM3"`, `"sim"`).
    pub name: String,
    /// The device ordinal.
    pub ordinal: usize,
    /// The device's capacity in bytes: a plan learned on a smaller card does not carry over.
    pub total_bytes: u64,
}

impl DeviceKey {
    /// The key of steps that run on any device (see `RetryEngine::begin_any`).
    pub fn any() -> Self {
        Self {
            name: "any".into(),
            ordinal: 0,
            total_bytes: 0,
        }
    }

    /// The key of `device`.
    pub fn of<S: MemorySource + ?Sized>(device: &S) -> Self {
        let info = device.info();
        Self {
            name: info.device_name,
            ordinal: info.ordinal,
            total_bytes: info.total_bytes,
        }
    }
}

/// Where a plan is remembered: call site × device × mode.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MemoryKey {
    /// The call site, `file:line:column` (from `#[track_caller]`).
    pub site: String,
    /// The device.
    pub device: DeviceKey,
    /// Train or eval.
    pub mode: StepMode,
}

impl MemoryKey {
    /// The key for a call at `site` on `device` in `mode`.
    pub fn new<S: MemorySource + ?Sized>(site: &Location<'_>, device: &S, mode: StepMode) -> Self {
        Self::at(
            format!("{}:{}:{}", site.file(), site.line(), site.column()),
            device,
            mode,
        )
    }

    /// The key for a call at the site named `site` on `device` in `mode`.
    pub fn at<S: MemorySource + ?Sized>(site: String, device: &S, mode: StepMode) -> Self {
        Self {
            site,
            device: DeviceKey::of(device),
            mode,
        }
    }
}
