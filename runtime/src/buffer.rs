//! `DeviceBuffer<T>`: an RAII handle to device memory, returned to the cache on drop, and the
//! `Device` methods that make one (`alloc`, `alloc_on`, `zeros`, `from_slice`).

use std::fmt;
use std::marker::PhantomData;

use bytemuck::Pod;

use crate::alloc::Allocation;
use crate::backend::{DevicePtr, StreamId};
use crate::device::Device;
use crate::error::{Error, Result};

/// `len` elements of `T` in device memory. Dropping it returns the memory to the allocator's
/// cache (not to the device: see [`Device::empty_cache`]). It keeps its [`Device`] alive.
///
/// ```
/// use oomguard_runtime::{Device, ByteSize};
/// let dev = Device::sim(ByteSize::gib(1));
/// let mut buf = dev.zeros::<u32>(4).unwrap();
/// buf.copy_from_slice(&[1, 2, 3, 4]).unwrap();
/// assert_eq!(buf.to_vec().unwrap(), [1, 2, 3, 4]);
/// assert_eq!(dev.stats().allocated_bytes.all.current, 512);
/// drop(buf);
/// assert_eq!(dev.stats().allocated_bytes.all.current, 0);
/// ```
pub struct DeviceBuffer<T> {
    device: Device,
    alloc: Allocation,
    len: usize,
    _elem: PhantomData<T>,
}

impl<T: Pod> DeviceBuffer<T> {
    pub(crate) fn from_parts(device: Device, alloc: Allocation, len: usize) -> Self {
        Self {
            device,
            // Kept as the lent-out copy, so that `*buf.allocation()` cannot free the buffer's
            // memory behind its back; `drop` frees through the owner's handle.
            alloc: alloc.borrowed(),
            len,
            _elem: PhantomData,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of data (`len * size_of::<T>()`).
    pub fn byte_len(&self) -> u64 {
        self.alloc.requested
    }

    /// The device address of the first element.
    pub fn device_ptr(&self) -> DevicePtr {
        self.alloc.ptr
    }

    /// The stream the buffer belongs to.
    pub fn stream(&self) -> StreamId {
        self.alloc.stream
    }

    /// The allocation behind the buffer (its block size, requested bytes). A copy of it names
    /// the allocation (for [`crate::CachingAllocator::record_stream`]) but cannot free it: the
    /// buffer does that when dropped.
    pub fn allocation(&self) -> &Allocation {
        &self.alloc
    }

    /// The device it lives on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Copies `data` (exactly `len` elements) into the buffer.
    pub fn copy_from_slice(&mut self, data: &[T]) -> Result<()> {
        self.check_len(data.len())?;
        Ok(self
            .device
            .backend()
            .copy_to_device(self.alloc.ptr, bytemuck::cast_slice(data))?)
    }

    /// Copies the buffer into `out` (exactly `len` elements).
    pub fn copy_to_slice(&self, out: &mut [T]) -> Result<()> {
        self.check_len(out.len())?;
        Ok(self
            .device
            .backend()
            .copy_to_host(bytemuck::cast_slice_mut(out), self.alloc.ptr)?)
    }

    /// The buffer's contents, copied to the host.
    pub fn to_vec(&self) -> Result<Vec<T>> {
        let mut v = vec![T::zeroed(); self.len];
        self.copy_to_slice(&mut v)?;
        Ok(v)
    }

    /// Marks the buffer as used by `stream` too: after it is dropped, its memory is not reused
    /// until the work queued on `stream` by then has finished (PyTorch's `record_stream`).
    pub fn record_stream(&self, stream: StreamId) -> Result<()> {
        self.device.allocator().record_stream(&self.alloc, stream)
    }

    fn check_len(&self, n: usize) -> Result<()> {
        if n != self.len {
            return Err(Error::InvalidArgument(format!(
                "length mismatch: buffer holds {} elements, slice has {n}",
                self.len
            )));
        }
        Ok(())
    }
}

// The typed constructors live with the buffer, so that the device (below) knows nothing of it.
impl Device {
    /// An uninitialised buffer of `len` elements on the default stream (its contents are
    /// whatever the memory held: zeros on a fresh simulated device).
    #[track_caller]
    pub fn alloc<T: Pod>(&self, len: usize) -> Result<DeviceBuffer<T>> {
        self.alloc_on(len, 0)
    }

    /// An uninitialised buffer of `len` elements on `stream`.
    #[track_caller]
    pub fn alloc_on<T: Pod>(&self, len: usize, stream: StreamId) -> Result<DeviceBuffer<T>> {
        let bytes = (len as u64)
            .checked_mul(std::mem::size_of::<T>() as u64)
            .ok_or_else(|| {
                Error::InvalidArgument(format!("{len} elements overflow a u64 of bytes"))
            })?;
        let a = self.alloc_raw(bytes, stream)?;
        Ok(DeviceBuffer::from_parts(self.clone(), a, len))
    }

    /// A buffer of `len` zeroed elements.
    #[track_caller]
    pub fn zeros<T: Pod>(&self, len: usize) -> Result<DeviceBuffer<T>> {
        let b = self.alloc::<T>(len)?;
        self.backend().memset_zero(b.device_ptr(), b.byte_len())?;
        Ok(b)
    }

    /// A buffer holding a copy of `data`.
    #[track_caller]
    pub fn from_slice<T: Pod>(&self, data: &[T]) -> Result<DeviceBuffer<T>> {
        let mut b = self.alloc::<T>(data.len())?;
        b.copy_from_slice(data)?;
        Ok(b)
    }
}

impl<T> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        // Through the device, so that the memory guards it was charged to are credited.
        if let Err(e) = self.device.free_raw(self.alloc.owned()) {
            // Cannot happen through the safe API (a buffer frees its own live allocation once).
            tracing::error!(error = %e, "freeing a device buffer failed");
        }
    }
}

impl<T> fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("ptr", &format_args!("{:#x}", self.alloc.ptr))
            .field("len", &self.len)
            .field("elem", &std::any::type_name::<T>())
            .finish()
    }
}
