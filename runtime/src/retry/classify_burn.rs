//! [`IsOom`] for burn's `ExecutionError` (feature `burn`; burn 0.21.0 over cubecl 0.10.0).
//!
//! burn-cubecl flattens cubecl's typed errors into text: `ExecutionError::WithContext { reason }`
//! holds `format!("{err}")` (reads, `Backend::sync`) or `format!("{err:?}")` (transactions) of a
//! cubecl `ServerError`. Out-of-memory is recognised only where that text *is* one of cubecl's
//! out-of-memory errors, read by its exact shape from the start, never by a substring search:
//! - `IoError::BufferTooBig { size }` ("can't allocate buffer of size: N"): cubecl's pools and
//!   cubecl-cuda's storage when the driver returns `CUDA_ERROR_OUT_OF_MEMORY`;
//! - `LaunchError::OutOfMemory` ("An out-of-memory error happened during launch");
//! - either of them inside `ServerError::Io`/`Launch`/`Profile`, `IoError::Execution`,
//!   `LaunchError::IoError`, and as the *first* error of `ServerError::ServerUnhealthy` (the
//!   stream's errors in order; later ones are consequences such as missing memory pages).
//!
//! Not recognised: `ExecutionError::Generic` (burn's own), `ServerError::Generic`, cubecl's
//! `IoError::Unknown` (other driver allocation failures), `ProfileError::Unknown` (whose text
//! merely quotes errors), and any text that does not start with one of these forms. These
//! strings are cubecl 0.10's `#[error(..)]` formats; `oomguard-burn`'s tests build the real
//! values with cubecl-runtime 0.10.0 and check that they classify, so a version that changes
//! them fails there. The panic `Tensor::into_data` raises is classified by `oomguard-burn`.

use burn_backend::ExecutionError;

use super::IsOom;

impl IsOom for ExecutionError {
    fn is_oom(&self) -> bool {
        match self {
            ExecutionError::WithContext { reason } => text_is_oom(reason, 0),
            // Made by burn itself, never from a cubecl error.
            ExecutionError::Generic { .. } => false,
        }
    }
}

/// `IoError::BufferTooBig`, followed by the size in bytes.
const IO_BUFFER_TOO_BIG: &str = "can't allocate buffer of size: ";
/// `IoError::Execution(Box<ServerError>)`, followed by the server error's display.
const IO_EXECUTION: &str = "Can't perform the IO operation because of a runtime error: ";
/// `LaunchError::OutOfMemory`.
const LAUNCH_OOM: &str = "An out-of-memory error happened during launch\nCaused by:\n  ";
/// `LaunchError::IoError`, followed by the IO error's display.
const LAUNCH_IO: &str = "An io error happened during launch\nCaused by:\n  ";
/// `ServerError::Launch` and `ProfileError::Launch`, followed by the launch error's display.
const SERVER_LAUNCH: &str = "A launch error happened during profiling\nCaused by:\n  ";
/// `ServerError::Io`, `ServerError::Profile` and `ProfileError::Server` (one format for all
/// three), followed by the inner error's display.
const SERVER_IO: &str = "An execution error happened during profiling\nCaused by:\n  ";
/// `ServerError::ServerUnhealthy`, followed by `{errors:?}` (a list of derived `Debug`s).
const SERVER_UNHEALTHY: &str = "The server is in an invalid state\nCaused by:\n  [";
/// The derived `Debug` forms of `ServerError`'s variants that can hold an out-of-memory
/// (`IoError`, `LaunchError` and `ProfileError` print their display as `Debug`).
const DEBUG_WRAPPERS: [&str; 4] = ["Io(", "Launch(", "Profile(", "ServerUnhealthy { errors: ["];
/// burn's `ExecutionError` display: accepted only at the top of a text (a panic message), since
/// cubecl's `ServerError::Generic` prints the same words and is never an out-of-memory.
const EXECUTION: &str = "An error happened during execution\nCaused by:\n  ";

/// Whether `text` is the display (or `Debug`) of one of cubecl 0.10's out-of-memory errors, or
/// of burn's `ExecutionError` holding one, read from its start: `IoError::BufferTooBig`,
/// `LaunchError::OutOfMemory`, either inside cubecl's wrapping errors, or first among a
/// `ServerUnhealthy`'s errors (the forms are listed in `runtime/src/retry/classify_burn.rs`). Used by `oomguard-burn` on panic messages; `ExecutionError` itself implements
/// [`IsOom`].
pub fn cubecl_text_is_oom(text: &str) -> bool {
    match text.strip_prefix(EXECUTION) {
        Some(reason) => text_is_oom(reason, 0),
        None => text_is_oom(text, 0),
    }
}

fn text_is_oom(s: &str, depth: usize) -> bool {
    if depth > 16 {
        return false;
    }
    if let Some(size) = s.strip_prefix(IO_BUFFER_TOO_BIG) {
        return size.starts_with(|c: char| c.is_ascii_digit());
    }
    if s.starts_with(LAUNCH_OOM) {
        return true;
    }
    let wrappers = [
        IO_EXECUTION,
        LAUNCH_IO,
        SERVER_LAUNCH,
        SERVER_IO,
        SERVER_UNHEALTHY,
    ];
    wrappers
        .iter()
        .chain(DEBUG_WRAPPERS.iter())
        .find_map(|w| s.strip_prefix(w))
        .is_some_and(|inner| text_is_oom(inner, depth + 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(reason: &str) -> ExecutionError {
        ExecutionError::WithContext {
            reason: reason.into(),
        }
    }

    #[test]
    fn cubecl_oom_shapes_are_recognised() {
        let too_big = "can't allocate buffer of size: 68719476736\n";
        assert!(ctx(too_big).is_oom());
        assert!(ctx(&format!("{SERVER_IO}{too_big}")).is_oom());
        assert!(ctx(&format!("Io({too_big})")).is_oom());
        assert!(ctx(&format!(
            "{SERVER_UNHEALTHY}Io({too_big}), Generic {{ .. }}]"
        ))
        .is_oom());
        assert!(ctx(&format!("{SERVER_LAUNCH}{LAUNCH_OOM}cuMemAlloc\n")).is_oom());
        assert!(cubecl_text_is_oom(&format!(
            "{EXECUTION}{SERVER_IO}{too_big}"
        )));
    }

    #[test]
    fn other_errors_and_quoted_text_are_not_oom() {
        let too_big = "can't allocate buffer of size: 12\n";
        // cubecl's generic error, even when its reason quotes an out-of-memory
        assert!(!ctx(&format!("{EXECUTION}{too_big}")).is_oom());
        // an unhealthy server whose first error is not an out-of-memory
        assert!(!ctx(&format!(
            "{SERVER_UNHEALTHY}Generic {{ reason: \"x\" }}, Io({too_big})]"
        ))
        .is_oom());
        assert!(!ctx("Unknown error happened during execution\nCUDA allocation error: x").is_oom());
        assert!(!ctx(&format!("out of memory; {too_big}")).is_oom());
        assert!(!ctx("can't allocate buffer of size: lots").is_oom());
        assert!(!ExecutionError::Generic {
            reason: too_big.into(),
            backtrace: burn_backend::BackTrace::capture(),
        }
        .is_oom());
        assert!(!cubecl_text_is_oom("Memory page 0 doesn't exist"));
    }
}
