//! Errors: a typed out-of-memory error that explains itself, and everything else.

use crate::backend::BackendError;
use crate::config::ConfigError;
use crate::leak_report::LeakReport;
use crate::retry_report::{PlanError, RetryReport};
use crate::ByteSize;
use std::fmt;

/// Why an allocation failed for lack of memory, with the figures needed to tell a batch that is
/// too large apart from fragmentation or a full cache.
///
/// Its `Display` reads like PyTorch's message:
/// "Tried to allocate 2.00 GiB. Device 0 has a total capacity of 8.00 GiB of which 1.10 GiB is
/// free. Of the allocated memory 5.90 GiB is allocated by oomguard and 0.95 GiB is reserved but
/// unallocated. …"
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OomError {
    /// Bytes the caller asked for.
    pub requested: u64,
    /// Device ordinal.
    pub device: usize,
    /// Device capacity (cuMemGetInfo total).
    pub device_total: u64,
    /// Device free memory at the time of failure (cuMemGetInfo free).
    pub device_free: u64,
    /// Bytes allocated through oomguard (live buffers).
    pub allocated: u64,
    /// Bytes oomguard holds from the device but has not handed out.
    pub reserved_unallocated: u64,
    /// The largest free block in oomguard's cache.
    pub largest_free_block: u64,
    /// What the backend said, when the failure came from the device itself.
    pub cause: Option<String>,
    /// Whether the allocator used growable (expandable) segments, so that the message does not
    /// recommend turning them on when they are on.
    pub expandable_segments: bool,
    /// The memory limit in force (`set_memory_limit`, `set_memory_fraction`, or the
    /// configuration's `per_process_memory_fraction`): the bytes the allocator may reserve.
    /// `None` without one. PyTorch's message prints it as "… allowed;".
    pub memory_limit: Option<u64>,
}

impl OomError {
    /// Whether fragmentation is the likely cause: the room to grow and the cache's free bytes
    /// together would hold the request, but neither the room nor any free block of the cache
    /// alone can. The room is the device's free memory, or under [`OomError::memory_limit`]
    /// what the limit leaves above the reserved bytes, if less.
    pub fn likely_fragmentation(&self) -> bool {
        let room = self.room_to_grow();
        room < self.requested
            && self.largest_free_block < self.requested
            && room.saturating_add(self.reserved_unallocated) >= self.requested
    }

    /// The bytes the allocator could still reserve: the device's free memory, capped by what
    /// the memory limit leaves above the reserved bytes.
    pub fn room_to_grow(&self) -> u64 {
        let reserved = self.allocated.saturating_add(self.reserved_unallocated);
        self.memory_limit.map_or(self.device_free, |l| {
            self.device_free.min(l.saturating_sub(reserved))
        })
    }
}

/// A size as PyTorch's out-of-memory message prints it (`format_size` in
/// CUDACachingAllocator.cpp): bytes up to 1024, then KiB, MiB, and GiB at most, two decimals, so
/// an absurd request reads "800000000.00 GiB" as there.
struct PtSize(u64);

impl fmt::Display for PtSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.0;
        let (div, unit) = match n {
            0..=1024 => return write!(f, "{n} bytes"),
            1025..=1_048_576 => (1024.0, "KiB"),
            1_048_577..=1_073_741_824 => (1_048_576.0, "MiB"),
            _ => (1_073_741_824.0, "GiB"),
        };
        write!(f, "{:.2} {unit}", n as f64 / div)
    }
}

/// Requests of this many bytes or more fail at once, as in PyTorch (`one_exa_bytes`, 2^60).
pub(crate) const ONE_EXABYTE: u64 = 1 << 60;

