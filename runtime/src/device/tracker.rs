//! The accounting behind the memory guards: which open scopes an allocation is charged to, and
//! a side table (keyed by device address) that remembers it until the allocation is freed.
//!
//! Costs: with no scope open on a device, [`Device::alloc_raw`](crate::Device::alloc_raw) pays
//! one relaxed atomic load ([`Tracker::scopes_open`]) and
//! [`Device::free_raw`](crate::Device::free_raw) one more ([`Tracker::tracking`]). Only while a
//! scope is open are allocations recorded in the side table (one mutex per device).
//!
//! A scope is either thread-scoped (charged by allocations of the thread that opened it, kept in
//! a thread-local stack) or device-wide (charged by every thread, kept in the tracker). Every
//! scope has its own counters in an `Arc`; a recorded allocation holds the `Arc`s of the scopes
//! it was charged to and credits them back when it is freed, on whatever thread, also after the
//! scope has closed (the counters of a closed scope are then simply never read again).
//!
//! This is the device's side of the guards: the guards that open and close scopes, and hold the
//! device while they do, live in [`crate::guard`] (`guard/scope.rs`).

use rustc_hash::FxHashMap;
use smallvec::SmallVec;
use std::backtrace::{Backtrace, BacktraceStatus};
use std::cell::RefCell;
use std::panic::Location;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::alloc::{Allocation, CachingAllocator, MIN_BLOCK};
use crate::backend::StreamId;
use crate::error::{BudgetExceeded, Error, Result};

thread_local! {
    /// Thread-scoped scopes open on this thread, outermost first (all devices).
    static SCOPES: RefCell<Vec<Arc<Scope>>> = const { RefCell::new(Vec::new()) };
}

/// The `tracker` of a scope that applies to every device (see `guard::thread`).
pub(crate) const ANY_DEVICE: usize = 0;

/// Scopes open for every device, on all threads: while non-zero, every device takes the
/// tracked path (which then finds the scopes of its own thread, if any).
static ANY_DEVICE_OPEN: AtomicUsize = AtomicUsize::new(0);

/// What a scope does with the allocations charged to it: a budget, a leak check, both (the
/// attribute macros open one scope for `#[memory_budget]` and `#[leak_check]` on one function:
/// they cover the same allocations), or neither (a peak scope only counts).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ScopeKind {
    /// A memory budget: the most bytes live at once.
    pub limit: Option<Limit>,
    /// A leak check: records allocation sites and, maybe, backtraces.
    pub leak: bool,
}

/// The limit of a budget scope.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Limit {
    /// This many bytes.
    Bytes(u64),
    /// This many [`FRACTION_ONE`]ths of each device's capacity.
    Fraction(u64),
}

/// The unit of [`Limit::Fraction`]: 2^53, so that any fraction a budget takes (a double in
/// (0, 1]) keeps its value to one part in 2^32 or better down to 2^-21, and stays above 0
/// down to 2^-53.
pub(crate) const FRACTION_ONE: u64 = 1 << 53;

impl ScopeKind {
    /// A leak check.
    pub const LEAK: Self = Self {
        limit: None,
        leak: true,
    };
    /// A peak-memory scope.
    pub const PEAK: Self = Self {
        limit: None,
        leak: false,
    };
    /// A budget of `limit`.
    pub const fn budget(limit: Limit) -> Self {
        Self {
            limit: Some(limit),
            leak: false,
        }
    }
    /// A leak check that is also a budget of `limit`.
    pub const fn leak_and_budget(limit: Limit) -> Self {
        Self {
            limit: Some(limit),
            leak: true,
        }
    }
}

/// The counters of one open (or closed) scope.
#[derive(Debug)]
pub(crate) struct Scope {
    /// Identity of the device's tracker the scope belongs to.
    tracker: usize,
    pub kind: ScopeKind,
    /// Bytes (block sizes) charged to the scope and still live (on all devices together).
    pub live: AtomicU64,
    /// Fraction budgets only: bytes charged and still live per device (by tracker identity),
    /// each checked against that device's own capacity.
    per_device: Mutex<FxHashMap<usize, u64>>,
    /// The highest `live` seen.
    pub peak: AtomicU64,
    /// Allocations charged to the scope.
    pub allocations: AtomicU64,
    /// Allocations charged to the scope and still live.
    pub live_allocations: AtomicU64,
    /// Leak checks: capture a backtrace per allocation.
    pub force_backtrace: AtomicBool,
    /// Where the scope was opened.
    pub opened_at: &'static Location<'static>,
}

