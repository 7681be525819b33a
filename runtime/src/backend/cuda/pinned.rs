//! Page-locked ("pinned") host memory: `cuMemHostAlloc` / `cuMemFreeHost`.

use std::ptr::NonNull;

use cudarc::driver::result;

use super::{driver_error, invalid, CudaBackend};
use crate::backend::BackendError;

impl CudaBackend {
    /// Allocates `bytes` (> 0) of pinned host memory, portable across contexts. Free it with
    /// [`CudaBackend::free_pinned`].
    pub(crate) fn alloc_pinned(&self, bytes: usize) -> Result<NonNull<u8>, BackendError> {
        if bytes == 0 {
            return Err(invalid("cuMemHostAlloc", "cannot allocate 0 bytes"));
        }
        self.bind("cuMemHostAlloc")?;
        // SAFETY: cuMemHostAlloc writes one host pointer; the memory is freed by `free_pinned`.
        let p =
            unsafe { result::malloc_host(bytes, cudarc::driver::sys::CU_MEMHOSTALLOC_PORTABLE) }
                .map_err(|e| driver_error("cuMemHostAlloc", e))?;
        NonNull::new(p.cast::<u8>())
            .ok_or_else(|| invalid("cuMemHostAlloc", "the driver returned a null pointer"))
    }

    /// Frees pinned host memory.
    ///
    /// # Safety
    /// `ptr` must come from [`CudaBackend::alloc_pinned`] of this backend, not be freed yet, and
    /// not be used afterwards. Pending asynchronous copies are waited for first.
    pub(crate) unsafe fn free_pinned(&self, ptr: NonNull<u8>) -> Result<(), BackendError> {
        self.bind("cuMemFreeHost")?;
        // An asynchronous copy queued on any stream may still read or write it.
        self.sync_all("cuMemFreeHost")?;
        // SAFETY: guaranteed by the caller (see above); no queued work is left.
        unsafe { result::free_host(ptr.as_ptr().cast()) }
            .map_err(|e| driver_error("cuMemFreeHost", e))
    }
}
