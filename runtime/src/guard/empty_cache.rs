//! Empty-cache guard: "`del x; torch.cuda.empty_cache()`" as a scope. On drop (also while
//! unwinding, e.g. out of a failed step) the cached unused memory of the device goes back to the
//! device, so that other processes (or another library's allocator) can use it.

use crate::device::Device;
use crate::ByteSize;

/// Returns the device's cached unused memory to the device when dropped, optionally only when
/// more than a threshold is reserved but unallocated ([`EmptyCacheOnDrop::above`]).
///
/// ```
/// use oomguard_runtime::{ByteSize, Device};
/// let dev = Device::sim(ByteSize::gib(1));
/// {
///     let _g = dev.empty_cache_guard();
///     let _activations = dev.zeros::<f32>(1 << 20).unwrap();
/// } // buffers dropped first (declared later), then the cache is emptied
/// assert_eq!(dev.stats().reserved_bytes.all.current, 0);
/// ```
#[must_use = "the cache is emptied when the guard is dropped; an unbound guard drops at once"]
#[derive(Debug)]
pub struct EmptyCacheOnDrop {
    device: Device,
    above: Option<u64>,
}

impl EmptyCacheOnDrop {
    /// A guard that empties `device`'s cache on drop.
    pub fn new(device: &Device) -> Self {
        Self {
            device: device.clone(),
            above: None,
        }
    }

    /// Empties the cache only when, at drop, the device's reserved-but-unallocated bytes exceed
    /// `threshold` (a cheap cache is kept for the next step).
    ///
    /// ```
    /// use oomguard_runtime::{ByteSize, Device};
    /// let dev = Device::sim(ByteSize::gib(1));
    /// {
    ///     let _g = dev.empty_cache_guard().above(ByteSize::mib(64));
    ///     let _small = dev.zeros::<u8>(1000).unwrap();
    /// }
    /// assert!(dev.stats().reserved_bytes.all.current > 0); // 2 MiB cached: below the threshold
    /// ```
    pub fn above(mut self, threshold: impl Into<ByteSize>) -> Self {
        self.above = Some(threshold.into().bytes());
        self
    }

    /// The threshold set by [`EmptyCacheOnDrop::above`].
    pub fn threshold(&self) -> Option<u64> {
        self.above
    }
}

impl Drop for EmptyCacheOnDrop {
    fn drop(&mut self) {
        if let Some(t) = self.above {
            let s = self.device.stats();
            let cached = s
                .reserved_bytes
                .all
                .current
                .saturating_sub(s.allocated_bytes.all.current);
            if cached <= t {
                return;
            }
        }
        if let Err(e) = self.device.empty_cache() {
            tracing::warn!(error = %e, "empty_cache on guard drop failed");
        }
    }
}

impl Device {
    /// A guard that returns the cached unused memory to the device when dropped; see
    /// [`EmptyCacheOnDrop`].
    pub fn empty_cache_guard(&self) -> EmptyCacheOnDrop {
        EmptyCacheOnDrop::new(self)
    }
}
