//! A backend wrapper that counts the device calls the allocator makes, whatever the device: the
//! replay report's `backend_calls` on the simulated device and on a GPU alike.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use oomguard_runtime::backend::{Backend, BackendError, DevicePtr, EventId, MemInfo, StreamId};

use crate::replay::BackendCalls;

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
