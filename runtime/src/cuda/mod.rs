//! CUDA devices: [`Device::cuda`], the cudarc context and streams of a device, pinned host
//! buffers ([`HostBuffer`]) and cudarc views of device buffers ([`DeviceBufferView`]).
//!
//! Kernels are launched with cudarc (re-exported as [`crate::cudarc`]); a [`crate::DeviceBuffer`]
//! is a kernel argument as it is, and [`crate::DeviceBuffer::cuda_view`] /
//! [`crate::DeviceBuffer::cuda_view_mut`] give cudarc's copy functions what they need:
//!
//! ```no_run
//! use oomguard_runtime::cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
//! use oomguard_runtime::Device;
//!
//! /// Doubles 1024 floats with `scale`, a kernel `scale(float* x, float a, int n)` loaded with
//! /// `dev.cuda_context()?.load_module(ptx)?.load_function("scale")?` from NVRTC's PTX.
//! fn double(dev: &Device, scale: &CudaFunction) -> Result<(), Box<dyn std::error::Error>> {
//!     let stream = dev.cuda_default_stream()?; // stream id 0
//!     let mut buf = dev.alloc::<f32>(1024)?;
//!     stream.memcpy_htod(&vec![1.0f32; 1024], &mut buf.cuda_view_mut()?)?;
//!     let n = 1024i32;
//!     // SAFETY: `scale(float*, float, int)` reads and writes `n` elements of `buf`.
//!     unsafe {
//!         stream
//!             .launch_builder(scale)
//!             .arg(&mut buf)
//!             .arg(&2.0f32)
//!             .arg(&n)
//!             .launch(LaunchConfig::for_num_elems(1024))?;
//!     }
//!     assert_eq!(buf.to_vec()?[0], 2.0);
//!     Ok(())
//! }
//! ```
#![allow(unsafe_code)] // FFI: pinned host memory and cudarc's unsafe kernel-argument trait

mod host_buffer;
mod views;

use std::sync::Arc;

use bytemuck::Pod;
use cudarc::driver::{CudaContext, CudaStream};

pub use crate::backend::cuda::{driver_available, CudaBackend};
pub use host_buffer::HostBuffer;
pub use views::{DeviceBufferView, DeviceBufferViewMut};

use crate::backend::StreamId;
use crate::config::AllocatorConfig;
use crate::device::Device;
use crate::error::{Error, Result};

impl Device {
    /// CUDA device `ordinal` with the configuration from `OOMGUARD_ALLOC_CONF`
    /// ([`AllocatorConfig::from_env`]; the default, growable segments, when unset), as PyTorch
    /// reads `PYTORCH_CUDA_ALLOC_CONF`.
    ///
    /// Fails, without panicking, when the variable holds an invalid configuration
    /// ([`Error::Config`], naming the key), when there is no CUDA driver (a
    /// [`crate::backend::BackendError`] of kind `Unavailable`) or no such device.
    pub fn cuda(ordinal: usize) -> Result<Device> {
        Self::cuda_with_config(ordinal, AllocatorConfig::from_env()?)
    }

    /// CUDA device `ordinal` with `config` (the environment variable is not read: an explicit
    /// configuration overrides it).
    pub fn cuda_with_config(ordinal: usize, config: AllocatorConfig) -> Result<Device> {
        let backend = CudaBackend::new(ordinal)?;
        let backend = if config.pass_through {
            backend.with_stream_ordered_pool()
        } else {
            backend
        };
        Ok(Device::new(backend, config))
    }

    /// The CUDA backend, when this is a CUDA device.
    pub fn cuda_backend(&self) -> Option<&CudaBackend> {
        self.backend().as_any()?.downcast_ref::<CudaBackend>()
    }

    fn require_cuda(&self, what: &str) -> Result<&CudaBackend> {
        self.cuda_backend().ok_or_else(|| {
            Error::InvalidArgument(format!("{what}: {} is not a CUDA device", self.name()))
        })
    }

    /// The device's cudarc context (its primary context), to load modules and make streams.
    pub fn cuda_context(&self) -> Result<Arc<CudaContext>> {
        Ok(Arc::clone(self.require_cuda("cuda_context")?.context()))
    }

    /// The legacy default stream, whose [`StreamId`] is 0 (the stream of [`Device::alloc`]).
    pub fn cuda_default_stream(&self) -> Result<Arc<CudaStream>> {
        Ok(self.require_cuda("cuda_default_stream")?.default_stream())
    }

    /// Registers a cudarc stream of this device and returns its [`StreamId`], for
    /// [`Device::alloc_on`] and [`crate::DeviceBuffer::record_stream`]. The device keeps the
    /// stream alive from then on.
    ///
    /// ```no_run
    /// # use oomguard_runtime::Device;
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let dev = Device::cuda(0)?;
    /// let stream = dev.cuda_context()?.new_stream()?;
    /// let id = dev.register_stream(&stream)?;
    /// let buf = dev.alloc_on::<f32>(1 << 20, id)?;
    /// assert_eq!(buf.stream(), id);
    /// # Ok(()) }
    /// ```
    pub fn register_stream(&self, stream: &Arc<CudaStream>) -> Result<StreamId> {
        Ok(self
            .require_cuda("register_stream")?
            .register_stream(stream)?)
    }

    /// The cudarc stream of a [`StreamId`] (0, or one from [`Device::register_stream`]).
    pub fn cuda_stream(&self, id: StreamId) -> Result<Arc<CudaStream>> {
        Ok(self.require_cuda("cuda_stream")?.stream(id)?)
    }

    /// A zeroed pinned (page-locked) host buffer of `len` elements, for fast copies; counted in
    /// [`crate::MemoryStats::pinned_bytes`] while it lives.
    pub fn pinned<T: Pod>(&self, len: usize) -> Result<HostBuffer<T>> {
        HostBuffer::new(self, len)
    }
}

#[cfg(test)]
mod tests {
    use crate::{ByteSize, Device, Error};

    #[test]
    fn cuda_calls_on_a_simulated_device_are_errors() {
        let dev = Device::sim(ByteSize::mib(64));
        assert!(dev.cuda_backend().is_none());
        let not_cuda = |e: Error| {
            let m = e.to_string();
            assert!(m.contains("is not a CUDA device"), "{m}");
        };
        not_cuda(dev.cuda_context().unwrap_err());
        not_cuda(dev.cuda_default_stream().unwrap_err());
        not_cuda(dev.cuda_stream(0).unwrap_err());
        not_cuda(dev.pinned::<f32>(16).unwrap_err());
        let mut buf = dev.zeros::<f32>(16).unwrap();
        not_cuda(buf.cuda_view().unwrap_err());
        not_cuda(buf.cuda_view_mut().unwrap_err());
        assert_eq!(dev.stats().pinned_bytes.current, 0);
    }
}
