//! A libtorch out-of-memory that surfaces as a panic, turned into an [`Error`].
//!
//! See [`catch_oom`] for the rules.

use std::any::Any;
use std::panic::{self, AssertUnwindSafe};

use oomguard::retry::advanced::panic_text as payload_text;
use oomguard::retry::libtorch_text_is_oom;

use crate::compat::{TORCH_DEBUG, TORCH_DISPLAY, UNWRAP};
use crate::Error;

/// libtorch's text inside a panic message, when the message is one of the forms a tch
/// out-of-memory panics with: an `unwrap` of `TchError::Torch` (what tch's plain methods do),
/// `TchError::Torch`'s display, or libtorch's text itself. `None` for any other message.
fn libtorch_text(message: &str) -> Option<String> {
    if let Some(debug) = message.strip_prefix(UNWRAP) {
        return debug.strip_prefix(TORCH_DEBUG).and_then(unescape_debug);
    }
    Some(
        message
            .strip_prefix(TORCH_DISPLAY)
            .unwrap_or(message)
            .to_string(),
    )
}

/// Reverses `str`'s `Debug` escapes for a string whose opening quote is already stripped;
/// `rest` must end with the closing quote and `)` (the `Torch(..)` variant). `None` when it
/// is not such a string.
fn unescape_debug(rest: &str) -> Option<String> {
    let mut out = String::with_capacity(rest.len());
    let mut chars = rest.chars();
    while let Some(c) = chars.next() {
        match c {
            '"' => return (chars.as_str() == ")").then_some(out),
            '\\' => match chars.next()? {
                'n' => out.push('\n'),
                'r' => out.push('\r'),
                't' => out.push('\t'),
                '0' => out.push('\0'),
                c @ ('\\' | '"' | '\'') => out.push(c),
                'u' => {
                    let hex = chars.as_str().strip_prefix('{')?;
                    let end = hex.find('}')?;
                    out.push(char::from_u32(u32::from_str_radix(&hex[..end], 16).ok()?)?);
                    chars = hex[end + 1..].chars();
                }
                _ => return None,
            },
            c => out.push(c),
        }
    }
    None
}

/// Whether a panic message is libtorch's out-of-memory as a tch method panics with it: the
/// `unwrap` of a `TchError::Torch` whose text is one (tch's plain methods), that error's display,
/// or libtorch's text itself; the text is read by its shape from the start
/// ([`oomguard::retry::libtorch_text_is_oom`]), never by a substring search.
pub fn panic_message_is_oom(message: &str) -> bool {
    libtorch_text(message).is_some_and(|text| libtorch_text_is_oom(&text))
}

/// Whether a panic's payload is a message that [`panic_message_is_oom`] accepts.
pub(crate) fn payload_is_oom(payload: &(dyn Any + Send)) -> bool {
    payload_text(payload).is_some_and(panic_message_is_oom)
}

/// Runs `f`, turning a libtorch out-of-memory that surfaces as a panic into
/// [`Error::OomPanic`]; `f`'s own errors are returned as they are (converted into [`Error`]), and
/// any other panic continues (`resume_unwind`): it is never turned into an error.
///
/// tch's plain methods (`Tensor::matmul`, `Tensor::backward`, `nn::Module::forward` of its
/// layers) call their `f_*` twin and `unwrap()` the `TchError`, so an out-of-memory inside them
/// is a panic whose message quotes libtorch's text. A panic is an out-of-memory when its message
/// is that `unwrap`, `TchError::Torch`'s display, or libtorch's text itself, and the text starts
/// with one of libtorch's out-of-memory messages ([`panic_message_is_oom`]). libtorch raises
/// its errors on the calling thread (the autograd engine rethrows a device thread's error in the
/// caller), so no other thread is watched. The panic hook still runs here: the message is
/// printed as for any panic. ([`train_step`](crate::train_step) and
/// [`find_max_batch`](crate::find_max_batch) keep the hook quiet for the out-of-memory panics
/// they catch on their thread: their report counts them.)
///
/// ```
/// use oomguard::IsOom;
/// use oomguard_tch::{catch_oom, Error};
///
/// // A panic with libtorch's out-of-memory, as `Tensor::zeros` raises it:
/// let err = catch_oom(|| -> Result<(), Error> {
///     panic!("called `Result::unwrap()` on an `Err` value: Torch(\"CUDA out of memory. \
///             Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB\")")
/// })
/// .unwrap_err();
/// assert!(err.is_oom());
/// // Any other panic is not caught.
/// assert!(std::panic::catch_unwind(|| catch_oom(|| -> Result<(), Error> { panic!("bug") })).is_err());
/// ```
pub fn catch_oom<T, E: Into<Error>>(f: impl FnOnce() -> Result<T, E>) -> Result<T, Error> {
    match panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r.map_err(Into::into),
        Err(payload) => match payload_text(payload.as_ref()).and_then(libtorch_text) {
            Some(text) if libtorch_text_is_oom(&text) => Err(Error::OomPanic { message: text }),
            _ => panic::resume_unwind(payload),
        },
    }
}

