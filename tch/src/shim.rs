//! The C ABI of `shim/torch_memory.cpp` (libtorch's CUDA caching allocator), and the one place
//! its status codes become [`oomguard::Error`]s.
//!
//! Every shim function returns a status and writes a message into a caller buffer; none lets a
//! C++ exception out (each body runs in a catch-all), so calling them cannot unwind into Rust.

use std::ffi::{c_char, c_void, CStr};

use oomguard::backend::{BackendError, BackendErrorKind};

use crate::device_stats::DeviceStats;

pub(crate) const OK: i32 = 0;
pub(crate) const NO_CUDA: i32 = 1;
pub(crate) const BAD_DEVICE: i32 = 2;
pub(crate) const INVALID_ARGUMENT: i32 = 3;
pub(crate) const OUT_OF_MEMORY: i32 = 5;

/// `OomguardTchAllocatorInfo` of the shim.
#[repr(C)]
pub(crate) struct RawAllocatorInfo {
    pub name: [c_char; 64],
    pub settings: [c_char; 512],
    pub expandable_segments: i32,
    pub history_enabled: i32,
}

pub(crate) type Sink = unsafe extern "C" fn(ctx: *mut c_void, data: *const u8, len: usize);

extern "C" {
    pub(crate) fn oomguard_tch_built_with_cuda() -> i32;
    pub(crate) fn oomguard_tch_cuda_device_count(out: *mut i64, err: *mut c_char, n: usize) -> i32;
    pub(crate) fn oomguard_tch_device_info(
        device: i64,
        free: *mut u64,
        total: *mut u64,
        name: *mut c_char,
        name_len: usize,
        err: *mut c_char,
        n: usize,
    ) -> i32;
    pub(crate) fn oomguard_tch_device_stats(
        device: i64,
        out: *mut DeviceStats,
        err: *mut c_char,
        n: usize,
    ) -> i32;
    pub(crate) fn oomguard_tch_reset_peak_stats(device: i64, err: *mut c_char, n: usize) -> i32;
    pub(crate) fn oomguard_tch_reset_accumulated_stats(
        device: i64,
        err: *mut c_char,
        n: usize,
    ) -> i32;
    pub(crate) fn oomguard_tch_empty_cache(device: i64, err: *mut c_char, n: usize) -> i32;
    pub(crate) fn oomguard_tch_get_memory_fraction(
        device: i64,
        out: *mut f64,
        err: *mut c_char,
        n: usize,
    ) -> i32;
    pub(crate) fn oomguard_tch_set_memory_fraction(
        device: i64,
        fraction: f64,
        err: *mut c_char,
        n: usize,
    ) -> i32;
    pub(crate) fn oomguard_tch_record_history(
        enabled: i32,
        context: *const c_char,
        stacks: *const c_char,
        max_entries: u64,
        clear_history: i32,
        err: *mut c_char,
        n: usize,
    ) -> i32;
    pub(crate) fn oomguard_tch_snapshot_pickled(
        sink: Sink,
        ctx: *mut c_void,
        err: *mut c_char,
        n: usize,
    ) -> i32;
    pub(crate) fn oomguard_tch_allocator_info(
        out: *mut RawAllocatorInfo,
        err: *mut c_char,
        n: usize,
    ) -> i32;
}

/// Bytes of the message buffer handed to each shim call.
const ERR_LEN: usize = 2048;

/// Calls a shim function with a message buffer; turns its status into a `Result`. `op` names
/// libtorch's call, for the error.
pub(crate) fn call(
    op: &'static str,
    f: impl FnOnce(*mut c_char, usize) -> i32,
) -> oomguard::Result<()> {
    let mut buf = vec![0 as c_char; ERR_LEN];
    let status = f(buf.as_mut_ptr(), buf.len());
    if status == OK {
        return Ok(());
    }
    // The shim always NUL-terminates within the buffer; the last byte is forced to 0 anyway.
    buf[ERR_LEN - 1] = 0;
    // SAFETY: `buf` is a live, NUL-terminated buffer (its last byte is 0).
    let message = unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    Err(status_error(op, status, message))
}

/// The error for a shim status other than OK.
pub(crate) fn status_error(op: &'static str, status: i32, message: String) -> oomguard::Error {
    match status {
        NO_CUDA => BackendError::new(BackendErrorKind::Unavailable, op, message).into(),
        BAD_DEVICE | INVALID_ARGUMENT => {
            oomguard::Error::InvalidArgument(format!("{op}: {message}"))
        }
        OUT_OF_MEMORY => BackendError::oom(op, message).into(),
        _ => BackendError::new(BackendErrorKind::Other, op, message).into(),
    }
}

/// A NUL-terminated C string in a fixed buffer, as a `String` (lossy; stops at the buffer's end).
pub(crate) fn fixed_str(buf: &[c_char]) -> String {
    let bytes: Vec<u8> = buf
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Whether the shim was compiled with CUDA (a CUDA libtorch and CUDA's headers found).
pub(crate) fn built_with_cuda() -> bool {
    // SAFETY: takes no argument, touches no state, cannot throw.
    unsafe { oomguard_tch_built_with_cuda() == 1 }
}