impl Scope {
    /// Whether the blocks charged to the scope and still live exceed `allowed` bytes: the test
    /// a leak report would make, read from the scope's counter instead of scanning the side
    /// table (`live` is exactly the block sizes of its live recorded allocations, on all
    /// devices). A scope's end builds its report only when this holds.
    pub fn live_exceeds(&self, allowed: u64) -> bool {
        self.live.load(Relaxed) > allowed
    }

    fn limit(&self, device_total: u64) -> Option<u64> {
        match self.kind.limit? {
            Limit::Bytes(l) => Some(l),
            Limit::Fraction(parts) => {
                Some((device_total as u128 * parts as u128 / FRACTION_ONE as u128) as u64)
            }
        }
    }
}

/// The scopes one allocation is charged to. Inline up to two (the attribute macros open one
/// scope per function; nesting deeper spills to the heap): no heap allocation per tracked
/// allocation, and a small record to move into the table.
type Charged = SmallVec<[Arc<Scope>; 2]>;

/// A live allocation made while scopes were open, and what it was charged to.
struct Tracked {
    alloc: Allocation,
    seq: u64,
    scopes: Charged,
    site: &'static Location<'static>,
    backtrace: Option<Arc<Backtrace>>,
}

/// A recorded live allocation, as a leak check reports it.
pub(crate) struct LiveRecord {
    pub alloc: Allocation,
    /// The ordinal of the device it lives on.
    pub device: usize,
    pub site: &'static Location<'static>,
    pub backtrace: Option<Arc<Backtrace>>,
}

#[derive(Default)]
struct Table {
    map: FxHashMap<u64, Tracked>,
    seq: u64,
}

