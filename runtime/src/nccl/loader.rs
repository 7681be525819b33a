//! The loader probe for NCCL: checks that a `libnccl` cudarc will find loads and exports every
//! entry point [`super::NcclConsensus`] calls, before cudarc (which panics when it cannot load
//! the library or a symbol) is touched.

use crate::backend::{BackendError, BackendErrorKind};

/// Every NCCL entry point the consensus and the gradient all-reduce reach through cudarc.
pub(crate) const REQUIRED_SYMBOLS: &[&str] = &[
    "ncclGetUniqueId",
    "ncclCommInitAll",
    "ncclCommInitRank",
    "ncclCommAbort",
    "ncclAllReduce",
    "ncclGetErrorString",
    "ncclCommGetAsyncError",
];

/// Names of the library as installed by the runtime package only (not among cudarc's names):
/// worth a precise hint when they load but cudarc's names do not.
#[cfg(not(windows))]
const RUNTIME_ONLY_NAMES: &[&str] = &["libnccl.so.2"];
#[cfg(windows)]
const RUNTIME_ONLY_NAMES: &[&str] = &[];

/// The names cudarc tries, in its order.
pub(crate) fn cudarc_names() -> Vec<String> {
    cudarc::get_lib_name_candidates("nccl")
}

fn loads(name: &str) -> Option<libloading::Library> {
    // SAFETY: loading libnccl runs its initialisers, which have no preconditions; the library
    // stays loaded only for the duration of this probe (cudarc loads it again).
    unsafe { libloading::Library::new(name) }.ok()
}

/// Checks that one of `names` loads and exports every symbol in `symbols`; the error (kind
/// [`BackendErrorKind::Unavailable`]) says what is missing, in one line.
pub(crate) fn probe_with(
    names: &[String],
    runtime_only: &[&str],
    symbols: &[&str],
) -> Result<(), BackendError> {
    let unavailable = |m: String| BackendError::new(BackendErrorKind::Unavailable, "load", m);
    for name in names {
        let Some(lib) = loads(name) else { continue };
        for sym in symbols {
            // SAFETY: the symbol is only looked up, never called; the pointer type is irrelevant.
            let found = unsafe { lib.get::<unsafe extern "C" fn()>(sym.as_bytes()) };
            if found.is_err() {
                return Err(unavailable(format!(
                    "the NCCL library {name} lacks {sym} (NCCL older than 2.28?)"
                )));
            }
        }
        return Ok(());
    }
    if let Some(found) = runtime_only.iter().find(|n| loads(n).is_some()) {
        return Err(unavailable(format!(
            "{found} is installed but cudarc loads NCCL only as {}: link libnccl.so to it in a \
             directory on LD_LIBRARY_PATH, or install the NCCL development package",
            names.first().map_or("libnccl.so", String::as_str)
        )));
    }
    let mut tried: Vec<&str> = Vec::new();
    for n in names {
        if !tried.contains(&n.as_str()) {
            tried.push(n);
        }
    }
    let shown = tried.iter().take(3).copied().collect::<Vec<_>>().join(", ");
    let more = tried.len().saturating_sub(3);
    Err(unavailable(format!(
        "the NCCL library could not be loaded (is libnccl installed and on LD_LIBRARY_PATH?); \
         tried {shown}{}",
        if more > 0 {
            format!(" and {more} other names")
        } else {
            String::new()
        }
    )))
}

/// Checks that NCCL can be loaded with every entry point oomguard calls.
pub(crate) fn probe() -> Result<(), BackendError> {
    probe_with(&cudarc_names(), RUNTIME_ONLY_NAMES, REQUIRED_SYMBOLS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_library_is_unavailable_in_one_line() {
        let e = probe_with(
            &["liboomguard-no-such-nccl.so".into()],
            &["liboomguard-no-such-nccl.so.2"],
            &["ncclAllReduce"],
        )
        .unwrap_err();
        assert_eq!(e.kind, BackendErrorKind::Unavailable);
        assert!(e.message.contains("could not be loaded"), "{e}");
        assert!(!e.to_string().contains('\n'), "one line: {e}");
    }

    #[test]
    fn a_runtime_only_name_gets_a_hint_and_missing_symbols_are_named() {
        let e = probe_with(
            &["liboomguard-no-such-nccl.so".into()],
            &["libc.so.6"],
            &["ncclAllReduce"],
        )
        .unwrap_err();
        assert!(e.message.contains("libc.so.6 is installed"), "{e}");
        let e = probe_with(&["libc.so.6".into()], &[], &["ncclAllReduce"]).unwrap_err();
        assert!(e.message.contains("lacks ncclAllReduce"), "{e}");
        assert!(probe_with(&["libc.so.6".into()], &[], &["malloc"]).is_ok());
    }

    #[test]
    fn cudarc_tries_libnccl_so_first() {
        assert_eq!(cudarc_names()[0], "libnccl.so");
    }
}
