//! The backend layer: the few primitive operations a device offers.
//!
//! A [`Backend`] knows nothing about caching: it hands out physical segments, reserves virtual
//! address ranges and maps physical pages into them, copies bytes, and reports free/total memory.
//! The caching allocator ([`crate::alloc`]) is the only caller. Addresses are plain `u64` device
//! addresses; the backend never hands out Rust references into device memory, so the allocator
//! core stays safe Rust.

#[cfg(feature = "cuda")]
pub mod cuda;
pub(crate) mod handle_runs;
pub mod sim;

use std::fmt;

/// A device address.
pub type DevicePtr = u64;

/// A stream handle as the backend knows it. `0` is the device's default stream.
///
/// Two tags let an interposer (oomguard-candle's allocator hook) name streams it does not own:
/// [`PER_THREAD_STREAM_TAG`] and [`RAW_STREAM_TAG`]. The allocator treats every id as opaque.
pub type StreamId = u64;

/// A [`StreamId`] with this bit set names the per-thread default stream (CUDA's
/// `CU_STREAM_PER_THREAD`) *of the thread that uses the id*; the low bits tell threads apart, so
/// that the allocator keeps each thread's blocks in their own pool (a block freed in one thread's
/// stream order is never handed to another thread's stream). A backend records an event for such
/// an id on the calling thread's per-thread stream, so only the owning thread (or a thread
/// freeing a block on its own stream) may use it.
pub const PER_THREAD_STREAM_TAG: StreamId = 1 << 63;

/// A [`StreamId`] with this bit set (and [`PER_THREAD_STREAM_TAG`] clear) is a raw `CUstream`
/// handle in the low bits that the backend has not registered; whoever uses the id keeps the
/// stream alive while it does (an interposer sees only handles, at the moment the stream's owner
/// allocates or frees on it).
pub const RAW_STREAM_TAG: StreamId = 1 << 62;

/// What went wrong in a backend call: out-of-memory, or anything else.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackendErrorKind {
    /// The device has no memory left for the request (`CUDA_ERROR_OUT_OF_MEMORY`).
    OutOfMemory,
    /// The device or driver is missing or failed to load.
    Unavailable,
    /// The call's arguments were wrong (a bug in the caller, or bad user input).
    InvalidArgument,
    /// Any other driver failure.
    Other,
}

/// An error from a backend call. `kind` tells out-of-memory apart from everything else.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{op}: {message}")]
pub struct BackendError {
    /// The kind of failure.
    pub kind: BackendErrorKind,
    /// The operation that failed, e.g. `"cuMemAlloc"` or `"map"`.
    pub op: &'static str,
    /// What the device said.
    pub message: String,
}

impl BackendError {
    /// An out-of-memory error from `op`.
    pub fn oom(op: &'static str, message: impl Into<String>) -> Self {
        Self {
            kind: BackendErrorKind::OutOfMemory,
            op,
            message: message.into(),
        }
    }
    /// An error of `kind` from `op`.
    pub fn new(kind: BackendErrorKind, op: &'static str, message: impl Into<String>) -> Self {
        Self {
            kind,
            op,
            message: message.into(),
        }
    }
    /// Whether this is an out-of-memory error.
    pub fn is_oom(&self) -> bool {
        self.kind == BackendErrorKind::OutOfMemory
    }
}

/// Free and total device memory, as `cuMemGetInfo` reports them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct MemInfo {
    /// Bytes the device could still hand out.
    pub free: u64,
    /// The device's capacity in bytes.
    pub total: u64,
}

/// An event recorded on a stream; completes when the stream's work before it is done.
pub type EventId = u64;