/// Runs `f` as [`catch_oom`] does, and also turns the panic of a plain tch method over any
/// other libtorch error (the `unwrap` of a `TchError::Torch`, tch's own form, read strictly:
/// [`UNWRAP`] then `Torch("...")`) into that error, [`Error::Torch`]; any other panic
/// continues. For the parts of a step that only call tch (the optimizer's `step`, which
/// unwraps), so that a libtorch error there is the step's error, not a crash.
pub(crate) fn catch_torch<T>(f: impl FnOnce() -> Result<T, Error>) -> Result<T, Error> {
    match panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let Some(message) = payload_text(payload.as_ref()) else {
                panic::resume_unwind(payload)
            };
            let unwrapped = message
                .strip_prefix(UNWRAP)
                .and_then(|m| m.strip_prefix(TORCH_DEBUG))
                .and_then(unescape_debug);
            match (unwrapped, libtorch_text(message)) {
                (_, Some(text)) if libtorch_text_is_oom(&text) => {
                    Err(Error::OomPanic { message: text })
                }
                (Some(text), _) => Err(Error::Torch(tch::TchError::Torch(text))),
                _ => panic::resume_unwind(payload),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unescape_reverses_debug() {
        for s in ["plain", "a\nb\t\"q\" \\ 'x' \0 é \u{7f}", ""] {
            let debug = format!("{s:?})");
            assert_eq!(unescape_debug(&debug[1..]).as_deref(), Some(s), "{debug}");
        }
        // no closing quote, trailing text, unknown escape
        assert_eq!(unescape_debug("abc"), None);
        assert_eq!(unescape_debug("abc\") and more"), None);
        assert_eq!(unescape_debug("a\\qb\")"), None);
    }

    #[test]
    fn catch_torch_turns_unwrapped_torch_errors_into_errors_and_lets_others_panic() {
        use oomguard::IsOom;
        let e = catch_torch(|| -> Result<(), Error> {
            panic!(
                "{UNWRAP}{:?}",
                tch::TchError::Torch("shape mismatch\nat x".into())
            )
        })
        .unwrap_err();
        assert!(
            matches!(&e, Error::Torch(tch::TchError::Torch(t)) if t == "shape mismatch\nat x"),
            "{e:?}"
        );
        assert!(!e.is_oom());
        let oom = catch_torch(|| -> Result<(), Error> {
            panic!(
                "{UNWRAP}{:?}",
                tch::TchError::Torch("CUDA out of memory. Tried to allocate 2.00 GiB".into())
            )
        })
        .unwrap_err();
        assert!(
            matches!(oom, Error::OomPanic { .. }) && oom.is_oom(),
            "{oom:?}"
        );
        let other =
            panic::catch_unwind(|| catch_torch(|| -> Result<(), Error> { panic!("a bug") }));
        assert!(other.is_err(), "a panic of another kind continues");
        assert_eq!(catch_torch(|| Ok::<_, Error>(3)).unwrap(), 3);
    }
}
