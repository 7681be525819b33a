//! The C++ shim (`shim/pluggable.cpp`): its entry points, and the callbacks it calls for
//! libtorch, which serve through the installed [`Served`]. No panic leaves a callback (each is
//! caught and turned into libtorch's exception or a logged error); no C++ exception reaches
//! Rust (the shim returns codes and messages).
#![allow(unsafe_code)] // FFI with the shim

use std::ffi::{c_char, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, PoisonError, RwLock};

use super::served::{Refusal, Served};

/// The callbacks' table (`struct oomguard_tch_callbacks` in the shim).
#[repr(C)]
struct Callbacks {
    alloc: extern "C" fn(usize, i32, *mut c_void, *mut *mut c_void, *mut c_char, usize) -> i32,
    free: extern "C" fn(*mut c_void, usize, i32, *mut c_void),
    record_stream: extern "C" fn(*mut c_void, *mut c_void, *mut c_char, usize) -> i32,
    empty_cache: extern "C" fn(*mut c_char, usize) -> i32,
    memory_fraction: extern "C" fn(f64, i32, *mut c_char, usize) -> i32,
}

extern "C" {
    fn oomguard_tch_cuda_allocator_state(name: *mut c_char, cap: usize) -> i32;
    fn oomguard_tch_pluggable_install(cb: *const Callbacks, err: *mut c_char, cap: usize) -> i32;
    fn oomguard_tch_pluggable_is_current() -> i32;
    fn oomguard_tch_pluggable_uninstall(err: *mut c_char, cap: usize) -> i32;
    #[cfg(test)]
    fn oomguard_tch_pluggable_call_malloc(
        size: usize,
        device: i32,
        out: *mut *mut c_void,
        err: *mut c_char,
        cap: usize,
    ) -> i32;
    #[cfg(test)]
    fn oomguard_tch_pluggable_call_raw_delete(
        ptr: *mut c_void,
        err: *mut c_char,
        cap: usize,
    ) -> i32;
    #[cfg(test)]
    fn oomguard_tch_libtorch_empty_cache(err: *mut c_char, cap: usize) -> i32;
    #[cfg(test)]
    fn oomguard_tch_libtorch_device_stats(
        device: i32,
        allocated: *mut i64,
        err: *mut c_char,
        cap: usize,
    ) -> i32;
    #[cfg(test)]
    fn oomguard_tch_libtorch_set_memory_fraction(
        fraction: f64,
        device: i32,
        err: *mut c_char,
        cap: usize,
    ) -> i32;
}

/// The shim's codes (see `shim/pluggable.cpp`).
pub(crate) mod code {
    /// libtorch's CUDA allocator is initialised already.
    pub const TOO_LATE: i32 = 1;
    /// Built without CUDA.
    pub const NO_CUDA: i32 = 3;
    /// Installed already.
    #[cfg(test)]
    pub const INSTALLED: i32 = 4;
    /// A callback's failure thrown as `c10::OutOfMemoryError`.
    pub const OOM: i32 = 1;
}

/// A failed shim call: its code and message.
pub(crate) type ShimError = (i32, String);

/// The device serving libtorch's calls (the callbacks read it).
static SERVED: RwLock<Option<Arc<Served>>> = RwLock::new(None);

pub(crate) fn served() -> Option<Arc<Served>> {
    SERVED
        .read()
        .unwrap_or_else(PoisonError::into_inner)
        .clone()
}

pub(crate) fn set_served(s: Option<Arc<Served>>) {
    *SERVED.write().unwrap_or_else(PoisonError::into_inner) = s;
}

const CAP: usize = 4096;

/// Calls `f` with a message buffer; the shim's code, and the message when it is not 0.
fn with_buffer(f: impl FnOnce(*mut c_char, usize) -> i32) -> (i32, String) {
    let mut buf = vec![0u8; CAP];
    let code = f(buf.as_mut_ptr().cast(), CAP);
    let text = CStr::from_bytes_until_nul(&buf)
        .map(|c| c.to_string_lossy().into_owned())
        .unwrap_or_default();
    (code, text)
}

fn ok_or(code: i32, text: String) -> Result<(), ShimError> {
    if code == 0 {
        Ok(())
    } else {
        Err((code, text))
    }
}

