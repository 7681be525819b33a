//! Memory charged to a device by code that has no device memory of its own: the way to test a
//! step's out-of-memory handling on the CPU, against a simulated card.

use crate::{Device, DeviceBuffer, Result};

/// `bytes` of a device's memory, held until dropped: what a step charges to a simulated card
/// ([`Device::sim`]) to stand for the memory its tensors would take on a GPU. Made by
/// [`Device::charge`]; the framework glue's `charge` functions return it with the framework's
/// error type.
#[must_use = "the memory is given back when this is dropped: hold it while the tensors it stands for live"]
#[derive(Debug)]
pub struct Charge(DeviceBuffer<u8>);

impl Charge {
    /// The bytes held.
    pub fn bytes(&self) -> usize {
        self.0.len()
    }
}

impl Device {
    /// Takes `bytes` of this device's memory until the returned [`Charge`] drops. An
    /// out-of-memory (the device is full, or a budget on it is exceeded) is the error a real
    /// allocation would give, so the retry engine retries it as it would a GPU's. 0 bytes
    /// charges nothing. A leak check names the line that called it (`#[track_caller]`).
    ///
    /// ```
    /// use oomguard_runtime::{ByteSize, Device};
    /// let card = Device::sim(ByteSize::mib(64));
    /// let acts = card.charge(48 << 20)?; // 48 MiB of "activations"
    /// assert!(card.charge(32 << 20).unwrap_err().is_oom());
    /// drop(acts);
    /// assert_eq!(card.charge(32 << 20)?.bytes(), 32 << 20);
    /// # Ok::<(), oomguard_runtime::Error>(())
    /// ```
    #[track_caller]
    pub fn charge(&self, bytes: usize) -> Result<Charge> {
        self.alloc::<u8>(bytes).map(Charge)
    }
}
