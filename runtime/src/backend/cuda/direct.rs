//! The driver's four memory entry points (`cuMemAlloc_v2`, `cuMemFree_v2`, `cuMemAllocAsync`,
//! `cuMemFreeAsync`) reached through the driver library's handle (`dlsym`), never through the
//! linker.
//!
//! Why: a program may define these symbols itself to put oomguard's allocator under a framework
//! that allocates through them (`oomguard-candle`'s feature `allocator-hook`: with cudarc's
//! `dynamic-linking`, the linker binds cudarc's calls to such definitions). oomguard's own
//! backend must then still reach the real driver, and so must the interposer when it forwards a
//! call it does not serve; calling cudarc's `sys` functions would call the interposer again.

use std::sync::OnceLock;

use cudarc::driver::sys::{CUdeviceptr, CUresult, CUstream};

use super::loader::LIBRARY_NAMES;

type AllocFn = unsafe extern "C" fn(*mut CUdeviceptr, usize) -> CUresult;
type FreeFn = unsafe extern "C" fn(CUdeviceptr) -> CUresult;
type AllocAsyncFn = unsafe extern "C" fn(*mut CUdeviceptr, usize, CUstream) -> CUresult;
type FreeAsyncFn = unsafe extern "C" fn(CUdeviceptr, CUstream) -> CUresult;

/// The four entry points, looked up once in the driver library (which stays loaded).
struct Entries {
    alloc: AllocFn,
    free: FreeFn,
    alloc_async: AllocAsyncFn,
    free_async: FreeAsyncFn,
}

static ENTRIES: OnceLock<Result<Entries, String>> = OnceLock::new();

fn load() -> Result<Entries, String> {
    let mut first_err = None;
    for name in LIBRARY_NAMES {
        // SAFETY: loading the CUDA driver runs its initialisers, which have no preconditions.
        let lib = match unsafe { libloading::Library::new(*name) } {
            Ok(lib) => lib,
            Err(e) => {
                first_err.get_or_insert_with(|| format!("{name}: {e}"));
                continue;
            }
        };
        // SAFETY: each symbol is the driver's own entry point with the C signature of its type
        // (CUDA driver API, cuda.h); the library is leaked below, so the pointers stay valid.
        let entries = unsafe {
            let get = |s: &str| format!("{name} lacks {s}");
            Entries {
                alloc: *lib
                    .get::<AllocFn>(b"cuMemAlloc_v2")
                    .map_err(|_| get("cuMemAlloc_v2"))?,
                free: *lib
                    .get::<FreeFn>(b"cuMemFree_v2")
                    .map_err(|_| get("cuMemFree_v2"))?,
                alloc_async: *lib
                    .get::<AllocAsyncFn>(b"cuMemAllocAsync")
                    .map_err(|_| get("cuMemAllocAsync"))?,
                free_async: *lib
                    .get::<FreeAsyncFn>(b"cuMemFreeAsync")
                    .map_err(|_| get("cuMemFreeAsync"))?,
            }
        };
        std::mem::forget(lib); // the entry points are used for the rest of the process
        return Ok(entries);
    }
    Err(format!(
        "the CUDA driver library could not be loaded: {}",
        first_err.unwrap_or_default()
    ))
}

fn entries() -> Result<&'static Entries, CUresult> {
    ENTRIES
        .get_or_init(load)
        .as_ref()
        .map_err(|_| CUresult::CUDA_ERROR_NOT_INITIALIZED)
}

/// Whether the four entry points could be looked up (an error says why not).
pub fn available() -> Result<(), String> {
    ENTRIES
        .get_or_init(load)
        .as_ref()
        .map(|_| ())
        .map_err(Clone::clone)
}

/// `cuMemAlloc_v2` of the driver library. `CUDA_ERROR_NOT_INITIALIZED` when it cannot be loaded.
///
/// # Safety
/// As `cuMemAlloc_v2`: `dptr` is valid for one write and a context is current.
pub unsafe fn mem_alloc(dptr: *mut CUdeviceptr, bytes: usize) -> CUresult {
    match entries() {
        // SAFETY: the caller upholds cuMemAlloc_v2's contract.
        Ok(e) => unsafe { (e.alloc)(dptr, bytes) },
        Err(r) => r,
    }
}

/// `cuMemFree_v2` of the driver library.
///
/// # Safety
/// As `cuMemFree_v2`: `ptr` came from `cuMemAlloc` (or the stream-ordered pool) and is freed once.
pub unsafe fn mem_free(ptr: CUdeviceptr) -> CUresult {
    match entries() {
        // SAFETY: the caller upholds cuMemFree_v2's contract.
        Ok(e) => unsafe { (e.free)(ptr) },
        Err(r) => r,
    }
}

/// `cuMemAllocAsync` of the driver library.
///
/// # Safety
/// As `cuMemAllocAsync`: `dptr` is valid for one write, `stream` is a live stream of the current
/// context (or a special handle).
pub unsafe fn mem_alloc_async(dptr: *mut CUdeviceptr, bytes: usize, stream: CUstream) -> CUresult {
    match entries() {
        // SAFETY: the caller upholds cuMemAllocAsync's contract.
        Ok(e) => unsafe { (e.alloc_async)(dptr, bytes, stream) },
        Err(r) => r,
    }
}

/// `cuMemFreeAsync` of the driver library.
///
/// # Safety
/// As `cuMemFreeAsync`: `ptr` is a live allocation freed once; `stream` is a live stream.
pub unsafe fn mem_free_async(ptr: CUdeviceptr, stream: CUstream) -> CUresult {
    match entries() {
        // SAFETY: the caller upholds cuMemFreeAsync's contract.
        Ok(e) => unsafe { (e.free_async)(ptr, stream) },
        Err(r) => r,
    }
}

/// A driver status as cudarc's `Result`.
pub(crate) fn check(r: CUresult) -> Result<(), cudarc::driver::DriverError> {
    match r {
        CUresult::CUDA_SUCCESS => Ok(()),
        e => Err(cudarc::driver::DriverError(e)),
    }
}
