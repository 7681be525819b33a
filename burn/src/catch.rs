//! cubecl out-of-memory that surfaces as a panic, turned into an [`Error`].
//!
//! See [`catch_oom`] for the rules.

use std::cell::Cell;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, Once};

use oomguard::retry::advanced::panic_text as payload_text;

use crate::compat::{CALL_ERROR, INTO_DATA_EXPECT, UNWRAP};
use crate::Error;

static OOM_PANICS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// How many [`catch_oom`] calls this thread is inside: a panic there is that call's own
    /// (it reads the payload), so the hook does not count it for the other threads' calls.
    static INSIDE_CATCH: Cell<u32> = const { Cell::new(0) };
}
static LAST_OOM_PANIC: Mutex<String> = Mutex::new(String::new());
static HOOK: Once = Once::new();

/// Whether a panic message is one of cubecl's out-of-memory errors: the message itself, an
/// `unwrap` of one, or `into_data`'s message over an `ExecutionError` holding one.
pub fn panic_message_is_oom(message: &str) -> bool {
    let inner = message
        .strip_prefix(INTO_DATA_EXPECT)
        .and_then(|m| m.strip_prefix(": "))
        .or_else(|| message.strip_prefix(UNWRAP))
        .unwrap_or(message);
    oomguard::retry::cubecl_text_is_oom(inner)
}

fn install_hook() {
    HOOK.call_once(|| {
        let previous = panic::take_hook();
        panic::set_hook(Box::new(move |info| {
            if let Some(text) = payload_text(info.payload()) {
                if panic_message_is_oom(text) && INSIDE_CATCH.with(Cell::get) == 0 {
                    *LAST_OOM_PANIC.lock().unwrap_or_else(|e| e.into_inner()) = text.to_string();
                    OOM_PANICS.fetch_add(1, Ordering::SeqCst);
                }
            }
            previous(info);
        }));
    });
}

/// Out-of-memory panics seen so far (after the first [`catch_oom`]) on threads that were not
/// inside a `catch_oom` call when they panicked (cubecl's device threads; a panic inside
/// `catch_oom` is that call's own and is not counted).
pub fn oom_panics() -> u64 {
    OOM_PANICS.load(Ordering::SeqCst)
}

fn last_oom_panic() -> String {
    LAST_OOM_PANIC
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone()
}

/// Runs `f`, turning a cubecl out-of-memory that surfaces as a panic (on this thread or on a
/// device thread while `f` runs) into [`Error::DevicePanic`]; `f`'s own errors are returned as
/// they are, and any other panic continues.
///
/// On burn 0.21 a failed reservation often panics instead of returning an error: `into_data`
/// panics on the `ExecutionError` it reads, and a reservation that fails on cubecl's device
/// thread (`initialize_memory`) panics *there*; the caller then panics with a bare `CallError`
/// that says nothing about memory. `catch_oom` runs a closure under `catch_unwind` and a panic
/// hook (installed once, chained to the previous hook, so messages still print) that counts
/// cubecl out-of-memory panics on every thread:
/// - a panic whose message is a cubecl out-of-memory (`into_data`'s message, an `unwrap` of
///   cubecl's error, or the error's own text; read by shape, never by substring) is
///   [`Error::DevicePanic`];
/// - a `CallError` panic is one too when a device thread panicked with an out-of-memory while
///   the closure ran; otherwise it is not ours to interpret and the panic continues;
/// - a closure that *returned* while a device thread panicked with an out-of-memory also gets
///   [`Error::DevicePanic`]: some of its tensors were never allocated, its results are not
///   trusted;
/// - every other panic continues (`resume_unwind`): it is never turned into an error.
///
/// The count is process-wide (cubecl's device threads have no name to tell devices apart): an
/// out-of-memory on another device during the closure also fails it, as an out-of-memory. A
/// panic on a thread that is itself inside `catch_oom` is not counted: that call reads it from
/// the payload, so concurrent `catch_oom` calls on other threads (two training loops, parallel
/// tests) do not fail each other. The
/// hook is installed by the first call; a panic hook set later without chaining to the one it
/// replaces (`std::panic::take_hook`) stops the count, and a bare `CallError` then panics on.
///
/// ```
/// use oomguard::IsOom;
/// use oomguard_burn::{catch_oom, Error};
///
/// // A panic with cubecl's out-of-memory text (what a failed reservation raises):
/// let err = catch_oom(|| -> Result<(), Error> {
///     panic!("called `Result::unwrap()` on an `Err` value: can't allocate buffer of size: 4096\n")
/// })
/// .unwrap_err();
/// assert!(err.is_oom());
/// // Any other panic is not caught.
/// assert!(std::panic::catch_unwind(|| catch_oom(|| -> Result<(), Error> { panic!("bug") })).is_err());
/// ```
pub fn catch_oom<T, E: Into<Error>>(f: impl FnOnce() -> Result<T, E>) -> Result<T, Error> {
    install_hook();
    struct Inside;
    impl Drop for Inside {
        fn drop(&mut self) {
            INSIDE_CATCH.with(|d| d.set(d.get() - 1));
        }
    }
    let before = oom_panics();
    INSIDE_CATCH.with(|d| d.set(d.get() + 1));
    let inside = Inside;
    let out = panic::catch_unwind(AssertUnwindSafe(f));
    drop(inside);
    let device_oom = oom_panics() != before;
    match out {
        Ok(_) if device_oom => Err(Error::DevicePanic {
            message: last_oom_panic(),
        }),
        Ok(r) => r.map_err(Into::into),
        Err(payload) => {
            let text = payload_text(payload.as_ref()).unwrap_or("");
            let call_error = text.strip_prefix(UNWRAP) == Some(CALL_ERROR);
            if panic_message_is_oom(text) {
                Err(Error::DevicePanic {
                    message: text.to_string(),
                })
            } else if call_error && device_oom {
                Err(Error::DevicePanic {
                    message: last_oom_panic(),
                })
            } else {
                panic::resume_unwind(payload)
            }
        }
    }
}
