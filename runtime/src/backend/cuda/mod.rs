//! The CUDA backend: [`CudaBackend`], a [`Backend`] over the CUDA driver API through cudarc.
//!
//! - Fixed segments: `cuMemAlloc` / `cuMemFree`.
//! - Growable segments: `cuMemAddressReserve`, then `cuMemCreate` handles of a page
//!   (`cuMemGetAllocationGranularity`, 2 MiB on an H100 and an H200) or of the size
//!   [`Backend::map_handles`] asks for (20 MiB for the allocator's large maps), mapped with
//!   `cuMemMap` + `cuMemSetAccess`, so that any run of whole handles can be unmapped
//!   (`cuMemUnmap` + `cuMemRelease`) on its own.
//! - Streams: a [`StreamId`] is the raw `CUstream` handle value (0: the legacy default stream);
//!   streams other than 0 must be registered ([`CudaBackend::register_stream`]) before use.
//! - Events: `cuEventRecord` / `cuEventQuery` / `cuEventSynchronize` for cross-stream reuse.
//!
//! cudarc panics when the driver library cannot be loaded, so [`CudaBackend::new`] first probes
//! the library with `libloading` (`loader.rs`) and runs cudarc's set-up under `catch_unwind`.
#![allow(unsafe_code)] // FFI: every unsafe block calls the CUDA driver and says why it is sound

pub mod direct;
mod events;
pub(crate) mod loader;
mod pinned;
mod streams;
mod vmm;

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::{result, sys, CudaContext, CudaStream, DriverError};

use super::{
    Backend, BackendError, BackendErrorKind, DevicePtr, EventId, MemInfo, StreamId,
    PER_THREAD_STREAM_TAG, RAW_STREAM_TAG,
};
use events::EventTable;
use streams::StreamRegistry;
pub(crate) use vmm::device_location;
use vmm::PageTable;

/// CUDA's handle of the calling thread's per-thread default stream (`CU_STREAM_PER_THREAD`).
const CU_STREAM_PER_THREAD: usize = 0x2;

/// Page size used when the device cannot map pages (no virtual memory management).
const FALLBACK_GRANULARITY: u64 = 2 << 20;

/// Whether the CUDA driver library loads and has every entry point this backend calls. It does
/// not tell whether a GPU is present: [`CudaBackend::new`] does.
pub fn driver_available() -> bool {
    loader::probe().is_ok()
}

/// Turns a driver error into a [`BackendError`]; `CUDA_ERROR_OUT_OF_MEMORY` becomes
/// [`BackendErrorKind::OutOfMemory`].
pub(crate) fn driver_error(op: &'static str, e: DriverError) -> BackendError {
    use sys::CUresult as R;
    let kind = match e.0 {
        R::CUDA_ERROR_OUT_OF_MEMORY => BackendErrorKind::OutOfMemory,
        R::CUDA_ERROR_INVALID_VALUE | R::CUDA_ERROR_INVALID_HANDLE => {
            BackendErrorKind::InvalidArgument
        }
        R::CUDA_ERROR_NO_DEVICE
        | R::CUDA_ERROR_INVALID_DEVICE
        | R::CUDA_ERROR_NOT_INITIALIZED
        | R::CUDA_ERROR_DEINITIALIZED
        | R::CUDA_ERROR_SYSTEM_DRIVER_MISMATCH
        | R::CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE
        | R::CUDA_ERROR_NOT_SUPPORTED => BackendErrorKind::Unavailable,
        _ => BackendErrorKind::Other,
    };
    let name = e
        .error_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{:?}", e.0));
    let text = e
        .error_string()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    BackendError::new(kind, op, format!("{name} ({text})"))
}

fn invalid(op: &'static str, message: impl Into<String>) -> BackendError {
    BackendError::new(BackendErrorKind::InvalidArgument, op, message)
}

/// A CUDA device as a [`Backend`]. Usually made through [`crate::Device::cuda`]; make it directly
/// to combine it with a custom configuration ([`crate::Device::new`]).
///
/// Copies ([`Backend::copy_to_device`], [`Backend::copy_to_host`], [`Backend::memset_zero`])
/// synchronise the whole context before and after, so they are ordered with kernels on every
/// stream; launch kernels yourself (through cudarc) for asynchronous work.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    ordinal: usize,
    name: String,
    granularity: u64,
    vmm: bool,
    pages: PageTable,
    /// Fixed segments: address -> (bytes, stream they were allocated on).
    segments: Mutex<BTreeMap<DevicePtr, (u64, StreamId)>>,
    /// Segments come from the stream-ordered pool (cuMemAllocAsync / cuMemFreeAsync on their
    /// stream) instead of cuMemAlloc: `backend:cudaMallocAsync`.
    stream_ordered: bool,
    streams: StreamRegistry,
    events: EventTable,
}