/// The primitive operations of a device.
///
/// Implementations: [`sim::SimDevice`] (simulated, for tests and CI) and, with the `cuda` feature,
/// the CUDA backend. All methods take `&self`: a backend is shared between threads and does its own
/// (coarse) locking; the allocator calls it only on its slow paths.
pub trait Backend: Send + Sync + fmt::Debug + 'static {
    /// A short name such as `"sim"` or `"NVIDIA H100 80GB HBM3"`.
    fn name(&self) -> String;
    /// The device ordinal shown in messages (`Device 0`).
    fn ordinal(&self) -> usize {
        0
    }
    /// Free and total memory of the device.
    fn mem_info(&self) -> Result<MemInfo, BackendError>;
    /// Page size of growable segments; every `map`/`unmap` is a multiple of it.
    fn granularity(&self) -> u64;
    /// Whether [`Backend::reserve`]/[`Backend::map`] are supported (growable segments).
    fn supports_growable(&self) -> bool;

    /// Allocates a physical segment of `bytes` (a multiple of 512). The range must not overlap
    /// any segment or reserved range of this backend that is still live: the allocator hands
    /// out blocks by address, so an overlap would make two buffers share memory. The allocator
    /// refuses such a range (a non-OOM [`BackendError`] naming both ranges; the range is not
    /// freed, since a backend that returned it might free the live one instead).
    fn alloc_segment(&self, bytes: u64, stream: StreamId) -> Result<DevicePtr, BackendError>;
    /// Frees a segment from [`Backend::alloc_segment`].
    fn free_segment(&self, ptr: DevicePtr, bytes: u64) -> Result<(), BackendError>;

    /// Reserves `bytes` of virtual address space (no memory behind it yet), overlapping no live
    /// segment or reservation of this backend (see [`Backend::alloc_segment`]).
    fn reserve(&self, bytes: u64) -> Result<DevicePtr, BackendError>;
    /// Releases an address range from [`Backend::reserve`]; all its pages must be unmapped.
    fn release(&self, base: DevicePtr, bytes: u64) -> Result<(), BackendError>;
    /// Backs `[addr, addr + bytes)` with new physical pages and makes them accessible. `addr` and
    /// `bytes` are multiples of [`Backend::granularity`]. Fails with out-of-memory when the device
    /// has no pages left; on failure nothing is mapped.
    fn map(&self, addr: DevicePtr, bytes: u64) -> Result<(), BackendError>;
    /// Maps `[addr, addr + bytes)` as [`Backend::map`] does, backing its first
    /// `bytes / handle * handle` bytes with physical handles of `handle` bytes each (a multiple
    /// of [`Backend::granularity`]) and the rest with pages. Fewer, larger handles make growing
    /// cheaper: a driver call costs about the same for a 2 MiB page as for a 20 MiB handle.
    /// The caller then unmaps such a handle only whole (PyTorch's expandable segments map 20 MiB
    /// handles in the large pool for the same reason). Default: [`Backend::map`], for backends
    /// that back every page separately and so can unmap any run of pages.
    fn map_handles(&self, addr: DevicePtr, bytes: u64, handle: u64) -> Result<(), BackendError> {
        let _ = handle;
        self.map(addr, bytes)
    }
    /// Unmaps and frees the physical pages behind `[addr, addr + bytes)`: any page-aligned run of
    /// pages mapped by [`Backend::map`], not necessarily with the same boundaries (a backend backs
    /// each page separately so that any subset can be returned), that cuts no handle of
    /// [`Backend::map_handles`] (an error otherwise, with nothing unmapped).
    fn unmap(&self, addr: DevicePtr, bytes: u64) -> Result<(), BackendError>;
    /// Unmaps `[addr, addr + bytes)` as [`Backend::unmap`] does, but keeps the physical pages
    /// (their handles) as *spares*: the next [`Backend::map`] backs its range with spares before
    /// it creates new pages, so moving pages costs an unmap and a map, not a release and a
    /// create as well. Spares still hold device memory; the allocator gives the unused ones back
    /// with [`Backend::release_spares`] before it returns. Default: [`Backend::unmap`] (no spare
    /// is kept).
    fn unmap_keep(&self, addr: DevicePtr, bytes: u64) -> Result<(), BackendError> {
        self.unmap(addr, bytes)
    }
    /// Frees every spare page kept by [`Backend::unmap_keep`]; returns their bytes.
    fn release_spares(&self) -> Result<u64, BackendError> {
        Ok(0)
    }

    /// Whether [`Backend::map_alias`] is supported: the same physical pages mapped at a second
    /// address (a step plan shared at page granularity needs it).
    fn supports_alias(&self) -> bool {
        false
    }
    /// Maps `[addr, addr + bytes)` (in a reserved range, unmapped) to the physical pages that
    /// back `[src, src + bytes)` (mapped by [`Backend::map`] or [`Backend::map_handles`]): the
    /// same memory at a second address, no new memory. Both ranges are whole pages. The alias
    /// must be unmapped with [`Backend::unmap_alias`] before `src`'s pages are unmapped.
    /// Default: unsupported.
    fn map_alias(&self, addr: DevicePtr, src: DevicePtr, bytes: u64) -> Result<(), BackendError> {
        let _ = (addr, src, bytes);
        Err(BackendError::new(
            BackendErrorKind::InvalidArgument,
            "map_alias",
            "this backend cannot map pages at a second address",
        ))
    }
    /// Unmaps `[addr, addr + bytes)`, whole aliases made by [`Backend::map_alias`]; the pages
    /// stay mapped at their own address.
    fn unmap_alias(&self, addr: DevicePtr, bytes: u64) -> Result<(), BackendError> {
        let _ = (addr, bytes);
        Err(BackendError::new(
            BackendErrorKind::InvalidArgument,
            "unmap_alias",
            "this backend cannot map pages at a second address",
        ))
    }

    /// Copies host bytes to device memory at `dst`.
    fn copy_to_device(&self, dst: DevicePtr, src: &[u8]) -> Result<(), BackendError>;
    /// Copies device memory at `src` into `dst`.
    fn copy_to_host(&self, dst: &mut [u8], src: DevicePtr) -> Result<(), BackendError>;
    /// Sets `bytes` bytes at `dst` to zero.
    fn memset_zero(&self, dst: DevicePtr, bytes: u64) -> Result<(), BackendError>;

    /// Called by the allocator for every allocation request before anything else, so that a
    /// backend can inject faults (the simulated device does). Real backends accept everything.
    fn check_request(&self, _bytes: u64) -> Result<(), BackendError> {
        Ok(())
    }

    /// Records an event on `stream` (for cross-stream reuse). Backends without streams return 0.
    fn record_event(&self, _stream: StreamId) -> Result<EventId, BackendError> {
        Ok(0)
    }
    /// Whether the event has completed. Backends without streams say yes. Once it has said yes the
    /// event is released and its id is not used again.
    fn event_done(&self, _event: EventId) -> Result<bool, BackendError> {
        Ok(true)
    }
    /// Waits until the event has completed, then releases it.
    fn wait_event(&self, _event: EventId) -> Result<(), BackendError> {
        Ok(())
    }
    /// Waits for all work on the device (before unmapping pages another stream may still use).
    fn synchronize(&self) -> Result<(), BackendError> {
        Ok(())
    }
    /// Waits for the work queued so far on each of `streams`, from a thread that allocates on
    /// `calling` (a per-thread stream id names the calling thread's stream only). Returns `true`
    /// when the backend synchronised the whole device instead (a stream it cannot wait for from
    /// this thread). Default: [`Backend::synchronize`], `true`.
    fn synchronize_streams(
        &self,
        _streams: &[StreamId],
        _calling: StreamId,
    ) -> Result<bool, BackendError> {
        self.synchronize().map(|()| true)
    }

    /// The backend as [`std::any::Any`], so that code which knows the concrete backend can reach
    /// it through a [`crate::Device`] (the CUDA backend's streams and context do). `None` by
    /// default.
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        None
    }
}