/// Per-device accounting state; lives in the device, so its address identifies the device.
#[derive(Default)]
pub(crate) struct Tracker {
    /// Scopes open on this device (thread-scoped on any thread, and device-wide).
    open: AtomicUsize,
    /// Device-wide scopes open.
    wide_open: AtomicUsize,
    /// Entries in `table` (written under its lock).
    tracked: AtomicUsize,
    wide: Mutex<Vec<Arc<Scope>>>,
    table: Mutex<Table>,
    /// Allocations a budget refused (they never reach the allocator, whose `num_ooms` does not
    /// count them).
    budget_refusals: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing that can panic runs while these locks are held, so the data is consistent.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Tracker {
    fn id(&self) -> usize {
        self as *const Self as usize
    }

    /// Whether some scope is open on this device (on any thread): the allocation fast-path test.
    #[inline]
    pub fn scopes_open(&self) -> bool {
        self.open.load(Relaxed) != 0 || ANY_DEVICE_OPEN.load(Relaxed) != 0
    }

    /// Whether a scope opened on this very device is still open, whatever other devices'
    /// any-device scopes do (tests run in parallel share `ANY_DEVICE_OPEN`).
    #[cfg(test)]
    pub(crate) fn own_scopes_open(&self) -> bool {
        self.open.load(Relaxed) != 0
    }

    /// Allocations a budget refused since the device was made (or the count was reset).
    pub fn budget_refusals(&self) -> u64 {
        self.budget_refusals.load(Relaxed)
    }

    /// Sets [`Tracker::budget_refusals`] back to 0.
    pub fn reset_budget_refusals(&self) {
        self.budget_refusals.store(0, Relaxed);
    }

    /// Whether some live allocation is recorded: the free fast-path test.
    #[inline]
    pub fn tracking(&self) -> bool {
        self.tracked.load(Relaxed) != 0
    }

    /// Opens a thread-scoped scope on the calling thread.
    pub fn open_scope(&self, kind: ScopeKind, opened_at: &'static Location<'static>) -> Arc<Scope> {
        let scope = new_scope(self.id(), kind, opened_at);
        self.open.fetch_add(1, Relaxed);
        // During thread teardown the stack is gone: the scope then charges nothing.
        let _ = SCOPES.try_with(|s| s.borrow_mut().push(scope.clone()));
        scope
    }

    /// Moves a thread-scoped scope of the calling thread to the device-wide list.
    pub fn make_wide(&self, scope: &Arc<Scope>) {
        remove_from_thread(scope);
        lock(&self.wide).push(scope.clone());
        self.wide_open.fetch_add(1, Relaxed);
    }

    /// Closes a scope: it is charged by no further allocation.
    pub fn close(&self, scope: &Arc<Scope>, wide: bool) {
        if wide {
            lock(&self.wide).retain(|s| !Arc::ptr_eq(s, scope));
            self.wide_open.fetch_sub(1, Relaxed);
        } else {
            remove_from_thread(scope);
        }
        self.open.fetch_sub(1, Relaxed);
    }

    /// The open scopes an allocation on this thread is charged to.
    fn applicable(&self) -> Charged {
        let id = self.id();
        let mut v = Charged::new();
        let _ = SCOPES.try_with(|s| {
            if let Ok(s) = s.try_borrow() {
                v.extend(
                    s.iter()
                        .filter(|x| x.tracker == id || x.tracker == ANY_DEVICE)
                        .cloned(),
                );
            }
        });
        if self.wide_open.load(Relaxed) != 0 {
            v.extend(lock(&self.wide).iter().cloned());
        }
        v
    }

    /// Bytes the budgets that apply to an allocation on this thread (its own and device-wide
    /// ones) still allow, the tightest of them, in whole blocks of `MIN_BLOCK` bytes (`None`:
    /// no budget applies). `device_total`:
    /// the device's capacity, for fraction budgets.
    pub fn budget_room(&self, device_total: u64) -> Option<u64> {
        if !self.scopes_open() {
            return None;
        }
        let dev = self.id();
        self.applicable()
            .iter()
            .filter_map(|s| {
                let limit = s.limit(device_total)?;
                let used = match s.kind.limit {
                    // a fraction budget counts each device on its own
                    Some(Limit::Fraction(_)) => lock(&s.per_device).get(&dev).copied().unwrap_or(0),
                    _ => s.live.load(Relaxed),
                };
                // Budgets count blocks of MIN_BLOCK bytes at least: only whole blocks of the
                // remainder can be allocated (a room of 1000 bytes lets 512 through, not 1000).
                Some(limit.saturating_sub(used) / MIN_BLOCK * MIN_BLOCK)
            })
            .min()
    }

    /// The slow allocation path, taken while some scope is open on the device: checks budgets
    /// before calling the allocator, charges the scopes, records the allocation. The caller's
    /// location (passed down through `#[track_caller]`) is what a leak check reports, and what
    /// the allocator's history records.
    #[track_caller]
    pub fn allocate(
        &self,
        allocator: &CachingAllocator,
        bytes: u64,
        stream: StreamId,
    ) -> Result<Allocation> {
        let site = Location::caller();
        if bytes == 0 {
            // Nothing is allocated (a null handle): nothing to charge or record, but counted as
            // an allocation, as rmm's statistics count one of 0 bytes.
            let a = allocator.allocate(bytes, stream)?;
            for s in self.applicable() {
                s.allocations.fetch_add(1, Relaxed);
            }
            return Ok(a);
        }
        let scopes = self.applicable();
        if scopes.is_empty() {
            return allocator.allocate(bytes, stream);
        }
        // The allocator rounds every request up to a multiple of MIN_BLOCK (at least), so this is
        // a lower bound of the block size, exact under the default configuration. A request too
        // large to round is left to the allocator to reject.
        let estimate = bytes
            .max(1)
            .checked_next_multiple_of(MIN_BLOCK)
            .unwrap_or(0);
        let total = allocator.device_total();
        let dev = self.id();
        // Each scope's live bytes right after the charge: the block counted with every block of
        // the scope still live at that instant (a block another thread is freeing is credited
        // before the allocator frees it, so a later read could miss the two together).
        let mut charged = match charge(&scopes, estimate, total, dev) {
            Ok(after) => after,
            Err(e) => {
                self.budget_refusals.fetch_add(1, Relaxed);
                return Err(Error::BudgetExceeded(e));
            }
        };
        let a = match allocator.allocate(bytes, stream) {
            Ok(a) => a,
            Err(e) => {
                uncharge(&scopes, estimate, dev);
                return Err(e);
            }
        };
        // The block may be larger than the estimate (power-of-two rounding, an unsplit block):
        // charge the rest, and give the block back if that breaks a budget.
        if a.size > estimate {
            match charge(&scopes, a.size - estimate, total, dev) {
                Ok(after) => charged = after,
                Err(mut e) => {
                    uncharge(&scopes, estimate, dev);
                    if let Err(fe) = allocator.free(a) {
                        tracing::error!(error = %fe, "freeing an over-budget allocation failed");
                    }
                    e.requested = a.size;
                    e.in_use = e.in_use.saturating_sub(estimate);
                    self.budget_refusals.fetch_add(1, Relaxed);
                    return Err(Error::BudgetExceeded(e));
                }
            }
        } else if a.size < estimate {
            uncharge(&scopes, estimate - a.size, dev);
            for v in &mut charged {
                *v -= estimate - a.size;
            }
        }
        let mut want_backtrace = None;
        for (s, &live) in scopes.iter().zip(&charged) {
            // Loads first: a read-modify-write only when the peak moves.
            if live > s.peak.load(Relaxed) {
                s.peak.fetch_max(live, Relaxed);
            }
            s.allocations.fetch_add(1, Relaxed);
            s.live_allocations.fetch_add(1, Relaxed);
            if s.kind.leak {
                let forced = s.force_backtrace.load(Relaxed);
                want_backtrace = Some(want_backtrace.unwrap_or(false) | forced);
            }
        }
        // A backtrace per allocation costs microseconds: only on request (`with_backtraces`)
        // or with OOMGUARD_LEAK_BACKTRACE=1, not merely because RUST_BACKTRACE is set.
        let backtrace = want_backtrace
            .filter(|&forced| forced || backtraces_from_env())
            .and_then(|_| {
                let bt = Backtrace::force_capture();
                (bt.status() == BacktraceStatus::Captured).then(|| Arc::new(bt))
            });
        let mut t = lock(&self.table);
        t.seq += 1;
        let entry = Tracked {
            alloc: a,
            seq: t.seq,
            scopes,
            site,
            backtrace,
        };
        let stale = t.map.insert(a.ptr, entry);
        // Written under the table's lock only: a store, not a read-modify-write.
        self.tracked.store(t.map.len(), Relaxed);
        drop(t);
        // A stale record: its allocation was freed behind the device's back (through the
        // allocator directly), since the address was handed out again. Credit it now.
        if let Some(old) = stale {
            credit(&old, dev);
        }
        Ok(a)
    }

    /// Credits a recorded allocation back to its scopes. Called before the allocator frees it,
    /// so that the address cannot be handed out (and recorded) again in between.
    pub fn release(&self, a: &Allocation) {
        let old = {
            let mut t = lock(&self.table);
            match t.map.get(&a.ptr) {
                // Only the very allocation (same block generation): a double free of a stale
                // handle must not uncount the live allocation now at that address.
                Some(e) if e.alloc == *a => {
                    let old = t.map.remove(&a.ptr);
                    self.tracked.store(t.map.len(), Relaxed);
                    old
                }
                _ => None,
            }
        };
        if let Some(old) = old {
            credit(&old, self.id());
        }
    }

    /// The recorded live allocations charged to `scope`, in allocation order (`device`: this
    /// tracker's device ordinal, for the report).
    pub fn live_in(&self, scope: &Arc<Scope>, device: usize) -> Vec<LiveRecord> {
        let t = lock(&self.table);
        let mut v: Vec<(u64, LiveRecord)> = t
            .map
            .values()
            .filter(|e| e.scopes.iter().any(|s| Arc::ptr_eq(s, scope)))
            .map(|e| {
                (
                    e.seq,
                    LiveRecord {
                        alloc: e.alloc,
                        device,
                        site: e.site,
                        backtrace: e.backtrace.clone(),
                    },
                )
            })
            .collect();
        drop(t);
        v.sort_by_key(|(seq, _)| *seq);
        v.into_iter().map(|(_, r)| r).collect()
    }
}

/// Whether `OOMGUARD_LEAK_BACKTRACE=1` asks leak checks for a backtrace per allocation.
fn backtraces_from_env() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("OOMGUARD_LEAK_BACKTRACE").is_ok_and(|v| v == "1"))
}

