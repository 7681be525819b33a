//! The memory source of a candle device.

use std::sync::Arc;

use oomguard::source::MemorySource;

/// The [`MemorySource`] a candle device allocates from: for `Device::Cuda`, the oomguard
/// [`Device`](oomguard::Device) serving it once [`alloc_hook::install`](crate::alloc_hook::install)
/// installed one (feature `allocator-hook`: candle's tensors are its blocks, so its budgets cap
/// them), otherwise the driver's memory pool of that device (`oomguard::source::DriverPool`,
/// registered so that the attribute macros' retries empty it). A CPU or Metal device has none: an error says so (for tests on
/// CPU, use a simulated device: see [`charge`](crate::charge)).
pub fn memory_source(device: &candle_core::Device) -> oomguard::Result<Arc<dyn MemorySource>> {
    match device {
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(d) => {
            #[cfg(feature = "allocator-hook")]
            if let Some(dev) = crate::alloc_hook::installed_device(device) {
                return Ok(Arc::new(dev));
            }
            let ctx = d.cuda_stream().context().clone();
            let pool = oomguard::source::DriverPool::of_context(&ctx)?;
            Ok(Arc::new(pool))
        }
        other => Err(oomguard::Error::InvalidArgument(format!(
            "{other:?} has no device memory source oomguard can watch \
             (CUDA devices only, with the `cuda` feature of oomguard-candle)"
        ))),
    }
}
