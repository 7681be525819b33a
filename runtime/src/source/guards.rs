//! Guards over any [`MemorySource`], by its counters: a leak check (bytes still used at the end
//! of a scope) and a peak scope. They see the whole source, every thread's allocations, and
//! cannot name allocation sites: for oomguard's own [`crate::Device`] the exact per-allocation
//! guards of [`crate::guard`] say more. Budgets are [`MemorySource::budget`]; empty-cache on
//! drop is [`EmptyCacheOnDropOf`].

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use super::{MemorySource, SourceInfo};
use crate::error::Result;

/// What a [`UsageLeakCheck`] found: bytes the source still had in use at the end of the scope
/// beyond what it had at the start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UsageLeakReport {
    /// The source checked.
    pub source: SourceInfo,
    /// Bytes in use when the check opened.
    pub used_at_open: u64,
    /// Bytes in use when it finished (after synchronising the device).
    pub used_at_finish: u64,
    /// `used_at_finish - used_at_open` (0 when less is in use than at the start).
    pub leaked_bytes: u64,
    /// Bytes allowed to stay.
    pub allowed_bytes: u64,
}

impl UsageLeakReport {
    /// Whether more stayed in use than allowed.
    pub fn exceeds_allowance(&self) -> bool {
        self.leaked_bytes > self.allowed_bytes
    }
}

impl fmt::Display for UsageLeakReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "leak check on the {}: {} byte(s) more in use at the end of the scope than at its start \
             ({} -> {}; {} allowed)",
            self.source,
            self.leaked_bytes,
            self.used_at_open,
            self.used_at_finish,
            self.allowed_bytes
        )?;
        // the advice only where there is a leak: a clean check says so
        if self.exceeds_allowance() {
            write!(
                f,
                ". Something created in the scope is still alive (a tensor kept in a collection, \
                 a graph held by a returned value); drop it or detach it"
            )
        } else {
            write!(f, ": no leak")
        }
    }
}

impl std::error::Error for UsageLeakReport {}

/// Checks that a scope gives back what it allocated from a source: `used` at the end (after a
/// device synchronisation, so stream-ordered frees count) is compared with `used` at the start.
/// Other threads' allocations on the same source count too.
#[must_use = "call finish() to get the report"]
#[derive(Debug)]
pub struct UsageLeakCheck<'a, S: MemorySource + ?Sized> {
    source: &'a S,
    used_at_open: u64,
    allowed: u64,
}

impl<'a, S: MemorySource + ?Sized> UsageLeakCheck<'a, S> {
    /// Opens a check on `source` (synchronises it to read a settled `used`).
    pub fn new(source: &'a S) -> Result<Self> {
        source.synchronize()?;
        Ok(Self {
            source,
            used_at_open: source.usage()?.used,
            allowed: 0,
        })
    }

    /// Allows `bytes` to stay in use (e.g. an optimizer's state created on the first step).
    pub fn allow(mut self, bytes: u64) -> Self {
        self.allowed = bytes;
        self
    }

    /// Synchronises the device and reports what stayed in use.
    pub fn finish(self) -> Result<UsageLeakReport> {
        self.source.synchronize()?;
        let now = self.source.usage()?.used;
        Ok(UsageLeakReport {
            source: self.source.info(),
            used_at_open: self.used_at_open,
            used_at_finish: now,
            leaked_bytes: now.saturating_sub(self.used_at_open),
            allowed_bytes: self.allowed,
        })
    }

    /// [`UsageLeakCheck::finish`], as an error when more stayed than allowed.
    pub fn finish_strict(self) -> std::result::Result<UsageLeakReport, LeakCheckFailed> {
        let r = self.finish().map_err(LeakCheckFailed::Source)?;
        if r.exceeds_allowance() {
            Err(LeakCheckFailed::Leaked(r))
        } else {
            Ok(r)
        }
    }
}

/// Why [`UsageLeakCheck::finish_strict`] failed.
#[derive(Debug, thiserror::Error)]
pub enum LeakCheckFailed {
    /// More stayed in use than allowed.
    #[error("{0}")]
    Leaked(UsageLeakReport),
    /// The source could not be read.
    #[error("{0}")]
    Source(crate::Error),
}

/// Peaks folded in before a nested scope resets the source's peak counter, per source.
type Ledger = HashMap<usize, Vec<Weak<AtomicU64>>>;
static OPEN_PEAKS: Mutex<Option<Ledger>> = Mutex::new(None);

fn ledger() -> MutexGuard<'static, Option<Ledger>> {
    OPEN_PEAKS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Resets `source`'s peak counter, the scopes open on it (`open`, its ledger entry) first
/// taking the peak they had seen, so that they stay exact.
fn fold_and_reset<S: MemorySource + ?Sized>(
    source: &S,
    open: &mut Vec<Weak<AtomicU64>>,
) -> Result<()> {
    open.retain(|w| w.strong_count() > 0);
    if !open.is_empty() {
        let peak = source.usage()?.used_peak;
        for s in open.iter().filter_map(Weak::upgrade) {
            s.fetch_max(peak, Relaxed);
        }
    }
    source.reset_peak()
}

/// Resets `source`'s peak counter as opening a [`UsagePeakScope`] does: the scopes open on it
/// stay exact (the finder's reset before each run).
pub(crate) fn reset_peak_keeping_scopes<S: MemorySource + ?Sized>(source: &S) -> Result<()> {
    let mut l = ledger();
    match l
        .as_mut()
        .and_then(|open| open.get_mut(&source.source_id()))
    {
        Some(open) => fold_and_reset(source, open),
        None => source.reset_peak(),
    }
}

