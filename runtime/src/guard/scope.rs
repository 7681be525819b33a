//! The guard of one open scope of the device's accounting ([`crate::device::tracker`]): it
//! holds the device and closes the scope on drop. Shared by the memory guards.

use std::marker::PhantomData;
use std::panic::Location;
use std::sync::Arc;

use crate::device::tracker::{Scope, ScopeKind};
use crate::device::Device;

/// An open scope on a device; closes it on drop. Shared by the memory guards. Not `Send`: a
/// thread-scoped scope lives in the opening thread's stack and must close there.
pub(crate) struct ScopeGuard {
    device: Device,
    pub scope: Arc<Scope>,
    wide: bool,
    _not_send: PhantomData<*const ()>,
}

impl ScopeGuard {
    /// Opens a scope of `kind` on `device`, charged by the calling thread's allocations.
    pub fn open(device: &Device, kind: ScopeKind, opened_at: &'static Location<'static>) -> Self {
        let scope = device.tracker().open_scope(kind, opened_at);
        Self {
            device: device.clone(),
            scope,
            wide: false,
            _not_send: PhantomData,
        }
    }

    /// From now on, charged by the allocations of every thread.
    pub fn make_wide(&mut self) {
        if !self.wide {
            self.device.tracker().make_wide(&self.scope);
            self.wide = true;
        }
    }

    /// Whether it is charged by every thread's allocations.
    pub fn is_wide(&self) -> bool {
        self.wide
    }

    /// The device it is open on.
    pub fn device(&self) -> &Device {
        &self.device
    }
}

impl Drop for ScopeGuard {
    fn drop(&mut self) {
        self.device.tracker().close(&self.scope, self.wide);
    }
}
