//! Guards of the calling thread's allocations on every device, for code that does not hold a
//! [`Device`] (the attribute macros use them): a budget and a leak check, and [`Scoped`], which
//! applies guards to an `async` body on each poll only, so that they never leak to other tasks
//! sharing the thread across an `.await`.

use std::future::Future;
use std::marker::PhantomData;
use std::panic::Location;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use super::grad::{set_grad_mode_guard, GradMode};
use super::leak::LeakAction;
use crate::device::tracker::{self, Limit, Scope, ScopeKind};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::leak_report::LeakReport;
use crate::ByteSize;

/// Opens a scope for every device, detached when `attached` is false (async use).
fn open(kind: ScopeKind, at: &'static Location<'static>, attached: bool) -> Arc<Scope> {
    let scope = tracker::open_any_device(kind, at);
    if !attached {
        tracker::detach(&scope);
    }
    scope
}

/// `fraction` in units of [`FRACTION_ONE`](crate::device::tracker::FRACTION_ONE) (it was
/// millionths: a fraction under 5e-7 became a budget of 0 bytes).
fn fraction_parts(fraction: f64) -> Result<u64> {
    use crate::device::tracker::FRACTION_ONE;
    if !(fraction > 0.0 && fraction <= 1.0) {
        return Err(Error::InvalidArgument(format!(
            "memory fraction {fraction} is outside (0, 1]"
        )));
    }
    match (fraction * FRACTION_ONE as f64).round() as u64 {
        0 => Err(Error::InvalidArgument(format!(
            "memory fraction {fraction} is below 2^-53, the smallest a budget tells from 0; \
             give a budget in bytes"
        ))),
        parts => Ok(parts),
    }
}

fn leak_report(scope: &Arc<Scope>, allowed: u64) -> LeakReport {
    let mut records = Vec::new();
    for dev in Device::all() {
        records.extend(dev.tracker().live_in(scope, dev.ordinal()));
    }
    LeakReport::from_records(records, allowed, scope.opened_at)
}

/// A memory budget over the calling thread's allocations on every device: inside the scope, the
/// bytes they allocate and keep live may not exceed the limit; an allocation that would fails
/// with [`Error::BudgetExceeded`] before touching the device.
///
/// ```
/// use oomguard_runtime::{guard::thread_budget, ByteSize, Device};
/// let dev = Device::sim(ByteSize::gib(1));
/// let budget = thread_budget(ByteSize::mib(1));
/// let a = dev.alloc::<u8>(1 << 19).unwrap();
/// assert!(dev.alloc::<u8>(1 << 20).unwrap_err().is_oom());
/// assert_eq!(budget.used(), 1 << 19);
/// # drop(a);
/// ```
#[must_use = "the budget covers only the guard's lifetime"]
#[derive(Debug)]
pub struct ThreadBudget {
    scope: Arc<Scope>,
    _not_send: PhantomData<*const ()>,
}

/// A [`ThreadBudget`] of `limit` bytes.
#[track_caller]
pub fn thread_budget(limit: impl Into<ByteSize>) -> ThreadBudget {
    ThreadBudget {
        scope: open(
            ScopeKind::budget(Limit::Bytes(limit.into().bytes())),
            Location::caller(),
            true,
        ),
        _not_send: PhantomData,
    }
}

/// A [`ThreadBudget`] of `fraction` of each device's capacity; `Err` unless 0 < fraction ≤ 1.
/// Each device is counted on its own: the bytes live on a device are checked against that
/// device's share ([`ThreadBudget::used`] is the sum over devices).
#[track_caller]
pub fn thread_budget_fraction(fraction: f64) -> Result<ThreadBudget> {
    let parts = fraction_parts(fraction)?;
    Ok(ThreadBudget {
        scope: open(
            ScopeKind::budget(Limit::Fraction(parts)),
            Location::caller(),
            true,
        ),
        _not_send: PhantomData,
    })
}

