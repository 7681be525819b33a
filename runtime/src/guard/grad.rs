//! Grad mode: a thread-local switch that tells frameworks built on oomguard whether to record
//! what backward needs, as PyTorch's `torch.no_grad()`, `torch.enable_grad()`,
//! `torch.set_grad_enabled(b)` and `torch.inference_mode()`.
//!
//! oomguard itself computes no gradients: the switch is the convention through which the code
//! that does (a layer, an autograd tape) learns that it may skip saving activations, which is
//! where `no_grad` saves memory. Each thread has its own mode, on by default; the guards nest
//! and restore the previous mode on drop, also while unwinding.
//!
//! How a framework consults it — save activations for backward only when grad is enabled:
//!
//! ```
//! use oomguard_runtime::{is_grad_enabled, no_grad, ByteSize, Device, DeviceBuffer, Result};
//!
//! struct Layer {
//!     saved: Vec<DeviceBuffer<f32>>, // activations kept for backward
//! }
//! impl Layer {
//!     fn forward(&mut self, x: DeviceBuffer<f32>) -> Result<DeviceBuffer<f32>> {
//!         let y = x.device().zeros::<f32>(x.len())?; // ... compute y from x ...
//!         if is_grad_enabled() {
//!             self.saved.push(x); // backward needs the input: keep it alive
//!         } // otherwise `x` is dropped here and its memory goes back to the cache
//!         Ok(y)
//!     }
//! }
//!
//! let dev = Device::sim(ByteSize::gib(1));
//! let mut layer = Layer { saved: Vec::new() };
//! layer.forward(dev.zeros(1024)?)?;
//! assert_eq!(layer.saved.len(), 1);
//! {
//!     let _g = no_grad();
//!     layer.forward(dev.zeros(1024)?)?;
//! }
//! assert_eq!(layer.saved.len(), 1); // nothing saved under no_grad
//! assert!(is_grad_enabled()); // restored
//! # Ok::<(), oomguard_runtime::Error>(())
//! ```
//!
//! Async code: the mode is per thread, and a task may be polled on any thread. Capture it with
//! [`GradMode::current`] when the task is made and re-apply it around each poll with
//! [`set_grad_mode_guard`]. [`GradGuard`] is not `Send`, so holding one across an `.await` in a
//! spawned task does not compile.

use std::cell::{Cell, RefCell};
use std::marker::PhantomData;

thread_local! {
    static MODE: Cell<GradMode> = const { Cell::new(GradMode::DEFAULT) };
    /// The live guards of this thread, oldest first: (guard id, the mode it set). The mode in
    /// force is the newest live guard's, or `BASE` when none is live, so guards dropped out of
    /// order never leave a mode that no live guard set.
    static GUARDS: RefCell<Vec<(u64, GradMode)>> = const { RefCell::new(Vec::new()) };
    /// The mode before the oldest live guard.
    static BASE: Cell<GradMode> = const { Cell::new(GradMode::DEFAULT) };
    static NEXT_ID: Cell<u64> = const { Cell::new(0) };
}

/// The grad state of a thread: whether grad is enabled and whether inference mode is on.
///
/// ```
/// use oomguard_runtime::{inference_mode, set_grad_mode_guard, GradMode};
/// let captured = {
///     let _g = inference_mode();
///     GradMode::current()
/// };
/// assert_eq!(GradMode::current(), GradMode::default());
/// let _g = set_grad_mode_guard(captured); // e.g. on the thread that polls a future
/// assert!(!GradMode::current().grad_enabled);
/// assert!(GradMode::current().inference_mode);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GradMode {
    /// Whether frameworks should record what backward needs.
    pub grad_enabled: bool,
    /// Whether inference mode is on (set by [`inference_mode`]; implies grad was disabled when
    /// it was entered, though [`enable_grad`] inside it turns grad back on, as in PyTorch).
    pub inference_mode: bool,
}

impl GradMode {
    /// Grad enabled, inference mode off: every thread's initial mode.
    pub const DEFAULT: GradMode = GradMode {
        grad_enabled: true,
        inference_mode: false,
    };

    /// The calling thread's mode.
    pub fn current() -> GradMode {
        MODE.try_with(Cell::get).unwrap_or(GradMode::DEFAULT)
    }
}

impl Default for GradMode {
    fn default() -> Self {
        GradMode::DEFAULT
    }
}

/// Restores the thread's previous [`GradMode`] when dropped (also while unwinding). Not `Send`:
/// it must be dropped on the thread whose mode it changed.
///
/// Guards dropped out of order: the mode in force is always the one set by the newest guard
/// still alive (or, with none alive, the mode before the first), never one that no live guard
/// set.
#[must_use = "the grad mode reverts as soon as the guard is dropped"]
#[derive(Debug)]
pub struct GradGuard {
    prev: GradMode,
    id: u64,
    _not_send: PhantomData<*const ()>,
}

impl GradGuard {
    /// The mode that will be restored on drop.
    pub fn previous(&self) -> GradMode {
        self.prev
    }
}

impl Drop for GradGuard {
    fn drop(&mut self) {
        let id = self.id;
        let prev = self.prev;
        // During thread teardown the thread-locals may be gone: nothing to restore then.
        let _ = GUARDS.try_with(|g| {
            let Ok(mut g) = g.try_borrow_mut() else {
                return;
            };
            let mode = match g.iter().rposition(|e| e.0 == id) {
                Some(i) => {
                    g.remove(i);
                    g.last()
                        .map(|e| e.1)
                        .unwrap_or_else(|| BASE.try_with(Cell::get).unwrap_or(prev))
                }
                None => prev,
            };
            let _ = MODE.try_with(|m| m.set(mode));
        });
    }
}