impl fmt::Display for OomError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.requested >= ONE_EXABYTE {
            // PyTorch's words for such a request
            write!(f, "out of memory. Tried to allocate more than 1EB memory.")?;
        } else {
            write!(
                f,
                "out of memory. Tried to allocate {}.",
                PtSize(self.requested)
            )?;
        }
        write!(
            f,
            " Device {} has a total capacity of {} of which {} is free.",
            self.device,
            PtSize(self.device_total),
            PtSize(self.device_free),
        )?;
        if let Some(limit) = self.memory_limit {
            write!(f, " {} allowed;", PtSize(limit))?;
        }
        write!(
            f,
            " Of the allocated memory {} is allocated by oomguard and {} is reserved but \
             unallocated (largest free block {}).",
            PtSize(self.allocated),
            PtSize(self.reserved_unallocated),
            PtSize(self.largest_free_block),
        )?;
        if self.likely_fragmentation() {
            let room = if self.room_to_grow() < self.device_free {
                "The room under the memory limit"
            } else {
                "Free device memory"
            };
            write!(
                f,
                " {room} and reserved but unallocated memory together exceed the request: memory \
                 is fragmented."
            )?;
            if self.expandable_segments {
                write!(
                    f,
                    " The cached memory sits in partly used pages; freeing long-lived buffers \
                     allocated between short-lived ones, or empty_cache() before the step, may \
                     help."
                )?;
            } else {
                write!(
                    f,
                    " Set OOMGUARD_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
                )?;
            }
        }
        if let Some(c) = &self.cause {
            write!(f, " (device: {c})")?;
        }
        Ok(())
    }
}

impl std::error::Error for OomError {}

/// A memory budget (a scoped guard, or a device-wide limit) would be exceeded. An out-of-memory
/// kind: retry policies treat it like a device OOM.
///
/// Its `Display`: "memory budget exceeded: tried to allocate 16.00 MiB, 0 bytes of the 8.00 MiB
/// budget already in use (the budget opened at src/main.rs:12:18)".
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "memory budget exceeded: tried to allocate {}, {} of the {} budget already in use{}",
    ByteSize(*requested), ByteSize(*in_use), ByteSize(*limit), OpenedAt(*opened_at)
)]
pub struct BudgetExceeded {
    /// Bytes the caller asked for (after rounding).
    pub requested: u64,
    /// Bytes already counted against the budget.
    pub in_use: u64,
    /// The budget's limit.
    pub limit: u64,
    /// Where the budget that refused was opened: the call that made its guard (the function
    /// of a `#[memory_budget]`), so that among nested budgets the one to raise is known.
    /// `None` when not known.
    pub opened_at: Option<&'static std::panic::Location<'static>>,
}

/// " (the budget opened at FILE:LINE:COLUMN)", or nothing.
struct OpenedAt(Option<&'static std::panic::Location<'static>>);

impl fmt::Display for OpenedAt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(at) => write!(f, " (the budget opened at {at})"),
            None => Ok(()),
        }
    }
}