/// Whether libtorch's current CUDA allocator is initialised, and its name; `Err` with the
/// shim's message when there is no CUDA in this build.
pub(crate) fn allocator_state() -> Result<(bool, String), String> {
    // SAFETY: the shim writes at most `cap` bytes, NUL-terminated, into the buffer.
    let (code, text) = with_buffer(|m, c| unsafe { oomguard_tch_cuda_allocator_state(m, c) });
    match code {
        0 => Ok((false, text)),
        1 => Ok((true, text)),
        _ => Err(text),
    }
}

/// Makes the shim's pluggable allocator libtorch's CUDA allocator (callbacks below).
pub(crate) fn install() -> Result<(), ShimError> {
    static CALLBACKS: Callbacks = Callbacks {
        alloc: cb_alloc,
        free: cb_free,
        record_stream: cb_record_stream,
        empty_cache: cb_empty_cache,
        memory_fraction: cb_memory_fraction,
    };
    // SAFETY: the table is static (the shim copies it); the buffer is as above.
    let (code, text) =
        with_buffer(|m, c| unsafe { oomguard_tch_pluggable_install(&CALLBACKS, m, c) });
    ok_or(code, text)
}

/// Whether the installed allocator is libtorch's current CUDA allocator and the one registered
/// for CUDA.
pub(crate) fn is_current() -> bool {
    // SAFETY: no arguments; the shim catches every exception.
    unsafe { oomguard_tch_pluggable_is_current() == 1 }
}

/// Puts libtorch's own allocator back (a failed install).
pub(crate) fn uninstall() -> Result<(), ShimError> {
    // SAFETY: the buffer is as above.
    let (code, text) = with_buffer(|m, c| unsafe { oomguard_tch_pluggable_uninstall(m, c) });
    ok_or(code, text)
}

#[cfg(test)]
/// libtorch's `emptyCache()` (`c10::cuda::CUDACachingAllocator::emptyCache`, whichever
/// allocator is current).
pub(crate) fn libtorch_empty_cache() -> Result<(), ShimError> {
    // SAFETY: the buffer is as above.
    let (code, text) = with_buffer(|m, c| unsafe { oomguard_tch_libtorch_empty_cache(m, c) });
    ok_or(code, text)
}

#[cfg(test)]
/// libtorch's `setMemoryFraction(fraction, device)` on its current allocator.
pub(crate) fn libtorch_set_memory_fraction(fraction: f64, device: i32) -> Result<(), ShimError> {
    // SAFETY: the buffer is as above.
    let (code, text) = with_buffer(|m, c| unsafe {
        oomguard_tch_libtorch_set_memory_fraction(fraction, device, m, c)
    });
    ok_or(code, text)
}

/// libtorch's `getDeviceStats(device)` on its current allocator: its current allocated bytes.
#[cfg(test)]
pub(crate) fn libtorch_allocated_bytes(device: i32) -> Result<i64, ShimError> {
    let mut allocated = 0i64;
    // SAFETY: `allocated` is a valid place for the figure; the buffer is as above.
    let (code, text) = with_buffer(|m, c| unsafe {
        oomguard_tch_libtorch_device_stats(device, &mut allocated, m, c)
    });
    ok_or(code, text).map(|()| allocated)
}

/// The installed pluggable allocator's `malloc(size, device, default stream)`, as libtorch calls
/// it (for tests without a GPU).
#[cfg(test)]
pub(crate) fn call_malloc(size: usize, device: i32) -> Result<u64, ShimError> {
    let mut out: *mut c_void = std::ptr::null_mut();
    // SAFETY: `out` is a valid place for the pointer; the buffer is as above.
    let (code, text) = with_buffer(|m, c| unsafe {
        oomguard_tch_pluggable_call_malloc(size, device, &mut out, m, c)
    });
    ok_or(code, text).map(|()| out as u64)
}

/// The installed pluggable allocator's `raw_delete(ptr)`: what a CUDA tensor's deleter calls.
#[cfg(test)]
pub(crate) fn call_raw_delete(ptr: u64) -> Result<(), ShimError> {
    // SAFETY: the shim looks the pointer up in libtorch's table before anything reads it.
    let (code, text) = with_buffer(|m, c| unsafe {
        oomguard_tch_pluggable_call_raw_delete(ptr as usize as *mut c_void, m, c)
    });
    ok_or(code, text)
}