/// The most bytes a source had in use while the scope was open. Opening one resets the source's
/// peak counter; scopes already open on the same source first take the peak they had seen, so
/// nesting stays exact, and so do the finder's resets. Other threads' allocations on the source
/// count. A reset of the source's peak by hand while the scope is open
/// ([`MemorySource::reset_peak`], `Device::reset_peak_stats`) drops what it saw before.
#[must_use = "the scope measures while it lives"]
#[derive(Debug)]
pub struct UsagePeakScope<'a, S: MemorySource + ?Sized> {
    source: &'a S,
    seen: Arc<AtomicU64>,
}

impl<'a, S: MemorySource + ?Sized> UsagePeakScope<'a, S> {
    /// Opens a peak scope on `source`.
    pub fn new(source: &'a S) -> Result<Self> {
        let seen = Arc::new(AtomicU64::new(0));
        let mut l = ledger();
        let open = l.get_or_insert_with(HashMap::new);
        let list = open.entry(source.source_id()).or_default();
        fold_and_reset(source, list)?;
        seen.store(source.usage()?.used, Relaxed);
        list.push(Arc::downgrade(&seen));
        Ok(Self { source, seen })
    }

    /// The most bytes in use since the scope opened.
    pub fn peak_bytes(&self) -> Result<u64> {
        let _l = ledger(); // no nested scope resets the counter while it is read
        Ok(self.seen.load(Relaxed).max(self.source.usage()?.used_peak))
    }
}

/// Empties a source's cache when dropped (also on unwind), like [`crate::EmptyCacheOnDrop`] for
/// any [`MemorySource`].
#[must_use = "the cache is emptied when this guard is dropped"]
#[derive(Debug)]
pub struct EmptyCacheOnDropOf<'a, S: MemorySource + ?Sized> {
    source: &'a S,
}

impl<'a, S: MemorySource + ?Sized> EmptyCacheOnDropOf<'a, S> {
    /// A guard that empties `source`'s cache when dropped.
    pub fn new(source: &'a S) -> Self {
        Self { source }
    }
}

impl<S: MemorySource + ?Sized> Drop for EmptyCacheOnDropOf<'_, S> {
    fn drop(&mut self) {
        if let Err(e) = self.source.empty_cache() {
            tracing::warn!(target: "oomguard::source", error = %e, source = %self.source.info(), "empty_cache failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ByteSize, Device};

    #[test]
    fn leak_check_counts_what_stays() {
        let dev = Device::sim(ByteSize::mib(64));
        let before = dev.alloc::<u8>(4096).unwrap();
        let check = UsageLeakCheck::new(&dev).unwrap().allow(1024);
        drop(before); // freeing older memory is not a leak
        let kept = dev.alloc::<u8>(1 << 20).unwrap();
        let r = check.finish().unwrap();
        assert_eq!(r.leaked_bytes, (1 << 20) - 4096);
        assert!(r.exceeds_allowance());
        assert!(
            r.to_string().contains("caching allocator of device 0"),
            "{r}"
        );
        drop(kept);
        let check = UsageLeakCheck::new(&dev).unwrap();
        let tmp = dev.alloc::<u8>(1 << 20).unwrap();
        drop(tmp);
        assert!(check.finish_strict().is_ok());
    }

    #[test]
    fn nested_peak_scopes_stay_exact() {
        let dev = Device::sim(ByteSize::mib(64));
        let outer = UsagePeakScope::new(&dev).unwrap();
        let big = dev.alloc::<u8>(8 << 20).unwrap();
        drop(big);
        let inner = UsagePeakScope::new(&dev).unwrap();
        let small = dev.alloc::<u8>(1 << 20).unwrap();
        assert_eq!(inner.peak_bytes().unwrap(), 1 << 20);
        assert_eq!(
            outer.peak_bytes().unwrap(),
            8 << 20,
            "the inner reset kept the outer peak"
        );
        drop(small);
        drop(inner);
        assert_eq!(outer.peak_bytes().unwrap(), 8 << 20);
    }

    #[test]
    fn budget_caps_the_device() {
        let dev = Device::sim(ByteSize::mib(64));
        let b = MemorySource::budget(&dev, 2 << 20).unwrap();
        assert_eq!(b.limit(), 2 << 20);
        assert!(dev.alloc::<u8>(3 << 20).unwrap_err().is_oom());
        drop(b);
        assert!(dev.alloc::<u8>(3 << 20).is_ok());
    }

    /// Issue 26, point 3: `MemorySource::budget(0)` means the same on every source: refused
    /// (a driver pool cannot cap at 0; the old code returned a budget here that refused
    /// everything, and one on the pool that capped nothing).
    #[test]
    fn a_source_budget_of_zero_is_refused() {
        let dev = Device::sim(ByteSize::mib(64));
        let e = MemorySource::budget(&dev, 0).unwrap_err();
        assert!(matches!(e, crate::Error::InvalidArgument(_)), "{e}");
        assert!(e.to_string().contains("0 bytes"), "{e}");
        assert!(dev.alloc::<u8>(1 << 20).is_ok());
    }

    #[test]
    fn empty_cache_on_drop_releases() {
        let dev = Device::sim(ByteSize::mib(64));
        drop(dev.alloc::<u8>(4 << 20).unwrap());
        assert!(dev.usage().unwrap().reserved > 0);
        {
            let _g = EmptyCacheOnDropOf::new(&dev);
        }
        assert_eq!(dev.usage().unwrap().reserved, 0);
    }
}