impl fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaBackend")
            .field("ordinal", &self.ordinal)
            .field("name", &self.name)
            .field("granularity", &self.granularity)
            .field("growable", &self.vmm)
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every update under these locks is a single insert or remove, so a poisoned lock still
    // guards consistent data.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl CudaBackend {
    /// Opens CUDA device `ordinal` (retaining its primary context, as the CUDA runtime does).
    ///
    /// Fails with [`BackendErrorKind::Unavailable`] when the driver library cannot be loaded or
    /// has no device, and with [`BackendErrorKind::InvalidArgument`] when `ordinal` is out of
    /// range. Never panics, even without a driver.
    pub fn new(ordinal: usize) -> Result<Self, BackendError> {
        loader::probe()?;
        match std::panic::catch_unwind(|| Self::open(ordinal)) {
            Ok(r) => r,
            Err(panic) => {
                let what = crate::panic_text::panic_text(panic.as_ref()).unwrap_or("unknown panic");
                Err(BackendError::new(
                    BackendErrorKind::Unavailable,
                    "cuInit",
                    format!(
                        "the CUDA driver could not be used: {}",
                        what.replace('\n', " ")
                    ),
                ))
            }
        }
    }

    fn open(ordinal: usize) -> Result<Self, BackendError> {
        result::init().map_err(|e| driver_error("cuInit", e))?;
        let count = result::device::get_count().map_err(|e| driver_error("cuDeviceGetCount", e))?;
        let count = usize::try_from(count).unwrap_or(0);
        if ordinal >= count {
            return Err(invalid(
                "cuDeviceGet",
                format!("CUDA device {ordinal} does not exist ({count} device(s) present)"),
            ));
        }
        let ctx =
            CudaContext::new(ordinal).map_err(|e| driver_error("cuDevicePrimaryCtxRetain", e))?;
        let name = ctx.name().map_err(|e| driver_error("cuDeviceGetName", e))?;
        let vmm = ctx
            .attribute(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
            )
            .map_err(|e| driver_error("cuDeviceGetAttribute", e))?
            > 0;
        let granularity = if vmm {
            vmm::granularity(ctx.cu_device())?
        } else {
            FALLBACK_GRANULARITY
        };
        let backend = Self {
            ordinal,
            name,
            granularity,
            vmm,
            pages: PageTable::new(ctx.cu_device(), granularity),
            segments: Mutex::new(BTreeMap::new()),
            stream_ordered: false,
            streams: StreamRegistry::new(&ctx),
            events: EventTable::default(),
            ctx,
        };
        Ok(backend)
    }

    /// Takes segments from the device's stream-ordered memory pool (cuMemAllocAsync on the
    /// allocation's stream, cuMemFreeAsync on free, no synchronisation), as PyTorch's
    /// `backend:cudaMallocAsync` and cudarc's `CudaStream::alloc` do.
    pub fn with_stream_ordered_pool(mut self) -> Self {
        self.stream_ordered = true;
        self
    }

    /// The cudarc context (the device's primary context), to load modules and make streams.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The legacy default stream (stream id 0).
    pub fn default_stream(&self) -> Arc<CudaStream> {
        self.streams.default_stream()
    }

    /// Registers a cudarc stream of this device and returns its [`StreamId`] (its raw handle
    /// value; 0 for the default stream). The registry keeps the stream alive as long as the
    /// backend, so an id is never reused for another stream. Registering twice is harmless.
    pub fn register_stream(&self, stream: &Arc<CudaStream>) -> Result<StreamId, BackendError> {
        self.streams.register(&self.ctx, stream)
    }

    /// The cudarc stream of a registered [`StreamId`].
    pub fn stream(&self, id: StreamId) -> Result<Arc<CudaStream>, BackendError> {
        self.streams.get(id)
    }

    /// Pages currently mapped in growable segments.
    pub fn mapped_pages(&self) -> usize {
        self.pages.mapped_pages()
    }

    /// A diagnostic for the page size of growable segments: maps `bytes` of new device memory
    /// in physical handles of `handle_bytes` each (a multiple of [`Backend::granularity`]) into
    /// an address range of its own and unmaps it again, returning the wall times of the two
    /// halves. The allocator's own pages are not touched. `cli/benches/page_moves.rs`
    /// compares 2 MiB and 20 MiB handles with it (docs/BENCHMARKS.md has the figures).
    pub fn measure_map_cost(
        &self,
        bytes: u64,
        handle_bytes: u64,
    ) -> Result<(std::time::Duration, std::time::Duration), BackendError> {
        self.bind("measure_map_cost")?;
        self.pages.time_handles(bytes, handle_bytes)
    }

    /// Physical pages of growable segments created (`cuMemCreate`) and pages mapped from kept
    /// handles instead (a move that reused its pages), over the backend's life. A handle larger
    /// than a page ([`Backend::map_handles`]) counts its pages.
    pub fn page_counts(&self) -> (u64, u64) {
        self.pages.page_counts()
    }

    /// Makes this backend's context current on the calling thread (the allocator may be called
    /// from any thread). Unlike cudarc's `bind_to_thread`, it leaves cudarc's deferred error state
    /// alone.
    fn bind(&self, op: &'static str) -> Result<(), BackendError> {
        let cur = result::ctx::get_current().map_err(|e| driver_error(op, e))?;
        if cur != Some(self.ctx.cu_ctx()) {
            // SAFETY: the context is the device's primary context, retained by `self.ctx` for as
            // long as this backend lives.
            unsafe { result::ctx::set_current(self.ctx.cu_ctx()) }
                .map_err(|e| driver_error(op, e))?;
        }
        Ok(())
    }

    /// The raw handle a [`StreamId`] names: 0 (legacy default stream), a registered stream, the
    /// calling thread's per-thread default stream ([`PER_THREAD_STREAM_TAG`]) or a raw handle its
    /// user keeps alive ([`RAW_STREAM_TAG`]).
    fn raw_stream(&self, id: StreamId) -> Result<sys::CUstream, BackendError> {
        if id & PER_THREAD_STREAM_TAG != 0 {
            return Ok(CU_STREAM_PER_THREAD as sys::CUstream);
        }
        if id & RAW_STREAM_TAG != 0 {
            return Ok((id & !RAW_STREAM_TAG) as usize as sys::CUstream);
        }
        Ok(self.streams.get(id)?.cu_stream())
    }

    fn sync_all(&self, op: &'static str) -> Result<(), BackendError> {
        result::ctx::synchronize().map_err(|e| driver_error(op, e))
    }

    /// Runs `f` (a copy or memset of `[addr, addr + len)`) only when that range lies inside one
    /// live fixed segment or inside mapped pages of a growable range of this backend, holding the
    /// lock that keeps the memory from being freed until `f` returns. Any other address (host
    /// memory the driver can reach, another allocator's memory, freed memory) is an error: the
    /// safe copy methods cannot write outside this device's own allocations.
    fn with_own_range<R>(
        &self,
        op: &'static str,
        addr: DevicePtr,
        len: u64,
        f: impl FnOnce() -> Result<R, BackendError>,
    ) -> Result<R, BackendError> {
        let bad = || {
            invalid(
                op,
                format!("{len} bytes at {addr:#x} are not memory allocated by this device"),
            )
        };
        let end = addr.checked_add(len).ok_or_else(bad)?;
        let segs = lock(&self.segments);
        let in_segment = segs
            .range(..=addr)
            .next_back()
            .is_some_and(|(&base, &(size, _))| end <= base.saturating_add(size));
        if in_segment {
            return f();
        }
        drop(segs);
        self.pages
            .while_mapped(addr, end, f)
            .unwrap_or_else(|| Err(bad()))
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> String {
        self.name.clone()
    }
    fn ordinal(&self) -> usize {
        self.ordinal
    }
    fn mem_info(&self) -> Result<MemInfo, BackendError> {
        self.bind("cuMemGetInfo")?;
        let (free, total) = result::mem_get_info().map_err(|e| driver_error("cuMemGetInfo", e))?;
        Ok(MemInfo {
            free: free as u64,
            total: total as u64,
        })
    }
    fn granularity(&self) -> u64 {
        self.granularity
    }
    fn supports_growable(&self) -> bool {
        self.vmm
    }

    fn alloc_segment(&self, bytes: u64, stream: StreamId) -> Result<DevicePtr, BackendError> {
        let n = usize::try_from(bytes)
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| invalid("cuMemAlloc", format!("cannot allocate {bytes} bytes")))?;
        // The stream reaches cuMemAllocAsync: registered streams, 0 or a tagged id.
        let raw = if self.stream_ordered {
            Some(self.raw_stream(stream)?)
        } else {
            None
        };
        self.bind("cuMemAlloc")?;
        let mut ptr: sys::CUdeviceptr = 0;
        if let Some(raw) = raw {
            // SAFETY: `raw` is a live stream of this context (see `raw_stream`); cuMemAllocAsync
            // writes one pointer into `ptr`, freed by `free_segment`. Called through the library
            // handle, so an interposer of the symbol does not see oomguard's own segments.
            direct::check(unsafe { direct::mem_alloc_async(&mut ptr, n, raw) })
                .map_err(|e| driver_error("cuMemAllocAsync", e))?;
            lock(&self.segments).insert(ptr, (bytes, stream));
            return Ok(ptr);
        }
        // SAFETY: cuMemAlloc writes one device pointer into `ptr`; the memory is freed only by
        // `free_segment` (or on drop), after which the allocator no longer hands it out.
        direct::check(unsafe { direct::mem_alloc(&mut ptr, n) })
            .map_err(|e| driver_error("cuMemAlloc", e))?;
        lock(&self.segments).insert(ptr, (bytes, stream));
        Ok(ptr)
    }

    fn free_segment(&self, ptr: DevicePtr, bytes: u64) -> Result<(), BackendError> {
        let mut segs = lock(&self.segments);
        let Some(&(size, stream)) = segs.get(&ptr).filter(|(size, _)| *size == bytes) else {
            return Err(invalid(
                "cuMemFree",
                format!("no segment of {bytes} bytes at {ptr:#x}"),
            ));
        };
        debug_assert_eq!(size, bytes);
        self.bind("cuMemFree")?;
        if self.stream_ordered {
            let raw = self.raw_stream(stream)?;
            // SAFETY: `ptr` came from cuMemAllocAsync on `stream` and is freed once, in stream
            // order after the work queued on that stream.
            direct::check(unsafe { direct::mem_free_async(ptr, raw) })
                .map_err(|e| driver_error("cuMemFreeAsync", e))?;
            segs.remove(&ptr);
            return Ok(());
        }
        // Work queued on any stream may still use the segment.
        self.sync_all("cuMemFree")?;
        // SAFETY: `ptr` came from cuMemAlloc in `alloc_segment` and is freed once (it is removed
        // from `segments` below); all work that could use it has completed.
        direct::check(unsafe { direct::mem_free(ptr) })
            .map_err(|e| driver_error("cuMemFree", e))?;
        segs.remove(&ptr);
        Ok(())
    }

    fn reserve(&self, bytes: u64) -> Result<DevicePtr, BackendError> {
        if !self.vmm {
            return Err(invalid(
                "cuMemAddressReserve",
                "the device cannot map pages",
            ));
        }
        self.bind("cuMemAddressReserve")?;
        self.pages.reserve(bytes)
    }

    fn release(&self, base: DevicePtr, bytes: u64) -> Result<(), BackendError> {
        self.bind("cuMemAddressFree")?;
        self.pages.release(base, bytes)
    }

    fn map(&self, addr: DevicePtr, bytes: u64) -> Result<(), BackendError> {
        self.bind("cuMemMap")?;
        self.pages.map(addr, bytes)
    }

    fn map_handles(&self, addr: DevicePtr, bytes: u64, handle: u64) -> Result<(), BackendError> {
        self.bind("cuMemMap")?;
        self.pages.map_handles(addr, bytes, handle)
    }

    fn unmap(&self, addr: DevicePtr, bytes: u64) -> Result<(), BackendError> {
        self.bind("cuMemUnmap")?;
        self.pages.unmap(addr, bytes, false)
    }

    fn unmap_keep(&self, addr: DevicePtr, bytes: u64) -> Result<(), BackendError> {
        self.bind("cuMemUnmap")?;
        self.pages.unmap(addr, bytes, true)
    }

    fn release_spares(&self) -> Result<u64, BackendError> {
        self.bind("cuMemRelease")?;
        Ok(self.pages.release_spares())
    }

    fn supports_alias(&self) -> bool {
        true
    }

    fn map_alias(&self, addr: DevicePtr, src: DevicePtr, bytes: u64) -> Result<(), BackendError> {
        self.bind("cuMemMap")?;
        self.pages.map_alias(addr, src, bytes)
    }

    fn unmap_alias(&self, addr: DevicePtr, bytes: u64) -> Result<(), BackendError> {
        self.bind("cuMemUnmap")?;
        self.pages.unmap_alias(addr, bytes)
    }

    fn copy_to_device(&self, dst: DevicePtr, src: &[u8]) -> Result<(), BackendError> {
        if src.is_empty() {
            return Ok(());
        }
        self.bind("cuMemcpyHtoD")?;
        self.with_own_range("cuMemcpyHtoD", dst, src.len() as u64, || {
            self.sync_all("cuMemcpyHtoD")?;
            // SAFETY: `src` is a live host slice; `dst..dst+len` lies in a segment or mapped
            // pages of this backend (checked above), which stay allocated while the lock is held.
            unsafe { result::memcpy_htod_sync(dst, src) }
                .map_err(|e| driver_error("cuMemcpyHtoD", e))?;
            self.sync_all("cuMemcpyHtoD")
        })
    }

    fn copy_to_host(&self, dst: &mut [u8], src: DevicePtr) -> Result<(), BackendError> {
        if dst.is_empty() {
            return Ok(());
        }
        self.bind("cuMemcpyDtoH")?;
        let len = dst.len() as u64;
        self.with_own_range("cuMemcpyDtoH", src, len, || {
            self.sync_all("cuMemcpyDtoH")?;
            // SAFETY: `dst` is a live, exclusively borrowed host slice; `src..src+len` lies in
            // memory of this backend (checked above) that stays allocated while the lock is
            // held. The call returns when the bytes are in `dst`.
            unsafe { result::memcpy_dtoh_sync(dst, src) }
                .map_err(|e| driver_error("cuMemcpyDtoH", e))
        })
    }

    fn memset_zero(&self, dst: DevicePtr, bytes: u64) -> Result<(), BackendError> {
        if bytes == 0 {
            return Ok(());
        }
        let n = usize::try_from(bytes).map_err(|_| invalid("cuMemsetD8", "size too large"))?;
        self.bind("cuMemsetD8")?;
        self.with_own_range("cuMemsetD8", dst, bytes, || {
            self.sync_all("cuMemsetD8")?;
            // SAFETY: `dst..dst+n` lies in memory of this backend (checked above) that stays
            // allocated while the lock is held; only that memory is written.
            unsafe { result::memset_d8_sync(dst, 0, n) }
                .map_err(|e| driver_error("cuMemsetD8", e))?;
            self.sync_all("cuMemsetD8")
        })
    }

    fn record_event(&self, stream: StreamId) -> Result<EventId, BackendError> {
        let raw = self.raw_stream(stream)?;
        self.bind("cuEventRecord")?;
        self.events.record(raw)
    }

    fn event_done(&self, event: EventId) -> Result<bool, BackendError> {
        self.bind("cuEventQuery")?;
        self.events.done(event)
    }

    fn wait_event(&self, event: EventId) -> Result<(), BackendError> {
        self.bind("cuEventSynchronize")?;
        self.events.wait(event)
    }

    fn synchronize(&self) -> Result<(), BackendError> {
        self.bind("cuCtxSynchronize")?;
        self.sync_all("cuCtxSynchronize")
    }

    fn synchronize_streams(
        &self,
        streams: &[StreamId],
        calling: StreamId,
    ) -> Result<bool, BackendError> {
        // A stream is waited for alone when this thread can name it: the legacy stream, a
        // registered one, or the calling thread's own per-thread stream. Another thread's
        // per-thread stream, or a raw handle whose owner may have destroyed it, cannot be:
        // then the whole device.
        let own = |id: StreamId| {
            if id & PER_THREAD_STREAM_TAG != 0 {
                id == calling
            } else {
                id & RAW_STREAM_TAG == 0
            }
        };
        if !streams.iter().all(|&id| own(id)) {
            self.synchronize()?;
            return Ok(true);
        }
        let raws = streams
            .iter()
            .map(|&id| self.raw_stream(id))
            .collect::<Result<Vec<_>, _>>()?;
        self.bind("cuStreamSynchronize")?;
        for raw in raws {
            // SAFETY: `raw` is the legacy stream, a stream kept alive by the registry, or the
            // calling thread's per-thread default stream (see `raw_stream`).
            unsafe { result::stream::synchronize(raw) }
                .map_err(|e| driver_error("cuStreamSynchronize", e))?;
        }
        Ok(false)
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // Give everything back: buffers keep their device (and so this backend) alive, so none is
        // in use any more.
        if self.bind("drop").is_err() {
            return;
        }
        if let Err(e) = self.sync_all("cuCtxSynchronize") {
            tracing::warn!(error = %e, "synchronizing before dropping the CUDA backend failed");
        }
        self.events.destroy_all();
        self.pages.release_all();
        for (ptr, _) in std::mem::take(&mut *lock(&self.segments)) {
            // SAFETY: every segment left came from cuMemAlloc (or cuMemAllocAsync, which
            // cuMemFree also frees) and was not freed yet; the device is idle and no buffer of
            // this backend is alive.
            if let Err(e) = direct::check(unsafe { direct::mem_free(ptr) }) {
                tracing::warn!(error = %driver_error("cuMemFree", e), "freeing a segment on drop failed");
            }
        }
    }
}