/// Writes `text` NUL-terminated into the shim's buffer, cut at a character boundary to fit.
fn write_message(buf: *mut c_char, cap: usize, text: &str) {
    if buf.is_null() || cap == 0 {
        return;
    }
    let mut n = text.len().min(cap - 1);
    while !text.is_char_boundary(n) {
        n -= 1;
    }
    // SAFETY: the shim passes a buffer of `cap` bytes it owns for the call; `n + 1 <= cap`.
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast::<u8>(), n);
        *buf.add(n) = 0;
    }
}

/// The message of a panic caught in a callback.
fn panic_text(p: Box<dyn std::any::Any + Send>) -> String {
    let what = oomguard::retry::advanced::panic_text(p.as_ref()).unwrap_or_default();
    format!("oomguard's allocator under libtorch panicked: {what}")
}

fn not_installed() -> String {
    "oomguard's allocator under libtorch has no device (its install failed)".into()
}

/// Runs a fallible callback body: 0, or 2 and its message (panics included).
fn guarded(msg: *mut c_char, cap: usize, f: impl FnOnce(&Served) -> Result<(), String>) -> i32 {
    let r = catch_unwind(AssertUnwindSafe(|| match served() {
        Some(s) => f(&s),
        None => Err(not_installed()),
    }))
    .unwrap_or_else(|p| Err(panic_text(p)));
    match r {
        Ok(()) => 0,
        Err(text) => {
            write_message(msg, cap, &text);
            2
        }
    }
}

extern "C" fn cb_alloc(
    size: usize,
    device: i32,
    stream: *mut c_void,
    out: *mut *mut c_void,
    msg: *mut c_char,
    cap: usize,
) -> i32 {
    let r = catch_unwind(AssertUnwindSafe(|| match served() {
        Some(s) => s.alloc(size, device, stream as u64),
        None => Err(Refusal::Other(not_installed())),
    }))
    .unwrap_or_else(|p| Err(Refusal::Other(panic_text(p))));
    match r {
        Ok(ptr) => {
            // SAFETY: the shim passes the address of its local `void*`.
            unsafe { *out = ptr as usize as *mut c_void };
            0
        }
        Err(Refusal::Oom(text)) => {
            write_message(msg, cap, &text);
            code::OOM
        }
        Err(Refusal::Other(text)) => {
            write_message(msg, cap, &text);
            2
        }
    }
}

extern "C" fn cb_free(ptr: *mut c_void, size: usize, _device: i32, _stream: *mut c_void) {
    let r = catch_unwind(AssertUnwindSafe(|| match served() {
        Some(s) => s.free(ptr as u64, size),
        None => eprintln!(
            "oomguard error: libtorch freed {ptr:p} ({size} bytes) through oomguard's allocator, \
             which serves no device (its install failed): not freed"
        ),
    }));
    if let Err(p) = r {
        eprintln!("oomguard error: {}", panic_text(p));
    }
}

extern "C" fn cb_record_stream(
    ptr: *mut c_void,
    stream: *mut c_void,
    msg: *mut c_char,
    cap: usize,
) -> i32 {
    guarded(msg, cap, |s| s.record_stream(ptr as u64, stream as u64))
}

extern "C" fn cb_empty_cache(msg: *mut c_char, cap: usize) -> i32 {
    guarded(msg, cap, Served::empty_cache)
}

extern "C" fn cb_memory_fraction(fraction: f64, device: i32, msg: *mut c_char, cap: usize) -> i32 {
    guarded(msg, cap, |s| s.set_memory_fraction(fraction, device))
}

#[cfg(test)]
mod tests {
    //! The shim's path on the CPU: libtorch's pluggable allocator installed (no GPU needed to
    //! install it), its malloc / raw_delete / emptyCache / setMemoryFraction called as libtorch
    //! calls them, served by a simulated device. One test: installing is process-wide.
    use super::*;
    use oomguard::retry::libtorch_text_is_oom;
    use oomguard::{ByteSize, Device, IsOom};

