//! `HostBuffer<T>`: pinned host memory, freed on drop.

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

use bytemuck::Pod;
use cudarc::driver::{CudaStream, HostSlice, SyncOnDrop};

use crate::device::Device;
use crate::error::{Error, Result};

/// `len` elements of `T` in pinned (page-locked) host memory (`cuMemHostAlloc`), zeroed when
/// made; dereferences to a slice. Pass the buffer itself (`&host`, `&mut host`) as the host side
/// of cudarc copies: they then return once the copy is done (pinned memory makes the driver's
/// copies truly asynchronous). Freed
/// (`cuMemFreeHost`) on drop; its bytes count in [`crate::MemoryStats::pinned_bytes`].
pub struct HostBuffer<T> {
    device: Device,
    ptr: NonNull<T>,
    len: usize,
}

// SAFETY: the buffer owns its memory exclusively, like a `Vec<T>`; sending or sharing it is as
// safe as sending or sharing the elements.
unsafe impl<T: Send> Send for HostBuffer<T> {}
// SAFETY: as above: `&HostBuffer<T>` only gives `&[T]`.
unsafe impl<T: Sync> Sync for HostBuffer<T> {}

impl<T: Pod> HostBuffer<T> {
    pub(super) fn new(device: &Device, len: usize) -> Result<Self> {
        let backend = device.require_cuda("pinned")?;
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| Error::InvalidArgument(format!("{len} elements overflow a usize")))?;
        let ptr = if bytes == 0 {
            NonNull::dangling()
        } else {
            let p = backend.alloc_pinned(bytes)?;
            // SAFETY: `p` points to `bytes` writable bytes just allocated.
            unsafe { std::ptr::write_bytes(p.as_ptr(), 0, bytes) };
            // cuMemHostAlloc returns page-aligned memory, aligned for any `T`.
            debug_assert_eq!(p.as_ptr() as usize % std::mem::align_of::<T>(), 0);
            device.allocator().count_pinned(bytes as u64, true);
            p.cast::<T>()
        };
        Ok(Self {
            device: device.clone(),
            ptr,
            len,
        })
    }
}

impl<T> HostBuffer<T> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    fn bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }
}

impl<T> Deref for HostBuffer<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `ptr` points to `len` initialised (zeroed `Pod`) elements owned by `self`, or is
        // dangling and aligned with `len * size_of::<T>() == 0`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T> DerefMut for HostBuffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`, and `&mut self` makes the borrow exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T> Drop for HostBuffer<T> {
    fn drop(&mut self) {
        let bytes = self.bytes();
        if bytes == 0 {
            return;
        }
        let Some(backend) = self.device.cuda_backend() else {
            return; // unreachable: only CUDA devices make host buffers
        };
        // SAFETY: `ptr` came from `alloc_pinned` of this device's backend and is freed once,
        // here; `free_pinned` waits for asynchronous copies still queued.
        match unsafe { backend.free_pinned(self.ptr.cast()) } {
            Ok(()) => self.device.allocator().count_pinned(bytes as u64, false),
            Err(e) => tracing::error!(error = %e, "freeing pinned host memory failed"),
        }
    }
}

// Passing the buffer itself (not a slice of it) to cudarc's copies makes them wait for the copy
// before returning: pinned memory makes `cuMemcpy*Async` truly asynchronous.
impl<T> HostSlice<T> for HostBuffer<T> {
    fn len(&self) -> usize {
        self.len
    }
    unsafe fn stream_synced_slice<'a>(
        &'a self,
        stream: &'a CudaStream,
    ) -> (&'a [T], SyncOnDrop<'a>) {
        (self, SyncOnDrop::sync_stream(stream))
    }
    unsafe fn stream_synced_mut_slice<'a>(
        &'a mut self,
        stream: &'a CudaStream,
    ) -> (&'a mut [T], SyncOnDrop<'a>) {
        (self, SyncOnDrop::sync_stream(stream))
    }
}

impl<T> fmt::Debug for HostBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostBuffer")
            .field("len", &self.len)
            .field("elem", &std::any::type_name::<T>())
            .finish()
    }
}
