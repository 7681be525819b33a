//! Memory charged to an oomguard device by tch code on the CPU: the way to test a step's
//! out-of-memory handling without a GPU.

pub use oomguard::Charge;

use crate::Error;

/// Takes `bytes` of `device`'s memory until the returned [`Charge`] drops, for testing tch
/// code's out-of-memory handling on CPU, where libtorch has no memory source: an out-of-memory
/// (the device is full, or a budget on it is exceeded) comes back as [`Error::Oomguard`], which
/// [`IsOom`](oomguard::IsOom) classifies (a budget's as a budget's), so
/// [`train_step`](crate::train_step), [`find_max_batch_train`](crate::find_max_batch_train) and
/// `#[oom_retry]` retry it as they would a CUDA out-of-memory. Charge in the loss closure for
/// each chunk's rows (`chunk.len() * bytes_per_row`), and hold the charge while the tensors it
/// stands for live.
///
/// ```
/// use oomguard::{ByteSize, Device, IsOom};
/// let card = Device::sim(ByteSize::mib(64));
/// let acts = oomguard_tch::charge(&card, 48 << 20)?; // 48 MiB of "activations"
/// let e = oomguard_tch::charge(&card, 32 << 20).unwrap_err();
/// assert!(e.is_oom() && !e.is_budget_exceeded());
/// drop(acts);
/// let _budget = card.thread_budget(ByteSize::mib(8)); // this thread may hold 8 MiB
/// let e = oomguard_tch::charge(&card, 16 << 20).unwrap_err();
/// assert!(e.is_oom() && e.is_budget_exceeded());
/// // 0 bytes (nothing to charge, e.g. on a GPU where the tensors count themselves)
/// assert_eq!(oomguard_tch::charge(&card, 0)?.bytes(), 0);
/// # Ok::<(), oomguard_tch::Error>(())
/// ```
///
/// A leak check names the line that called `charge` (it is `#[track_caller]`).
#[track_caller]
pub fn charge(device: &oomguard::Device, bytes: usize) -> Result<Charge, Error> {
    device.charge(bytes).map_err(Error::Oomguard)
}
