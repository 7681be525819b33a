//! cudarc interoperation of [`DeviceBuffer`]: a buffer is a kernel argument as it is, and its
//! views ([`DeviceBufferView`], [`DeviceBufferViewMut`]) implement cudarc's `DevicePtr` /
//! `DevicePtrMut`, which cudarc's copy functions take.
//!
//! Stream order: a buffer belongs to its stream ([`DeviceBuffer::stream`]). Using a view on
//! another stream makes that stream wait for the work queued on the buffer's stream first; work
//! queued later on the other stream is the caller's to order (or to declare with
//! [`DeviceBuffer::record_stream`] before the buffer is dropped).

use std::marker::PhantomData;
use std::sync::Arc;

use bytemuck::Pod;
use cudarc::driver::{
    sys, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, LaunchArgs, PushKernelArg, SyncOnDrop,
};

use crate::buffer::DeviceBuffer;
use crate::error::Result;

/// A read-only cudarc view of a [`DeviceBuffer`] (like cudarc's `CudaView`): pass it where
/// cudarc wants a `DevicePtr` (the source of `memcpy_dtoh`, `clone_dtoh`, `memcpy_dtod`).
#[derive(Debug)]
pub struct DeviceBufferView<'a, T> {
    ptr: sys::CUdeviceptr,
    len: usize,
    stream: Arc<CudaStream>,
    _buf: PhantomData<&'a DeviceBuffer<T>>,
}

/// A mutable cudarc view of a [`DeviceBuffer`] (like cudarc's `CudaViewMut`): pass it where
/// cudarc wants a `DevicePtrMut` (the destination of `memcpy_htod`, `memset_zeros`, ...).
#[derive(Debug)]
pub struct DeviceBufferViewMut<'a, T> {
    ptr: sys::CUdeviceptr,
    len: usize,
    stream: Arc<CudaStream>,
    _buf: PhantomData<&'a mut DeviceBuffer<T>>,
}

impl<T: Pod> DeviceBuffer<T> {
    /// A read-only cudarc view. Fails when the buffer is not on a CUDA device.
    pub fn cuda_view(&self) -> Result<DeviceBufferView<'_, T>> {
        Ok(DeviceBufferView {
            ptr: self.device_ptr(),
            len: self.len(),
            stream: self.device().cuda_stream(self.stream())?,
            _buf: PhantomData,
        })
    }

    /// A mutable cudarc view. Fails when the buffer is not on a CUDA device.
    pub fn cuda_view_mut(&mut self) -> Result<DeviceBufferViewMut<'_, T>> {
        Ok(DeviceBufferViewMut {
            ptr: self.device_ptr(),
            len: self.len(),
            stream: self.device().cuda_stream(self.stream())?,
            _buf: PhantomData,
        })
    }
}

/// Makes `user` wait for the work queued on `owner` when they differ.
fn order_after(owner: &CudaStream, user: &CudaStream) {
    if owner != user {
        user.context().record_err(user.join(owner));
    }
}

macro_rules! device_slice {
    ($view:ident) => {
        impl<T> DeviceSlice<T> for $view<'_, T> {
            fn len(&self) -> usize {
                self.len
            }
            fn stream(&self) -> &Arc<CudaStream> {
                &self.stream
            }
        }
        impl<T> DevicePtr<T> for $view<'_, T> {
            fn device_ptr<'a>(
                &'a self,
                stream: &'a CudaStream,
            ) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
                order_after(&self.stream, stream);
                (self.ptr, SyncOnDrop::Sync(None))
            }
        }
    };
}
device_slice!(DeviceBufferView);
device_slice!(DeviceBufferViewMut);

impl<T> DevicePtrMut<T> for DeviceBufferViewMut<'_, T> {
    fn device_ptr_mut<'a>(
        &'a mut self,
        stream: &'a CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        order_after(&self.stream, stream);
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

// SAFETY: (this and the three impls below) the argument pushed is a reference to a `u64` device
// address that lives as long as the borrow `'b`, which outlives the launch arguments `'a`; this is
// what cudarc itself pushes for a `CudaSlice`. What the kernel does with it is covered by
// `LaunchArgs::launch` being unsafe.
unsafe impl<'a, 'b: 'a, T: Pod> PushKernelArg<&'b DeviceBuffer<T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b DeviceBuffer<T>) -> &mut Self {
        self.arg(&arg.allocation().ptr)
    }
}

// SAFETY: see above.
unsafe impl<'a, 'b: 'a, T: Pod> PushKernelArg<&'b mut DeviceBuffer<T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut DeviceBuffer<T>) -> &mut Self {
        let arg: &'b DeviceBuffer<T> = arg;
        self.arg(&arg.allocation().ptr)
    }
}

// SAFETY: see above.
unsafe impl<'a, 'b: 'a, 'c: 'b, T> PushKernelArg<&'b DeviceBufferView<'c, T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b DeviceBufferView<'c, T>) -> &mut Self {
        self.arg(&arg.ptr)
    }
}

// SAFETY: see above.
unsafe impl<'a, 'b: 'a, 'c: 'b, T> PushKernelArg<&'b mut DeviceBufferViewMut<'c, T>>
    for LaunchArgs<'a>
{
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut DeviceBufferViewMut<'c, T>) -> &mut Self {
        let arg: &'b DeviceBufferViewMut<'c, T> = arg;
        self.arg(&arg.ptr)
    }
}