/// Opens a scope that applies to every device, charged by the calling thread's allocations.
pub(crate) fn open_any_device(
    kind: ScopeKind,
    opened_at: &'static Location<'static>,
) -> Arc<Scope> {
    let scope = new_scope(ANY_DEVICE, kind, opened_at);
    ANY_DEVICE_OPEN.fetch_add(1, Relaxed);
    attach(&scope);
    scope
}

/// Closes a scope from [`open_any_device`] (detaching it from this thread if attached).
pub(crate) fn close_any_device(scope: &Arc<Scope>) {
    detach(scope);
    ANY_DEVICE_OPEN.fetch_sub(1, Relaxed);
}

/// Closes a scope from [`open_any_device`] that is not attached to this thread.
pub(crate) fn close_any_device_detached(_scope: &Arc<Scope>) {
    ANY_DEVICE_OPEN.fetch_sub(1, Relaxed);
}

/// Makes the calling thread's allocations charge `scope` (until [`detach`]). An async task
/// attaches its scopes around each poll, so they never leak to other tasks of the thread.
pub(crate) fn attach(scope: &Arc<Scope>) {
    let _ = SCOPES.try_with(|s| s.borrow_mut().push(scope.clone()));
}

/// Undoes [`attach`].
pub(crate) fn detach(scope: &Arc<Scope>) {
    remove_from_thread(scope);
}

