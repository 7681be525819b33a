//! CUDA events for cross-stream reuse: recorded on a stream when a block used there is freed,
//! queried (or waited for) before the block is reused, destroyed once complete.

use std::collections::HashSet;
use std::sync::Mutex;

use cudarc::driver::{result, sys, DriverError};

use super::{driver_error, invalid, lock};
use crate::backend::{BackendError, EventId};

/// Live events, by id (the `CUevent` handle's value).
#[derive(Debug, Default)]
pub(super) struct EventTable {
    live: Mutex<HashSet<EventId>>,
}

fn handle(id: EventId) -> sys::CUevent {
    id as usize as sys::CUevent
}

impl EventTable {
    /// Creates an event (no timing) and records it on `stream`.
    pub(super) fn record(&self, stream: sys::CUstream) -> Result<EventId, BackendError> {
        let ev = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| driver_error("cuEventCreate", e))?;
        // SAFETY: `ev` is a fresh event and `stream` a live stream of the current context (the
        // registry keeps registered streams alive; 0 and 0x2 are the default streams; a raw
        // tagged handle is kept alive by its user while it uses the id: `RAW_STREAM_TAG`).
        if let Err(e) = unsafe { result::event::record(ev, stream) } {
            // SAFETY: `ev` was created above and is used nowhere else.
            let _ = unsafe { result::event::destroy(ev) };
            return Err(driver_error("cuEventRecord", e));
        }
        let id = ev as usize as EventId;
        lock(&self.live).insert(id);
        Ok(id)
    }

    fn take(&self, op: &'static str, id: EventId) -> Result<(), BackendError> {
        if lock(&self.live).contains(&id) {
            Ok(())
        } else {
            Err(invalid(
                op,
                format!("event {id:#x} is not a live event of this device"),
            ))
        }
    }

    fn destroy(&self, id: EventId) {
        if lock(&self.live).remove(&id) {
            // SAFETY: the event is live (it was in the table) and removed from it, so it is
            // destroyed exactly once.
            if let Err(e) = unsafe { result::event::destroy(handle(id)) } {
                tracing::warn!(error = %driver_error("cuEventDestroy", e), "destroying an event failed");
            }
        }
    }

    /// Whether the event has completed; destroys it when it has (or when the query fails).
    pub(super) fn done(&self, id: EventId) -> Result<bool, BackendError> {
        self.take("cuEventQuery", id)?;
        // SAFETY: the event is live (checked above); events are destroyed only by this table.
        match unsafe { result::event::query(handle(id)) } {
            Ok(()) => {
                self.destroy(id);
                Ok(true)
            }
            Err(DriverError(sys::CUresult::CUDA_ERROR_NOT_READY)) => Ok(false),
            Err(e) => {
                self.destroy(id);
                Err(driver_error("cuEventQuery", e))
            }
        }
    }

    /// Waits for the event, then destroys it.
    pub(super) fn wait(&self, id: EventId) -> Result<(), BackendError> {
        self.take("cuEventSynchronize", id)?;
        // SAFETY: the event is live (checked above).
        let r = unsafe { result::event::synchronize(handle(id)) };
        self.destroy(id);
        r.map_err(|e| driver_error("cuEventSynchronize", e))
    }

    /// Destroys every live event (on drop).
    pub(super) fn destroy_all(&self) {
        let ids: Vec<EventId> = lock(&self.live).iter().copied().collect();
        for id in ids {
            self.destroy(id);
        }
    }
}
