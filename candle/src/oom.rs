//! Out-of-memory in candle code on any device, CPU included: an oomguard error carried inside
//! a `candle_core::Error` that stays classified, and memory charged to an oomguard device.

pub use oomguard::Charge;

/// An oomguard error as a candle error, still classified by [`IsOom`](oomguard::IsOom): boxed in
/// `candle_core::Error::Cuda`, where candle's own CUDA errors are, so an out-of-memory is
/// one, a budget's is one (`is_budget_exceeded`), and candle's wrappers (`context`, `bt`,
/// `with_path`) keep it so. Not `Error::wrap`/`Error::msg`, which keep only the text (never
/// matched). No backtrace is attached (no `bt()`): a retry report quotes the message of every
/// attempt, and with `RUST_BACKTRACE=1` a backtrace would add about 35 lines to each.
///
/// ```
/// use oomguard::{ByteSize, Device, IsOom};
/// let card = Device::sim(ByteSize::mib(1));
/// let e = oomguard_candle::into_candle_error(card.alloc::<u8>(2 << 20).unwrap_err());
/// assert!(e.is_oom());
/// assert!(e.context("layer 3").is_oom());
/// ```
pub fn into_candle_error(e: oomguard::Error) -> candle_core::Error {
    candle_core::Error::Cuda(Box::new(e))
}

/// One of this crate's refusals (bad rows, a missing gradient, ...) as a candle error: the text
/// alone, without the backtrace `candle_core::bail!` and `Error::msg` attach under
/// `RUST_BACKTRACE=1` (a retry report quotes every attempt's message).
pub(crate) fn refusal(message: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(message.to_string())
}

/// Takes `bytes` of `device`'s memory until the returned [`Charge`] drops, for testing candle
/// code's out-of-memory handling on CPU: an OOM (the device is full, or a budget on it is
/// exceeded) comes back as a `candle_core::Error` that [`IsOom`](oomguard::IsOom) classifies
/// ([`into_candle_error`]), so [`train_step`](crate::train_step) and `#[oom_retry]` retry it
/// as they would a CUDA OOM.
///
/// ```
/// use oomguard::{ByteSize, Device, IsOom};
/// let card = Device::sim(ByteSize::mib(64));
/// let acts = oomguard_candle::charge(&card, 48 << 20)?; // 48 MiB of "activations"
/// let e = oomguard_candle::charge(&card, 32 << 20).unwrap_err();
/// assert!(e.is_oom() && !e.is_budget_exceeded());
/// drop(acts);
/// let _budget = card.thread_budget(ByteSize::mib(8)); // this thread may hold 8 MiB
/// let e = oomguard_candle::charge(&card, 16 << 20).unwrap_err();
/// assert!(e.is_oom() && e.is_budget_exceeded());
/// # Ok::<(), candle_core::Error>(())
/// ```
///
/// A leak check names the line that called `charge` (it is `#[track_caller]`).
#[track_caller]
pub fn charge(device: &oomguard::Device, bytes: usize) -> candle_core::Result<Charge> {
    device.charge(bytes).map_err(into_candle_error)
}
