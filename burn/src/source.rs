//! The [`MemorySource`] of a burn device.

use std::any::Any;
use std::sync::Arc;

use burn::tensor::backend::Backend;
use oomguard::source::MemorySource;

/// The [`MemorySource`] a burn device allocates from: for a CUDA device (`burn::backend::cuda`,
/// feature `cuda`, also under `Autodiff`), `CubeCudaSource` over
/// cubecl's pools and the driver's memory pool they draw from. Other devices (ndarray, wgpu,
/// ...) have none oomguard can watch: an error says so. Give the retry engine a simulated
/// `oomguard::Device` instead to test a step on CPU.
pub fn memory_source<B: Backend>(device: &B::Device) -> oomguard::Result<Arc<dyn MemorySource>>
where
    B::Device: Any,
{
    #[cfg(feature = "cuda")]
    if let Some(d) = (device as &dyn Any).downcast_ref::<burn::backend::cuda::CudaDevice>() {
        let source: Arc<dyn MemorySource> = Arc::new(crate::CubeCudaSource::new(d)?);
        oomguard::source::register(&source);
        return Ok(source);
    }
    Err(oomguard::Error::InvalidArgument(format!(
        "{} device {device:?} has no device memory source oomguard can watch \
         (CUDA devices only, with the `cuda` feature of oomguard-burn)",
        B::name(device)
    )))
}
