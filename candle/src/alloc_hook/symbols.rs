//! The four driver entry points cudarc's `dynamic-linking` mode binds at link time, defined here
//! so that the linker binds cudarc's calls (and so candle's) to them. Each forwards to the
//! interposer when it is installed and to the real driver (through its library handle, never
//! the linker) otherwise.
#![allow(unsafe_code)] // FFI: the driver's C entry points
#![allow(non_snake_case)] // the driver's names and parameter names

use std::sync::OnceLock;

use oomguard::backend::cuda::direct;
use oomguard::cudarc::driver::sys::{
    self, CUcontext, CUdeviceptr, CUresult, CUstream, CUstreamCaptureStatus,
};

use super::interposer::{status, Driver, Interposer};

/// The real driver, reached through the library handle.
pub(crate) struct RealDriver;

fn code(r: CUresult) -> u32 {
    r as u32
}

impl Driver for RealDriver {
    fn alloc_async(&self, bytes: usize, stream: u64) -> Result<u64, u32> {
        let mut p: CUdeviceptr = 0;
        // SAFETY: `p` is valid for one write; `stream` is the handle cudarc passed to the hooked
        // call, forwarded unchanged.
        match unsafe { direct::mem_alloc_async(&mut p, bytes, stream as usize as CUstream) } {
            CUresult::CUDA_SUCCESS => Ok(p),
            e => Err(code(e)),
        }
    }
    fn free_async(&self, ptr: u64, stream: u64) -> u32 {
        // SAFETY: forwarded unchanged from the hooked call, whose caller upholds its contract.
        code(unsafe { direct::mem_free_async(ptr, stream as usize as CUstream) })
    }
    fn alloc(&self, bytes: usize) -> Result<u64, u32> {
        let mut p: CUdeviceptr = 0;
        // SAFETY: `p` is valid for one write.
        match unsafe { direct::mem_alloc(&mut p, bytes) } {
            CUresult::CUDA_SUCCESS => Ok(p),
            e => Err(code(e)),
        }
    }
    fn free(&self, ptr: u64) -> u32 {
        // SAFETY: forwarded unchanged from the hooked call, whose caller upholds its contract.
        code(unsafe { direct::mem_free(ptr) })
    }
    fn current_context(&self) -> Option<u64> {
        let mut ctx: CUcontext = std::ptr::null_mut();
        // SAFETY: `ctx` is valid for one write; cuCtxGetCurrent has no other precondition.
        let r = unsafe { sys::cuCtxGetCurrent(&mut ctx) };
        (r == CUresult::CUDA_SUCCESS && !ctx.is_null()).then_some(ctx as usize as u64)
    }
    fn is_capturing(&self, stream: u64) -> bool {
        let mut st = CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: `st` is valid for one write; `stream` is the handle of the hooked call.
        let r = unsafe { sys::cuStreamIsCapturing(stream as usize as CUstream, &mut st) };
        r != CUresult::CUDA_SUCCESS || st != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
    }
}

/// The interposer, once `install` made it (every hooked call goes to the driver until then).
pub(crate) static HOOK: OnceLock<Interposer<RealDriver>> = OnceLock::new();

/// Writes `r`'s pointer to `dptr` and returns the status.
///
/// # Safety
/// `dptr` is null or valid for one write.
unsafe fn answer(dptr: *mut CUdeviceptr, r: Result<u64, u32>) -> u32 {
    match r {
        Ok(p) => {
            // SAFETY: the caller's pointer, checked non-null by the callers of `answer`.
            unsafe { dptr.write(p) };
            status::SUCCESS
        }
        Err(c) => c,
    }
}

// The return type is `u32`: cudarc declares `CUresult` as `#[repr(u32)]`, so the ABI is the
// same, and every value returned is either the driver's own status or one of `status`'s codes,
// all variants of `CUresult`.

/// Interposed `cuMemAllocAsync` (see the module docs).
///
/// # Safety
/// As the driver's `cuMemAllocAsync`.
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    hStream: CUstream,
) -> u32 {
    if dptr.is_null() {
        return status::INVALID_VALUE;
    }
    let stream = hStream as usize as u64;
    let r = match HOOK.get() {
        Some(h) => h.alloc_async(bytesize, stream),
        None => RealDriver.alloc_async(bytesize, stream),
    };
    // SAFETY: `dptr` is non-null and, by the caller's contract, valid for one write.
    unsafe { answer(dptr, r) }
}

/// Interposed `cuMemFreeAsync` (see the module docs).
///
/// # Safety
/// As the driver's `cuMemFreeAsync`.
#[no_mangle]
pub unsafe extern "C" fn cuMemFreeAsync(dptr: CUdeviceptr, hStream: CUstream) -> u32 {
    let stream = hStream as usize as u64;
    match HOOK.get() {
        Some(h) => h.free_async(dptr, stream),
        None => RealDriver.free_async(dptr, stream),
    }
}

/// Interposed `cuMemAlloc_v2` (see the module docs).
///
/// # Safety
/// As the driver's `cuMemAlloc_v2`.
#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytesize: usize) -> u32 {
    if dptr.is_null() {
        return status::INVALID_VALUE;
    }
    let r = match HOOK.get() {
        Some(h) => h.alloc(bytesize),
        None => RealDriver.alloc(bytesize),
    };
    // SAFETY: `dptr` is non-null and, by the caller's contract, valid for one write.
    unsafe { answer(dptr, r) }
}

/// Interposed `cuMemFree_v2` (see the module docs).
///
/// # Safety
/// As the driver's `cuMemFree_v2`.
#[no_mangle]
pub unsafe extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> u32 {
    match HOOK.get() {
        Some(h) => h.free(dptr),
        None => RealDriver.free(dptr),
    }
}

/// The addresses of the four definitions: referenced by `install`, so that the object holding
/// them is always linked into a program that calls it (an unreferenced object of an rlib is not).
pub(crate) fn definitions() -> [usize; 4] {
    [
        cuMemAllocAsync as *const () as usize,
        cuMemFreeAsync as *const () as usize,
        cuMemAlloc_v2 as *const () as usize,
        cuMemFree_v2 as *const () as usize,
    ]
}

/// What the entry points do before reaching any driver (no GPU needed; run with the feature).
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_null_result_pointer_is_refused_before_any_driver_call() {
        // SAFETY: a null `dptr` is checked first and never written; no driver call is made.
        let (a, b) = unsafe {
            (
                cuMemAllocAsync(std::ptr::null_mut(), 4096, std::ptr::null_mut()),
                cuMemAlloc_v2(std::ptr::null_mut(), 4096),
            )
        };
        assert_eq!((a, b), (status::INVALID_VALUE, status::INVALID_VALUE));
    }

    #[test]
    fn answer_writes_the_pointer_only_on_success() {
        let mut p: CUdeviceptr = 7;
        // SAFETY: `p` is valid for one write.
        assert_eq!(unsafe { answer(&mut p, Ok(0x1000)) }, status::SUCCESS);
        assert_eq!(p, 0x1000);
        // SAFETY: as above.
        let failed = unsafe { answer(&mut p, Err(status::OUT_OF_MEMORY)) };
        assert_eq!(failed, status::OUT_OF_MEMORY);
        assert_eq!(p, 0x1000, "untouched on failure");
    }

    #[test]
    fn the_four_definitions_are_distinct_and_linked() {
        let d = definitions();
        assert!(d.iter().all(|&a| a != 0));
        let mut s = d.to_vec();
        s.sort_unstable();
        s.dedup();
        assert_eq!(s.len(), 4);
    }
}