fn new_scope(tracker: usize, kind: ScopeKind, opened_at: &'static Location<'static>) -> Arc<Scope> {
    Arc::new(Scope {
        tracker,
        kind,
        live: AtomicU64::new(0),
        peak: AtomicU64::new(0),
        allocations: AtomicU64::new(0),
        live_allocations: AtomicU64::new(0),
        force_backtrace: AtomicBool::new(false),
        per_device: Mutex::new(FxHashMap::default()),
        opened_at,
    })
}

fn remove_from_thread(scope: &Arc<Scope>) {
    let _ = SCOPES.try_with(|s| {
        if let Ok(mut s) = s.try_borrow_mut() {
            if let Some(i) = s.iter().rposition(|x| Arc::ptr_eq(x, scope)) {
                s.remove(i);
            }
        }
    });
}

/// Adds `n` bytes allocated on device `dev` (a tracker identity) to every scope, returning each
/// scope's live bytes right after; fails, changing nothing, when a budget would be exceeded. A
/// fraction budget counts each device on its own, against that device's capacity.
fn charge(
    scopes: &[Arc<Scope>],
    n: u64,
    device_total: u64,
    dev: usize,
) -> Result<SmallVec<[u64; 2]>, BudgetExceeded> {
    // (as `Charged`: no heap allocation for the usual one or two scopes)
    let mut after = SmallVec::new();
    for (i, s) in scopes.iter().enumerate() {
        // A refusal carries the limit that refused it: only a scope with a limit refuses.
        let r = match (s.kind.limit, s.limit(device_total)) {
            (_, None) => Ok(s.live.fetch_add(n, Relaxed)),
            (Some(Limit::Fraction(_)), Some(limit)) => {
                let mut map = lock(&s.per_device);
                let cur = map.entry(dev).or_default();
                match cur.checked_add(n).filter(|&v| v <= limit) {
                    Some(v) => {
                        *cur = v;
                        Ok(s.live.fetch_add(n, Relaxed))
                    }
                    None => Err((*cur, limit)),
                }
            }
            (_, Some(limit)) => s
                .live
                .fetch_update(Relaxed, Relaxed, |cur| {
                    cur.checked_add(n).filter(|&v| v <= limit)
                })
                .map_err(|cur| (cur, limit)),
        };
        match r {
            Ok(before) => after.push(before.saturating_add(n)),
            Err((in_use, limit)) => {
                uncharge(&scopes[..i], n, dev);
                return Err(BudgetExceeded {
                    requested: n,
                    in_use,
                    limit,
                    opened_at: Some(s.opened_at),
                });
            }
        }
    }
    Ok(after)
}

/// Takes `n` bytes of device `dev` off every scope.
fn uncharge(scopes: &[Arc<Scope>], n: u64, dev: usize) {
    for s in scopes {
        if let Some(Limit::Fraction(_)) = s.kind.limit {
            if let Some(cur) = lock(&s.per_device).get_mut(&dev) {
                *cur = cur.saturating_sub(n);
            }
        }
        s.live.fetch_sub(n, Relaxed);
    }
}

/// Credits a recorded allocation of device `dev` back to its scopes.
fn credit(t: &Tracked, dev: usize) {
    uncharge(&t.scopes, t.alloc.size, dev);
    for s in &t.scopes {
        s.live_allocations.fetch_sub(1, Relaxed);
    }
}
