//! A backend wrapper that counts the device calls the allocator makes, whatever the device: the
//! replay report's `backend_calls` on the simulated device and on a GPU alike.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use oomguard_runtime::backend::{Backend, BackendError, DevicePtr, EventId, MemInfo, StreamId};
use serde::Serialize;

/// `inner`, with a count of each segment call that succeeded.
#[derive(Debug)]
pub struct CountingBackend {
    inner: Arc<dyn Backend>,
    counts: [AtomicU64; 6],
}

const ALLOC: usize = 0;
const FREE: usize = 1;
const MAP: usize = 2;
const UNMAP: usize = 3;
const RESERVE: usize = 4;
const RELEASE: usize = 5;

impl CountingBackend {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn Backend>) -> Self {
        Self {
            inner,
            counts: Default::default(),
        }
    }

    /// The calls counted so far.
    pub fn calls(&self) -> BackendCalls {
        let c = |i: usize| self.counts[i].load(Ordering::Relaxed);
        BackendCalls {
            alloc_segment: c(ALLOC),
            free_segment: c(FREE),
            map: c(MAP),
            unmap: c(UNMAP),
            reserve: c(RESERVE),
            release: c(RELEASE),
            // counted by the allocator (`replay` fills them in)
            ..BackendCalls::default()
        }
    }

    fn count<T>(&self, which: usize, r: Result<T, BackendError>) -> Result<T, BackendError> {
        if r.is_ok() {
            self.counts[which].fetch_add(1, Ordering::Relaxed);
        }
        r
    }
}

impl Backend for CountingBackend {
    fn name(&self) -> String {
        self.inner.name()
    }
    fn ordinal(&self) -> usize {
        self.inner.ordinal()
    }
    fn mem_info(&self) -> Result<MemInfo, BackendError> {
        self.inner.mem_info()
    }
    fn granularity(&self) -> u64 {
        self.inner.granularity()
    }
    fn supports_growable(&self) -> bool {
        self.inner.supports_growable()
    }
    fn alloc_segment(&self, bytes: u64, stream: StreamId) -> Result<DevicePtr, BackendError> {
        self.count(ALLOC, self.inner.alloc_segment(bytes, stream))
    }
    fn free_segment(&self, ptr: DevicePtr, bytes: u64) -> Result<(), BackendError> {
        self.count(FREE, self.inner.free_segment(ptr, bytes))
    }
    fn reserve(&self, bytes: u64) -> Result<DevicePtr, BackendError> {
        self.count(RESERVE, self.inner.reserve(bytes))
    }
    fn release(&self, base: DevicePtr, bytes: u64) -> Result<(), BackendError> {
        self.count(RELEASE, self.inner.release(base, bytes))
    }
    fn map(&self, addr: DevicePtr, bytes: u64) -> Result<(), BackendError> {
        self.count(MAP, self.inner.map(addr, bytes))
    }
    fn unmap(&self, addr: DevicePtr, bytes: u64) -> Result<(), BackendError> {
        self.count(UNMAP, self.inner.unmap(addr, bytes))
    }
    fn unmap_keep(&self, addr: DevicePtr, bytes: u64) -> Result<(), BackendError> {
        self.count(UNMAP, self.inner.unmap_keep(addr, bytes))
    }
    fn release_spares(&self) -> Result<u64, BackendError> {
        self.inner.release_spares()
    }
    fn copy_to_device(&self, dst: DevicePtr, src: &[u8]) -> Result<(), BackendError> {
        self.inner.copy_to_device(dst, src)
    }
    fn copy_to_host(&self, dst: &mut [u8], src: DevicePtr) -> Result<(), BackendError> {
        self.inner.copy_to_host(dst, src)
    }
    fn memset_zero(&self, dst: DevicePtr, bytes: u64) -> Result<(), BackendError> {
        self.inner.memset_zero(dst, bytes)
    }
    fn check_request(&self, bytes: u64) -> Result<(), BackendError> {
        self.inner.check_request(bytes)
    }
    fn record_event(&self, stream: StreamId) -> Result<EventId, BackendError> {
        self.inner.record_event(stream)
    }
    fn event_done(&self, event: EventId) -> Result<bool, BackendError> {
        self.inner.event_done(event)
    }
    fn wait_event(&self, event: EventId) -> Result<(), BackendError> {
        self.inner.wait_event(event)
    }
    fn synchronize(&self) -> Result<(), BackendError> {
        self.inner.synchronize()
    }
    fn synchronize_streams(
        &self,
        streams: &[StreamId],
        calling: StreamId,
    ) -> Result<bool, BackendError> {
        self.inner.synchronize_streams(streams, calling)
    }
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        self.inner.as_any()
    }
}

/// Backend calls the allocator made during the replay.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct BackendCalls {
    /// Fixed segments obtained.
    pub alloc_segment: u64,
    /// Fixed segments returned.
    pub free_segment: u64,
    /// Page ranges mapped into growable segments.
    pub map: u64,
    /// Page ranges unmapped.
    pub unmap: u64,
    /// Address ranges reserved for growable segments.
    pub reserve: u64,
    /// Address ranges released.
    pub release: u64,
    /// Bytes of pages mapped, over all `map` calls (growable segments remapping free pages to
    /// where they are needed shows here: each byte is one page table update on a GPU).
    pub mapped_bytes: u64,
    /// Bytes of pages unmapped, over all `unmap` calls.
    pub unmapped_bytes: u64,
    /// Device-wide synchronisations (before unmapping, on `empty_cache`); on a GPU each one
    /// waits for all queued work. Not counted in [`BackendCalls::total`].
    pub synchronize: u64,
    /// Waits for the streams of pages being moved (growable segments under pressure), rather
    /// than for the whole device. Not counted in [`BackendCalls::total`].
    pub stream_synchronize: u64,
}

impl BackendCalls {
    /// All segment calls together (`synchronize` is not one).
    pub fn total(&self) -> u64 {
        self.alloc_segment + self.free_segment + self.map + self.unmap + self.reserve + self.release
    }
}