fn update(f: impl FnOnce(&mut GradMode)) -> GradGuard {
    let prev = GradMode::current();
    let mut next = prev;
    f(&mut next);
    let id = NEXT_ID
        .try_with(|n| {
            let id = n.get();
            n.set(id + 1);
            id
        })
        .unwrap_or(u64::MAX);
    let _ = GUARDS.try_with(|g| {
        if let Ok(mut g) = g.try_borrow_mut() {
            if g.is_empty() {
                let _ = BASE.try_with(|b| b.set(prev));
            }
            g.push((id, next));
        }
    });
    let _ = MODE.try_with(|m| m.set(next));
    GradGuard {
        prev,
        id,
        _not_send: PhantomData,
    }
}

/// Disables grad on this thread until the guard drops (`torch.no_grad()`).
///
/// ```
/// use oomguard_runtime::{is_grad_enabled, no_grad, enable_grad};
/// {
///     let _g = no_grad();
///     assert!(!is_grad_enabled());
///     {
///         let _e = enable_grad();
///         assert!(is_grad_enabled());
///     }
///     assert!(!is_grad_enabled());
/// }
/// assert!(is_grad_enabled());
/// ```
pub fn no_grad() -> GradGuard {
    set_grad_enabled(false)
}

/// Enables grad on this thread until the guard drops (`torch.enable_grad()`).
pub fn enable_grad() -> GradGuard {
    set_grad_enabled(true)
}

/// Sets grad on or off on this thread until the guard drops (`torch.set_grad_enabled(b)`).
pub fn set_grad_enabled(enabled: bool) -> GradGuard {
    update(|m| m.grad_enabled = enabled)
}

/// Turns inference mode on and grad off on this thread until the guard drops
/// (`torch.inference_mode()`).
pub fn inference_mode() -> GradGuard {
    update(|m| {
        m.grad_enabled = false;
        m.inference_mode = true;
    })
}

/// Sets this thread's whole mode until the guard drops: re-applies a mode captured with
/// [`GradMode::current`] (e.g. around each poll of a future).
pub fn set_grad_mode_guard(mode: GradMode) -> GradGuard {
    update(|m| *m = mode)
}

/// Whether grad is enabled on this thread (`torch.is_grad_enabled()`).
pub fn is_grad_enabled() -> bool {
    GradMode::current().grad_enabled
}

/// Whether inference mode is on on this thread (`torch.is_inference_mode_enabled()`).
pub fn is_inference_mode() -> bool {
    GradMode::current().inference_mode
}

/// Runs `f` with grad disabled; the previous mode comes back afterwards, also when `f` panics.
///
/// ```
/// use oomguard_runtime::{is_grad_enabled, with_no_grad};
/// let r = std::panic::catch_unwind(|| with_no_grad(|| panic!("inside")));
/// assert!(r.is_err());
/// assert!(is_grad_enabled());
/// ```
pub fn with_no_grad<R>(f: impl FnOnce() -> R) -> R {
    with_grad_enabled(false, f)
}

/// Runs `f` with grad set to `enabled`; the previous mode comes back afterwards, also when `f`
/// panics.
pub fn with_grad_enabled<R>(enabled: bool, f: impl FnOnce() -> R) -> R {
    let _g = set_grad_enabled(enabled);
    f()
}

/// Runs `f` in inference mode; the previous mode comes back afterwards, also when `f` panics.
pub fn with_inference_mode<R>(f: impl FnOnce() -> R) -> R {
    let _g = inference_mode();
    f()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::panic::{catch_unwind, AssertUnwindSafe};

    #[test]
    fn nests_like_pytorch() {
        assert_eq!(GradMode::current(), GradMode::DEFAULT);
        let a = no_grad();
        assert!(!is_grad_enabled());
        let b = set_grad_enabled(true);
        assert!(is_grad_enabled());
        let c = inference_mode();
        assert!(!is_grad_enabled() && is_inference_mode());
        let d = enable_grad();
        assert!(is_grad_enabled() && is_inference_mode());
        drop(d);
        assert!(!is_grad_enabled() && is_inference_mode());
        drop(c);
        assert!(is_grad_enabled() && !is_inference_mode());
        drop(b);
        assert!(!is_grad_enabled());
        drop(a);
        assert_eq!(GradMode::current(), GradMode::DEFAULT);
    }

    #[test]
    fn restored_after_panic() {
        let _outer = no_grad();
        let r = catch_unwind(AssertUnwindSafe(|| {
            let _g = enable_grad();
            let _i = inference_mode();
            with_grad_enabled(true, || panic!("boom"))
        }));
        assert!(r.is_err());
        assert!(!is_grad_enabled());
        assert!(!is_inference_mode());
        let r = catch_unwind(|| with_inference_mode(|| panic!("boom")));
        assert!(r.is_err());
        assert!(!is_inference_mode());
    }

    #[test]
    fn per_thread() {
        let _g = no_grad();
        let other = std::thread::spawn(is_grad_enabled).join().unwrap();
        assert!(other, "a new thread starts with grad enabled");
        assert!(!is_grad_enabled());
    }

    #[test]
    fn closure_returns_value_and_captured_mode_reapplies() {
        assert_eq!(with_no_grad(|| (is_grad_enabled(), 7)), (false, 7));
        let captured = with_inference_mode(GradMode::current);
        let seen = std::thread::spawn(move || {
            let g = set_grad_mode_guard(captured);
            assert_eq!(g.previous(), GradMode::DEFAULT);
            GradMode::current()
        })
        .join()
        .unwrap();
        assert_eq!(seen, captured);
        assert_eq!(GradMode::current(), GradMode::DEFAULT);
    }
}