/// Every error oomguard returns.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    // Not `transparent`: the inner error must stay in the `source()` chain, as an `io::Error`
    // inside a transparent wrapper (candle's `Error::Io`, a user's enum) shows only its
    // source's source, and the OOM is classified by that type.
    /// The device (or oomguard's cache) has no memory for the request.
    #[error("{0}")]
    Oom(#[from] OomError),
    /// A memory budget would be exceeded.
    #[error("{0}")]
    BudgetExceeded(#[from] BudgetExceeded),
    /// A backend call failed for a reason other than out-of-memory.
    #[error("device error: {0}")]
    Backend(#[from] BackendError),
    /// An allocator configuration string was invalid.
    #[error("{0}")]
    Config(#[from] ConfigError),
    /// An argument was invalid (a size that overflows, a length mismatch).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A leak check found device memory still held (`#[leak_check(action = error)]`).
    // `transparent`: a `Caused by:` list does not show the report twice
    #[error(transparent)]
    Leak(#[from] LeakReport),
    /// A step retried by the OOM retry engine (`#[oom_retry]`, [`crate::retry::RetryEngine`])
    /// gave up: its last error, with the report of every attempt (plans tried, the smallest
    /// one). An out-of-memory when `error` is one. The same "gave up" as the engine's
    /// [`RetryError::GaveUp`](crate::retry::RetryError::GaveUp), of which
    /// [`RetryError::into_error`](crate::retry::RetryError::into_error) makes exactly this
    /// (see [`RetryError`](crate::retry::RetryError#one-shape-for-gave-up)).
    #[error("{error}\n{report}")]
    RetriesExhausted {
        /// The last attempt's error.
        #[source]
        error: Box<Error>,
        /// Every attempt of the step.
        report: Box<RetryReport>,
    },
    /// An error after an update was applied: the commit phase of a retried step failed (an
    /// out-of-memory included), or a step nested in its attempt committed before the attempt
    /// failed. Never an out-of-memory for [`Error::is_oom`] and
    /// [`IsOom`](crate::retry::IsOom): no layer may retry it, since a retry would apply the
    /// update again. `error` says what failed (out-of-memory or not); `report` is the step's,
    /// with its [`commit_error`](crate::retry::RetryReport::commit_error) or
    /// [`nested_commit`](crate::retry::RetryReport::nested_commit).
    #[error("{error}\n{} (not retried: an update was already applied)", report.headline())]
    AfterCommit {
        /// The error, as the commit (or the attempt) returned it.
        #[source]
        error: Box<Error>,
        /// The report of the step.
        report: Box<RetryReport>,
    },
}

impl Error {
    /// Whether this error is an out-of-memory (device OOM or exceeded budget) that a retry may
    /// fix. [`Error::AfterCommit`] is not, whatever it holds (an update was already applied).
    pub fn is_oom(&self) -> bool {
        match self {
            Error::Oom(_) | Error::BudgetExceeded(_) => true,
            Error::Backend(b) => b.is_oom(),
            Error::RetriesExhausted { error, .. } => error.is_oom(),
            _ => false,
        }
    }
}

/// A bad plan is a bad argument: `?` on a [`PlanError`] in a function returning oomguard's
/// `Result` gives [`Error::InvalidArgument`].
///
/// ```
/// use oomguard_runtime::retry::BatchPlan;
/// fn plan() -> oomguard_runtime::Result<BatchPlan> {
///     Ok(BatchPlan::whole(0)?)
/// }
/// assert!(matches!(plan(), Err(oomguard_runtime::Error::InvalidArgument(_))));
/// ```
impl From<PlanError> for Error {
    fn from(e: PlanError) -> Self {
        Error::InvalidArgument(e.to_string())
    }
}

/// So that `?` works on oomguard calls in functions returning `io::Result` (under
/// `#[oom_retry]` too): an out-of-memory error (a budget included) becomes
/// [`std::io::ErrorKind::OutOfMemory`], anything else [`std::io::ErrorKind::Other`], with the
/// oomguard error as the source (so the retry engine still classifies it by type).
///
/// ```
/// use oomguard_runtime::{ByteSize, Device};
/// fn step(dev: &Device) -> std::io::Result<usize> {
///     Ok(dev.alloc::<u8>(1 << 30)?.len())
/// }
/// let e = step(&Device::sim(ByteSize::mib(64))).unwrap_err();
/// assert_eq!(e.kind(), std::io::ErrorKind::OutOfMemory);
/// ```
impl From<Error> for std::io::Error {
    fn from(e: Error) -> Self {
        let kind = if e.is_oom() {
            std::io::ErrorKind::OutOfMemory
        } else {
            std::io::ErrorKind::Other
        };
        std::io::Error::new(kind, e)
    }
}

/// `Result` with oomguard's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_reads_like_pytorch() {
        let e = OomError {
            requested: 3 << 30,
            device: 0,
            device_total: 8 << 30,
            device_free: 1181116006,
            allocated: 6335076761,
            reserved_unallocated: 1020054733,
            largest_free_block: 100 << 20,
            cause: None,
            expandable_segments: false,
            memory_limit: None,
        };
        let m = e.to_string();
        assert!(m.contains("Tried to allocate 3.00 GiB. Device 0 has a total capacity of 8.00 GiB of which 1.10 GiB is free."), "{m}");
        assert!(
            m.contains(
                "5.90 GiB is allocated by oomguard and 972.80 MiB is reserved but unallocated"
            ),
            "{m}"
        );
        // 1.10 GiB free + 0.95 GiB cached < 3 GiB: too large, not fragmentation
        assert!(!e.likely_fragmentation());
        assert!(!m.contains("fragment"), "{m}");
        let frag = OomError {
            reserved_unallocated: 2 << 30,
            ..e.clone()
        };
        assert!(frag.likely_fragmentation());
        assert!(frag.to_string().contains("expandable_segments:True"));
        // with growable segments on, it does not recommend turning them on
        let frag_growable = OomError {
            expandable_segments: true,
            ..frag.clone()
        };
        assert!(frag_growable.to_string().contains("fragmented"));
        assert!(!frag_growable
            .to_string()
            .contains("expandable_segments:True"));
        assert!(Error::from(frag).is_oom());
    }
}