impl ThreadBudget {
    /// Bytes charged to the budget and still live.
    pub fn used(&self) -> u64 {
        self.scope.live.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Drop for ThreadBudget {
    fn drop(&mut self) {
        tracker::close_any_device(&self.scope);
    }
}

/// A leak check over the calling thread's allocations on every device: when it ends, every
/// buffer allocated inside and still live is a leak (see [`crate::guard::LeakCheck`] for the
/// per-device form and the report).
///
/// ```
/// use oomguard_runtime::{guard::{thread_leak_check, LeakAction}, ByteSize, Device};
/// let dev = Device::sim(ByteSize::gib(1));
/// let check = thread_leak_check().on_leak(LeakAction::Report);
/// let kept = dev.zeros::<f32>(10).unwrap();
/// assert_eq!(check.finish().unwrap_err().leaks.len(), 1);
/// # drop(kept);
/// ```
#[must_use = "the leak check covers only the guard's lifetime"]
#[derive(Debug)]
pub struct ThreadLeakCheck {
    scope: Arc<Scope>,
    action: LeakAction,
    allowed: u64,
    function: Option<&'static str>,
    finished: bool,
    _not_send: PhantomData<*const ()>,
}

/// A [`ThreadLeakCheck`] that panics on leaks (see [`ThreadLeakCheck::on_leak`]).
#[track_caller]
pub fn thread_leak_check() -> ThreadLeakCheck {
    leak_check_of(ScopeKind::LEAK, Location::caller())
}

/// A [`ThreadLeakCheck`] that is also a memory budget of `limit` bytes over the same
/// allocations: it behaves as a [`thread_budget`] opened right after it and dropped right before
/// it, at the cost of one scope instead of two (each allocation inside is charged and recorded
/// once). What `#[memory_budget]` and `#[leak_check]` on one function open.
///
/// ```
/// use oomguard_runtime::{guard::{thread_leak_check_with_budget, LeakAction}, ByteSize, Device};
/// let dev = Device::sim(ByteSize::gib(1));
/// let check = thread_leak_check_with_budget(ByteSize::mib(1)).on_leak(LeakAction::Report);
/// let kept = dev.alloc::<u8>(1 << 19).unwrap();
/// assert!(dev.alloc::<u8>(1 << 20).unwrap_err().is_oom());
/// assert_eq!(check.finish().unwrap_err().total_bytes, 1 << 19);
/// # drop(kept);
/// ```
#[track_caller]
pub fn thread_leak_check_with_budget(limit: impl Into<ByteSize>) -> ThreadLeakCheck {
    let kind = ScopeKind::leak_and_budget(Limit::Bytes(limit.into().bytes()));
    leak_check_of(kind, Location::caller())
}

/// As [`thread_leak_check_with_budget`], with a budget of `fraction` of each device's capacity
/// (see [`thread_budget_fraction`]); `Err` unless 0 < fraction ≤ 1.
#[track_caller]
pub fn thread_leak_check_with_budget_fraction(fraction: f64) -> Result<ThreadLeakCheck> {
    let kind = ScopeKind::leak_and_budget(Limit::Fraction(fraction_parts(fraction)?));
    Ok(leak_check_of(kind, Location::caller()))
}

fn leak_check_of(kind: ScopeKind, at: &'static Location<'static>) -> ThreadLeakCheck {
    ThreadLeakCheck {
        scope: open(kind, at, true),
        action: LeakAction::Panic,
        allowed: 0,
        function: None,
        finished: false,
        _not_send: PhantomData,
    }
}

impl ThreadLeakCheck {
    /// What to do on drop when leaks exceed the allowance.
    pub fn on_leak(mut self, action: LeakAction) -> Self {
        self.action = action;
        self
    }
    /// Tolerates leaks totalling at most `bytes`.
    pub fn allow(mut self, bytes: impl Into<ByteSize>) -> Self {
        self.allowed = bytes.into().bytes();
        self
    }
    /// Names the function the check covers, for the report (`#[leak_check]` does).
    pub fn named(mut self, function: &'static str) -> Self {
        self.function = Some(function);
        self
    }
    /// The buffers allocated inside the scope that are live now.
    pub fn report(&self) -> LeakReport {
        LeakReport {
            function: self.function,
            ..leak_report(&self.scope, self.allowed)
        }
    }
    /// Ends the scope: `Err` with the report when the leaks exceed the allowance.
    pub fn finish(mut self) -> Result<(), LeakReport> {
        self.finished = true;
        if !self.scope.live_exceeds(self.allowed) {
            return Ok(());
        }
        self.report().into_result()
    }
}

impl Drop for ThreadLeakCheck {
    fn drop(&mut self) {
        tracker::close_any_device(&self.scope);
        if !self.finished && self.scope.live_exceeds(self.allowed) {
            self.report().act(self.action);
        }
    }
}

/// The guards of an `async` body, applied on each poll by [`Scoped`].
#[derive(Debug, Default)]
pub struct GuardSet {
    no_grad: bool,
    budget: Option<Arc<Scope>>,
    leak: Option<(Arc<Scope>, LeakAction, u64)>,
    function: Option<&'static str>,
}

impl GuardSet {
    /// No guard.
    pub fn new() -> Self {
        Self::default()
    }
    /// Grad mode off while the body runs.
    pub fn no_grad(mut self) -> Self {
        self.no_grad = true;
        self
    }
    /// A budget of `limit` bytes over the body's allocations on every device.
    #[track_caller]
    pub fn budget(mut self, limit: u64) -> Self {
        self.budget = Some(open(
            ScopeKind::budget(Limit::Bytes(limit)),
            Location::caller(),
            false,
        ));
        self
    }
    /// A budget of `fraction` of each device's capacity, each device counted on its own.
    #[track_caller]
    pub fn budget_fraction(mut self, fraction: f64) -> Result<Self> {
        let parts = fraction_parts(fraction)?;
        self.budget = Some(open(
            ScopeKind::budget(Limit::Fraction(parts)),
            Location::caller(),
            false,
        ));
        Ok(self)
    }
    /// A leak check of the body's allocations.
    #[track_caller]
    pub fn leak_check(mut self, action: LeakAction, allowed: u64) -> Self {
        self.leak = Some((
            open(ScopeKind::LEAK, Location::caller(), false),
            action,
            allowed,
        ));
        self
    }
    /// Names the function the guards cover, for the leak report.
    pub fn named(mut self, function: &'static str) -> Self {
        self.function = Some(function);
        self
    }
    /// Runs `fut` with these guards applied on each poll.
    pub fn scope<F: Future>(self, fut: F) -> Scoped<F> {
        Scoped {
            fut: Box::pin(fut),
            guards: Some(self),
        }
    }

    fn scopes(&self) -> impl Iterator<Item = &Arc<Scope>> {
        self.budget.iter().chain(self.leak.iter().map(|l| &l.0))
    }

    /// Ends the scopes; the leak check's result (Ok without a leak check).
    fn end(mut self) -> Result<(), LeakReport> {
        for s in self.scopes() {
            tracker::close_any_device_detached(s);
        }
        self.budget = None;
        match self.leak.take() {
            Some((scope, _, allowed)) if !scope.live_exceeds(allowed) => Ok(()),
            Some((scope, action, allowed)) => {
                let r = LeakReport {
                    function: self.function,
                    ..leak_report(&scope, allowed)
                };
                if action == LeakAction::Report {
                    return r.into_result();
                }
                r.act(action);
                Ok(())
            }
            None => Ok(()),
        }
    }
}

impl Drop for GuardSet {
    fn drop(&mut self) {
        // Dropped before completion (a cancelled future): close the scopes, act on nothing.
        for s in self.budget.iter().chain(self.leak.iter().map(|l| &l.0)) {
            tracker::close_any_device_detached(s);
        }
    }
}

/// A future run with a [`GuardSet`] applied on each poll; resolves to the leak check's result
/// (for `LeakAction::Report`; other actions act when the body completes) and the body's output.
#[must_use = "futures do nothing unless polled"]
pub struct Scoped<F: Future> {
    fut: Pin<Box<F>>,
    guards: Option<GuardSet>,
}

impl<F: Future> Future for Scoped<F> {
    type Output = (Result<(), LeakReport>, F::Output);

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let Some(guards) = &this.guards else {
            panic!("`Scoped` polled after completion");
        };
        for s in guards.scopes() {
            tracker::attach(s);
        }
        // Detach (and restore grad mode) even if the body panics inside poll.
        struct Detach<'a>(&'a GuardSet);
        impl Drop for Detach<'_> {
            fn drop(&mut self) {
                for s in self.0.scopes() {
                    tracker::detach(s);
                }
            }
        }
        let detach = Detach(guards);
        let grad = guards.no_grad.then(|| {
            set_grad_mode_guard(GradMode {
                grad_enabled: false,
                ..GradMode::current()
            })
        });
        let polled = this.fut.as_mut().poll(cx);
        drop(grad);
        drop(detach);
        match (polled, this.guards.take()) {
            (Poll::Ready(out), Some(guards)) => Poll::Ready((guards.end(), out)),
            (Poll::Pending, guards) => {
                this.guards = guards;
                Poll::Pending
            }
            (Poll::Ready(out), None) => Poll::Ready((Ok(()), out)),
        }
    }
}
