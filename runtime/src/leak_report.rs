//! What a leak check found: the buffers a scope left live, as plain data. The check itself (the
//! guard that builds a report when its scope ends) is `guard/leak.rs`; the report lives below the
//! guards so that [`Error::Leak`](crate::Error::Leak) can hold it.

use std::backtrace::Backtrace;
use std::fmt;
use std::panic::Location;
use std::sync::Arc;

use crate::backend::{DevicePtr, StreamId};
use crate::ByteSize;

/// One buffer allocated inside a leak-check scope and still live when it ended.
#[derive(Clone, Debug)]
pub struct LeakedBuffer {
    /// Device address.
    pub ptr: DevicePtr,
    /// Bytes of the block (what the allocator holds for it).
    pub size: u64,
    /// Bytes asked for.
    pub requested: u64,
    /// The buffer's stream.
    pub stream: StreamId,
    /// The ordinal of the device it lives on.
    pub device: usize,
    /// The source location that allocated it (the caller of `Device::alloc` and friends).
    pub location: &'static Location<'static>,
    /// The backtrace of the allocation, when backtraces were enabled
    /// ([`LeakCheck::with_backtraces`](crate::guard::LeakCheck::with_backtraces), or
    /// `OOMGUARD_LEAK_BACKTRACE=1`).
    pub backtrace: Option<Arc<Backtrace>>,
}

/// The buffers a leak-check scope left live. `Display` lists each with its size and the line
/// that allocated it.
#[derive(Clone, Debug)]
pub struct LeakReport {
    /// The leaked buffers, in allocation order.
    pub leaks: Vec<LeakedBuffer>,
    /// Their total block size.
    pub total_bytes: u64,
    /// The allowance of the scope ([`LeakCheck::allow`](crate::guard::LeakCheck::allow)).
    pub allowed_bytes: u64,
    /// Where the scope was opened.
    pub scope: &'static Location<'static>,
    /// The function the check covers (`#[leak_check]` names it), if known.
    pub function: Option<&'static str>,
}

impl LeakReport {
    /// Whether the leaks exceed the allowance.
    pub fn exceeds_allowance(&self) -> bool {
        self.total_bytes > self.allowed_bytes
    }

    /// `Err(self)` when the leaks exceed the allowance, else `Ok`.
    pub fn into_result(self) -> Result<(), LeakReport> {
        if self.exceeds_allowance() {
            Err(self)
        } else {
            Ok(())
        }
    }
}

impl fmt::Display for LeakReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(func) = self.function {
            write!(f, "leak check of `{func}` (")?;
        }
        write!(f, "leak check opened at {}", self.scope)?;
        if self.function.is_some() {
            write!(f, ")")?;
        }
        write!(
            f,
            ": {} buffer(s) allocated inside the scope still live, {} \
             (allowance {})",
            self.leaks.len(),
            ByteSize(self.total_bytes),
            ByteSize(self.allowed_bytes),
        )?;
        if !self.exceeds_allowance() {
            write!(f, ": no leak")?;
        }
        for l in &self.leaks {
            write!(
                f,
                "\n  {} ({} B requested) at {:#x} on device {} stream {}, allocated at {}",
                ByteSize(l.size),
                l.requested,
                l.ptr,
                l.device,
                l.stream,
                l.location
            )?;
            if let Some(bt) = &l.backtrace {
                write!(f, "\n    backtrace:\n{bt}")?;
            }
        }
        // The line alone may be a helper that many callers share: say how to get the callers.
        if self.leaks.iter().any(|l| l.backtrace.is_none()) {
            write!(
                f,
                "\n  for the backtrace of each allocation, run with OOMGUARD_LEAK_BACKTRACE=1 (or \
                 use LeakCheck::with_backtraces)"
            )?;
        }
        Ok(())
    }
}

impl std::error::Error for LeakReport {}