    #[test]
    fn libtorch_calls_reach_oomguard_through_the_shim() {
        if option_env!("OOMGUARD_TCH_SHIM_CUDA") == Some("0") {
            // a shim built without CUDA (build.rs) says so, and installs nothing
            assert!(allocator_state().unwrap_err().contains("without CUDA"));
            assert_eq!(install().unwrap_err().0, code::NO_CUDA);
            return;
        }
        let (initialised, name) = allocator_state().expect("this build has CUDA");
        assert!(!initialised, "no CUDA tensor was made in this test binary");
        assert_eq!(name, "native");

        let dev = Device::sim(ByteSize::mib(64));
        let s = Arc::new(Served::new(0, dev.clone()));
        set_served(Some(Arc::clone(&s)));
        install().unwrap();
        assert!(is_current());
        let (initialised, name) = allocator_state().unwrap();
        assert!(initialised);
        assert_eq!(name, "pluggable");
        assert_eq!(install().unwrap_err().0, code::INSTALLED);

        let p = call_malloc(4096, 0).unwrap();
        assert_ne!(p, 0);
        assert_eq!(dev.stats().allocation.all.current, 1);
        call_raw_delete(p).unwrap();
        assert_eq!(dev.stats().allocation.all.current, 0);
        assert_eq!((s.counts().served_allocs, s.counts().served_frees), (1, 1));

        // out of memory: c10::OutOfMemoryError with libtorch's shape, thrown from the shim
        let (c, text) = call_malloc(1 << 30, 0).unwrap_err();
        assert_eq!(c, code::OOM, "{text}");
        assert!(libtorch_text_is_oom(&text), "{text}");
        assert!(
            text.contains("\nException raised from throw_failure at ")
                && text.contains("shim/pluggable.cpp:"),
            "{text}"
        );
        let e = tch::TchError::Torch(text.clone());
        assert!(e.is_oom() && !e.is_budget_exceeded(), "{text}");
        assert_eq!(
            e.oom_request().map(|r| (r.requested, r.capacity, r.budget)),
            Some((1 << 30, 64 << 20, false))
        );
        // a budget's refusal stays a budget's through libtorch, with its request and limit
        {
            let _budget = dev.device_budget(ByteSize::mib(1));
            let (c, text) = call_malloc(2 << 20, 0).unwrap_err();
            assert_eq!(c, code::OOM, "{text}");
            let e = tch::TchError::Torch(text.clone());
            assert!(e.is_oom() && e.is_budget_exceeded(), "{text}");
            assert_eq!(
                e.oom_request().map(|r| (r.requested, r.capacity, r.budget)),
                Some((2 << 20, 1 << 20, true))
            );
        }
        // another GPU: c10::Error, not an out-of-memory
        let (c, text) = call_malloc(64, 1).unwrap_err();
        assert_eq!(c, 2, "{text}");
        assert!(
            text.starts_with("oomguard's allocator serves GPU 0 only"),
            "{text}"
        );
        // a pointer libtorch did not get from it: libtorch's own refusal, nothing freed here
        let (_, text) = call_raw_delete(0x1000).unwrap_err();
        assert!(text.contains("not allocated here"), "{text}");

        // libtorch's emptyCache and setMemoryFraction reach oomguard
        let p = call_malloc(8 << 20, 0).unwrap();
        call_raw_delete(p).unwrap();
        assert!(dev.stats().reserved_bytes.all.current > 0);
        libtorch_empty_cache().unwrap();
        assert_eq!(dev.stats().reserved_bytes.all.current, 0);
        libtorch_set_memory_fraction(0.25, 0).unwrap();
        assert!((dev.allocator().memory_fraction() - 0.25).abs() < 1e-12);
        let (_, text) = libtorch_set_memory_fraction(0.5, 2).unwrap_err();
        assert!(text.contains("GPU 0 only"), "{text}");

        // libtorch's own statistics throw under a pluggable allocator (the module docs say so)
        let (_, text) = libtorch_allocated_bytes(0).unwrap_err();
        assert!(
            text.starts_with("CUDAPluggableAllocator does not yet support getDeviceStats"),
            "{text}"
        );

        // putting libtorch's allocator back
        uninstall().unwrap();
        assert!(!is_current());
        assert_eq!(allocator_state().unwrap().1, "native");
        set_served(None);
    }
}
