//! The loader probe: checks that the CUDA driver library loads and exports every entry point the
//! backend calls, before cudarc (which panics when it cannot load the library or a symbol) is
//! touched at all.

use crate::backend::{BackendError, BackendErrorKind};

/// Library names tried, in order (the driver package installs `libcuda.so.1`; `libcuda.so` is the
/// development link).
#[cfg(not(windows))]
pub(crate) const LIBRARY_NAMES: &[&str] = &["libcuda.so.1", "libcuda.so"];
/// Library names tried, in order.
#[cfg(windows)]
pub(crate) const LIBRARY_NAMES: &[&str] = &["nvcuda.dll"];

/// Every driver entry point the backend (and cudarc's context set-up it relies on) calls.
pub(crate) const REQUIRED_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDeviceGet",
    "cuDeviceGetCount",
    "cuDeviceGetName",
    "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuDeviceTotalMem_v2",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuCtxSynchronize",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuMemGetInfo_v2",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemcpyHtoD_v2",
    "cuMemcpyDtoH_v2",
    "cuMemsetD8_v2",
    "cuMemGetAllocationGranularity",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuEventDestroy_v2",
];

/// Checks that one of `names` loads and exports every symbol in `symbols`. The error (kind
/// [`BackendErrorKind::Unavailable`]) says which library or symbol is missing, in one line.
pub(crate) fn probe_with(names: &[&str], symbols: &[&str]) -> Result<(), BackendError> {
    let unavailable = |m: String| BackendError::new(BackendErrorKind::Unavailable, "load", m);
    let mut first_err: Option<String> = None;
    for name in names {
        // SAFETY: loading the CUDA driver runs its initialisers, which have no preconditions; the
        // library stays loaded only for the duration of this probe (cudarc loads it again).
        let lib = match unsafe { libloading::Library::new(*name) } {
            Ok(lib) => lib,
            Err(e) => {
                first_err.get_or_insert_with(|| format!("{name}: {e}"));
                continue;
            }
        };
        for sym in symbols {
            // SAFETY: the symbol is only looked up, never called; the pointer type is irrelevant.
            let found = unsafe { lib.get::<unsafe extern "C" fn()>(sym.as_bytes()) };
            if found.is_err() {
                return Err(unavailable(format!(
                    "the CUDA driver {name} lacks {sym} (driver too old?)"
                )));
            }
        }
        return Ok(());
    }
    Err(unavailable(
        format!(
            "the CUDA driver library could not be loaded (is an NVIDIA driver installed?): \
         {}",
            first_err.as_deref().unwrap_or("no library name to try")
        )
        .replace('\n', " "),
    ))
}

/// Checks that the CUDA driver can be loaded and has every entry point the backend needs.
pub(crate) fn probe() -> Result<(), BackendError> {
    probe_with(LIBRARY_NAMES, REQUIRED_SYMBOLS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_library_is_unavailable() {
        let e = probe_with(&["liboomguard-no-such-library.so.7"], &["cuInit"]).unwrap_err();
        assert_eq!(e.kind, BackendErrorKind::Unavailable);
        assert!(e.message.contains("could not be loaded"), "{e}");
        assert!(!e.to_string().contains('\n'), "one line: {e}");
    }

    #[test]
    fn missing_symbol_is_unavailable() {
        // libc is always there and certainly lacks cuInit.
        let e = probe_with(&["libc.so.6"], &["cuInit"]).unwrap_err();
        assert_eq!(e.kind, BackendErrorKind::Unavailable);
        assert!(e.message.contains("lacks cuInit"), "{e}");
        assert!(probe_with(&["libc.so.6"], &["malloc"]).is_ok());
    }
}
