//! The panic hook kept quiet for the out-of-memory panics [`train_step`](crate::train_step) and
//! [`find_max_batch`](crate::find_max_batch) catch and handle: a plain tch method's
//! out-of-memory is a panic, and the hook would print it (libtorch's C++ frames, and a Rust
//! backtrace with `RUST_BACKTRACE`), about 60 lines for each caught one.
//!
//! One hook is installed, once, in front of the one in place then (the default, or the
//! program's own): it says nothing for a panic on a thread inside a [`QuietOomPanics`] whose
//! message is libtorch's out-of-memory ([`crate::panic_message_is_oom`]), and hands every other
//! panic to the hook it replaced. A hook the program sets later replaces it (that hook then
//! sees every panic, as it would anyway).

use std::cell::Cell;
use std::panic::{self, PanicHookInfo};
use std::sync::Once;

use crate::catch::payload_is_oom;

thread_local! {
    /// How many [`QuietOomPanics`] are alive on this thread.
    static QUIET: Cell<usize> = const { Cell::new(0) };
}

static INSTALL: Once = Once::new();

/// Puts the quiet hook in front of the current one (once per process).
fn install() {
    // Setting a hook from a panicking thread panics: a step run by a destructor during an
    // unwind keeps the hook as it is.
    if std::thread::panicking() {
        return;
    }
    INSTALL.call_once(|| {
        let previous = panic::take_hook();
        panic::set_hook(Box::new(move |info: &PanicHookInfo<'_>| {
            let quiet = QUIET.with(Cell::get) > 0;
            if quiet && payload_is_oom(info.payload()) {
                return;
            }
            previous(info)
        }));
    });
}

/// While alive, the panic hook is silent for libtorch out-of-memory panics on this thread (the
/// caller catches and handles them); every other panic, and those of other threads, print. A
/// guard, not a closure, so that `#[track_caller]` callers keep their caller's location.
pub(crate) struct QuietOomPanics {
    /// Not `Send`: the depth is this thread's.
    _thread: std::marker::PhantomData<*const ()>,
}

impl QuietOomPanics {
    pub(crate) fn enter() -> Self {
        install();
        QUIET.with(|q| q.set(q.get() + 1));
        Self {
            _thread: std::marker::PhantomData,
        }
    }
}

impl Drop for QuietOomPanics {
    fn drop(&mut self) {
        QUIET.with(|q| q.set(q.get().saturating_sub(1)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_depth_follows_the_calls_and_unwinds() {
        assert_eq!(QUIET.with(Cell::get), 0);
        {
            let _outer = QuietOomPanics::enter();
            assert_eq!(QUIET.with(Cell::get), 1);
            {
                let _inner = QuietOomPanics::enter();
                assert_eq!(QUIET.with(Cell::get), 2);
            }
            assert_eq!(QUIET.with(Cell::get), 1);
        }
        let r = panic::catch_unwind(|| {
            let _quiet = QuietOomPanics::enter();
            panic!("a bug")
        });
        assert!(r.is_err());
        assert_eq!(QUIET.with(Cell::get), 0, "back to 0 after an unwind");
    }
}
