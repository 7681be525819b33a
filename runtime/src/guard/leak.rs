//! Leak checks: "don't keep tensors alive" as a scope that, when it ends, names every buffer
//! allocated inside it that is still live, with the source line that allocated it. What it
//! found, [`LeakReport`], is plain data of the lowest layer (`leak_report.rs`), so that
//! [`Error`](crate::Error) can hold it; building and acting on it is here.

use std::fmt;
use std::panic::Location;
use std::sync::atomic::Ordering::Relaxed;

use super::scope::ScopeGuard;
use crate::device::tracker::{LiveRecord, ScopeKind};
use crate::device::Device;
use crate::leak_report::{LeakReport, LeakedBuffer};
use crate::ByteSize;

/// What a [`LeakCheck`] does when it is dropped with leaks beyond its allowance.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LeakAction {
    /// Panic with the report (the default). While the thread is already panicking, the report
    /// is logged as an error instead (a second panic would abort).
    #[default]
    Panic,
    /// Log the report as a warning through `tracing`.
    Warn,
    /// Nothing on drop: the caller collects the report with [`LeakCheck::finish`] (or reads it
    /// while the scope is open with [`LeakCheck::report`]).
    Report,
}

impl LeakReport {
    pub(crate) fn from_records(
        records: Vec<LiveRecord>,
        allowed_bytes: u64,
        scope: &'static Location<'static>,
    ) -> Self {
        let leaks: Vec<LeakedBuffer> = records
            .into_iter()
            .map(|r| LeakedBuffer {
                ptr: r.alloc.ptr,
                size: r.alloc.size,
                requested: r.alloc.requested,
                stream: r.alloc.stream,
                device: r.device,
                location: r.site,
                backtrace: r.backtrace,
            })
            .collect();
        LeakReport {
            total_bytes: leaks.iter().map(|l| l.size).sum(),
            leaks,
            allowed_bytes,
            scope,
            function: None,
        }
    }

    /// Carries out `action` for this report when it exceeds the allowance (a scope's end).
    pub(crate) fn act(&self, action: LeakAction) {
        if !self.exceeds_allowance() {
            return;
        }
        match action {
            LeakAction::Panic if !std::thread::panicking() => panic!("{self}"),
            LeakAction::Panic => {
                tracing::error!("{self}");
                self.to_stderr_without_subscriber("error");
            }
            LeakAction::Warn => {
                tracing::warn!("{self}");
                self.to_stderr_without_subscriber("warning");
            }
            LeakAction::Report => {}
        }
    }

    /// A leak nobody would see: without a global `tracing` subscriber the report goes to
    /// standard error, so that `Warn` leaks and leaks found while panicking are never silent.
    fn to_stderr_without_subscriber(&self, level: &str) {
        if !tracing::dispatcher::has_been_set() {
            eprintln!("oomguard {level}: {self}");
        }
    }
}

/// A leak-check scope: when it ends, every buffer allocated on this device by this thread inside
/// the scope and still live is a leak. Buffers allocated before the scope never count; buffers
/// freed before it ends (on any thread) are not leaks.
///
/// By default a leak panics on drop ([`LeakAction`] chooses otherwise); [`LeakCheck::finish`]
/// hands the report back instead; [`LeakCheck::allow`] tolerates some bytes.
///
/// ```
/// use oomguard_runtime::{ByteSize, Device};
/// let dev = Device::sim(ByteSize::gib(1));
/// let check = dev.leak_check();
/// let kept = dev.zeros::<f32>(256).unwrap(); let line = line!();
/// let report = check.finish().unwrap_err();
/// assert_eq!(report.leaks.len(), 1);
/// assert_eq!(report.leaks[0].location.line(), line);
/// assert!(report.to_string().contains("1.00 KiB"));
/// assert!(report.to_string().contains("OOMGUARD_LEAK_BACKTRACE=1"));
/// # drop(kept);
/// ```
#[must_use = "the leak check covers only the guard's lifetime"]
pub struct LeakCheck {
    guard: ScopeGuard,
    action: LeakAction,
    allowed: u64,
    finished: bool,
}

impl LeakCheck {
    /// What to do on drop when leaks exceed the allowance.
    pub fn on_leak(mut self, action: LeakAction) -> Self {
        self.action = action;
        self
    }

    /// Tolerates leaks totalling at most `bytes` (block sizes): no action below it.
    pub fn allow(mut self, bytes: impl Into<ByteSize>) -> Self {
        self.allowed = bytes.into().bytes();
        self
    }

    /// Captures a backtrace for every allocation inside the scope, even without
    /// `OOMGUARD_LEAK_BACKTRACE=1` (slow: for debugging).
    pub fn with_backtraces(self) -> Self {
        self.guard.scope.force_backtrace.store(true, Relaxed);
        self
    }

    /// The buffers allocated inside the scope that are live now (readable while it is open).
    pub fn report(&self) -> LeakReport {
        let dev = self.guard.device();
        let records = dev.tracker().live_in(&self.guard.scope, dev.ordinal());
        LeakReport::from_records(records, self.allowed, self.guard.scope.opened_at)
    }

    /// Ends the scope: `Err` with the report when the leaks exceed the allowance. Nothing
    /// happens on drop afterwards.
    pub fn finish(mut self) -> Result<(), LeakReport> {
        self.finished = true;
        if !self.guard.scope.live_exceeds(self.allowed) {
            return Ok(());
        }
        self.report().into_result()
    }
}

impl fmt::Debug for LeakCheck {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeakCheck")
            .field("action", &self.action)
            .field("allowed", &ByteSize(self.allowed))
            .field("opened_at", &self.guard.scope.opened_at)
            .finish()
    }
}

impl Drop for LeakCheck {
    fn drop(&mut self) {
        if self.finished
            || self.action == LeakAction::Report
            || !self.guard.scope.live_exceeds(self.allowed)
        {
            return;
        }
        self.report().act(self.action);
    }
}

impl Device {
    /// A leak-check scope on this device for this thread's allocations; see [`LeakCheck`].
    #[track_caller]
    pub fn leak_check(&self) -> LeakCheck {
        LeakCheck {
            guard: ScopeGuard::open(self, ScopeKind::LEAK, Location::caller()),
            action: LeakAction::Panic,
            allowed: 0,
            finished: false,
        }
    }
}
