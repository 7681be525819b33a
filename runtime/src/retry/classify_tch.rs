//! libtorch's out-of-memory, recognised in the text tch keeps of it (libtorch 2.11.0, tch 0.24.0):
//! [`libtorch_text_is_oom`], and with the `tch` feature [`IsOom`](super::IsOom) for `tch::TchError`
//! (`oomguard-tch` turns the feature on and classifies tch's panics with the same function).
//!
//! The `tch` feature needs libtorch 2.11 to build (tch links it). burn 0.21's optional `burn-tch`
//! would put a second package linking `tch` (torch-sys 0.22) in the workspace's lockfile, which
//! cargo refuses; the root `Cargo.toml` patches it out (vendor/burn-tch-unused).
//!
//! tch's C wrapper (`PROTECT` in torch-sys/libtch/torch_api.h) catches libtorch's C++ exception
//! and keeps only `e.what()`: an out-of-memory reaches Rust as `TchError::Torch(text)`, its type
//! (`c10::OutOfMemoryError`) lost. `what()` is the message, then on the next lines the C++
//! backtrace c10 appends (`TORCH_CHECK`'s "Exception raised from malloc at ... (most recent call
//! first):", then "frame #0: ..." lines). Out-of-memory is recognised only where that text *starts* with one of
//! libtorch 2.11's out-of-memory messages, read by its exact shape, never by a substring search:
//! - the CUDA caching allocator's `OutOfMemoryError` (native or expandable segments, and a
//!   per-process memory fraction's): "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a
//!   total capacity of ..." (or "... Tried to allocate more than 1EB memory.");
//! - the `cudaMallocAsync` backend's `OutOfMemoryError`: "Allocation on device 0 would exceed
//!   allowed memory. (out of memory)";
//! - the CUDA runtime's `cudaErrorMemoryAllocation` through `C10_CUDA_CHECK` (a `cudaMalloc`
//!   outside the cache, e.g. with `PYTORCH_NO_CUDA_MEMORY_CACHING=1`): "CUDA error: out of
//!   memory" and a line break;
//! - cuBLAS's `CUBLAS_STATUS_ALLOC_FAILED` (`TORCH_CUDABLAS_CHECK` and the cuBLASLt checks): "CUDA
//!   error: CUBLAS_STATUS_ALLOC_FAILED when calling ...";
//! - the CPU allocator's failure with `ENOMEM` (a `CAFFE_ENFORCE`): "[enforce fail at
//!   alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to
//!   allocate N bytes. Error code 12 (Cannot allocate memory)": on the CPU device, host memory is
//!   the device's, and a smaller batch may fit (other error codes are not out-of-memory).
//!
//! Not recognised: any other text, a message that quotes one of these after its own words (a
//! `TORCH_CHECK` that formats another error, tch's `path_context` prefix "file.pt: ..."), and
//! every other `TchError` variant (tch's own conversions, I/O, shapes). The texts are libtorch
//! 2.11.0's (its libc10 / libc10_cuda / libtorch_cuda strings); oomguard-tch's tests check them
//! against messages libtorch itself raised.

/// The caching allocator's `OutOfMemoryError`, followed by a size ("2.00 GiB", "512 bytes") or
/// "more than 1EB memory.".
const CACHING: &str = "CUDA out of memory. Tried to allocate ";
/// The `cudaMallocAsync` backend's `OutOfMemoryError`: this, the device, then [`ASYNC_TAIL`].
const ASYNC: &str = "Allocation on device ";
/// See [`ASYNC`].
const ASYNC_TAIL: &str = " would exceed allowed memory. (out of memory)";
/// `cudaErrorMemoryAllocation` through `C10_CUDA_CHECK`, followed by a line break.
const DRIVER: &str = "CUDA error: out of memory";
/// cuBLAS's allocation failure, followed by the call (`` `cublasCreate(handle)` `` or words).
const CUBLAS: &str = "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling ";
/// The CPU allocator's failure: [`CPU_ENFORCE`], its line, this, the bytes, then [`CPU_ENOMEM`].
const CPU: &str = "] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate ";
/// `CAFFE_ENFORCE`'s prefix in front of [`CPU`], followed by the line number.
const CPU_ENFORCE: &str = "[enforce fail at alloc_cpu.cpp:";
/// See [`CPU`]: `posix_memalign`'s `ENOMEM`.
const CPU_ENOMEM: &str = " bytes. Error code 12 (";

/// Whether `text` (a `TchError::Torch` message: libtorch's `what()`) starts with one of libtorch
/// 2.11's out-of-memory messages: the CUDA caching allocator's "CUDA out of memory. Tried to
/// allocate ...", the `cudaMallocAsync` backend's "Allocation on device N would exceed allowed
/// memory. (out of memory)", the CUDA runtime's "CUDA error: out of memory", cuBLAS's "CUDA
/// error: CUBLAS_STATUS_ALLOC_FAILED when calling ...", or the CPU allocator's `ENOMEM`. Read
/// from the start, by shape; text that merely quotes one of them is not an out-of-memory. Used
/// by `oomguard-tch` on `TchError::Torch` texts and panic messages.
pub fn libtorch_text_is_oom(text: &str) -> bool {
    if let Some(rest) = text.strip_prefix(CACHING) {
        return rest.starts_with(|c: char| c.is_ascii_digit())
            || rest.starts_with("more than 1EB memory.");
    }
    if let Some(rest) = text.strip_prefix(ASYNC) {
        return strip_digits(rest).is_some_and(|tail| tail.starts_with(ASYNC_TAIL));
    }
    if let Some(rest) = text.strip_prefix(DRIVER) {
        return rest.is_empty() || rest.starts_with('\n');
    }
    if let Some(rest) = text.strip_prefix(CUBLAS) {
        return !rest.is_empty();
    }
    if let Some(rest) = text.strip_prefix(CPU_ENFORCE) {
        return strip_digits(rest)
            .and_then(|rest| rest.strip_prefix(CPU))
            .and_then(strip_digits)
            .is_some_and(|tail| tail.starts_with(CPU_ENOMEM));
    }
    false
}

/// `TchError::Torch(text)` is an out-of-memory when `text` starts with one of libtorch 2.11's
/// out-of-memory messages ([`libtorch_text_is_oom`]); tch's other variants (its own conversions,
/// I/O, shapes, `FileFormat`, ...) never are. A per-process memory fraction's out-of-memory is
/// libtorch's caching allocator's, so it is an out-of-memory, not a budget's
/// ([`IsOom::is_budget_exceeded`](super::IsOom::is_budget_exceeded) stays `false`): the fraction caps reserved memory, and
/// emptying the cache can make room under it.
#[cfg(feature = "tch")]
impl super::IsOom for tch::TchError {
    fn is_oom(&self) -> bool {
        matches!(self, tch::TchError::Torch(text) if libtorch_text_is_oom(text))
    }
}

/// `s` after one or more leading ASCII digits; `None` when it does not start with one.
fn strip_digits(s: &str) -> Option<&str> {
    let tail = s.trim_start_matches(|c: char| c.is_ascii_digit());
    (tail.len() < s.len()).then_some(tail)
}

#[cfg(test)]
mod tests {
    use super::*;

    // The forms as libtorch 2.11.0 builds them (message, then c10's backtrace lines); the exact
    // texts libtorch raised are checked in oomguard-tch's tests (tch/tests/classify.rs).
    const BT: &str = "\nException raised from malloc at /pytorch/c10/cuda/CUDACachingAllocator.cpp:1450 (most recent call first):\nframe #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x9d (0x7f in libc10.so)\n";

    #[test]
    fn libtorch_oom_shapes_are_recognised() {
        assert!(libtorch_text_is_oom(&format!(
            "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 3.12 GiB is free.{BT}"
        )));
        assert!(libtorch_text_is_oom(
            "CUDA out of memory. Tried to allocate 512 bytes. GPU 0 has"
        ));
        assert!(libtorch_text_is_oom(
            "CUDA out of memory. Tried to allocate more than 1EB memory."
        ));
        assert!(libtorch_text_is_oom(
            "Allocation on device 0 would exceed allowed memory. (out of memory)\nCurrently allocated     : 1.00 GiB"
        ));
        assert!(libtorch_text_is_oom(&format!(
            "CUDA error: out of memory\nSearch for `cudaErrorMemoryAllocation' in https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html for more information.{BT}"
        )));
        assert!(libtorch_text_is_oom("CUDA error: out of memory"));
        assert!(libtorch_text_is_oom(&format!(
            "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`{BT}"
        )));
        assert!(libtorch_text_is_oom(&format!(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate 4503599627370496 bytes. Error code 12 (Cannot allocate memory){BT}"
        )));
    }

    #[test]
    fn other_errors_and_quoted_text_are_not_oom() {
        // quoted inside another error, or behind a prefix (tch's path_context)
        assert!(!libtorch_text_is_oom(
            "worker failed: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0"
        ));
        assert!(!libtorch_text_is_oom(
            "model.pt: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0"
        ));
        assert!(!libtorch_text_is_oom(" CUDA error: out of memory\n"));
        // near misses of each form
        assert!(!libtorch_text_is_oom(
            "CUDA out of memory. Tried to allocate "
        ));
        assert!(!libtorch_text_is_oom(
            "CUDA out of memory. Tried to allocate a lot"
        ));
        assert!(!libtorch_text_is_oom(
            "Allocation on device  would exceed allowed memory. (out of memory)"
        ));
        assert!(!libtorch_text_is_oom(
            "Allocation on device 0 failed: invalid argument"
        ));
        assert!(!libtorch_text_is_oom(
            "CUDA error: out of memory tracking was turned off"
        ));
        assert!(!libtorch_text_is_oom(
            "CUDA error: an illegal memory access was encountered\n"
        ));
        assert!(!libtorch_text_is_oom(
            "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle)`"
        ));
        assert!(!libtorch_text_is_oom(
            "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling "
        ));
        assert!(!libtorch_text_is_oom(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate 64 bytes. Error code 22 (Invalid argument)"
        ));
        assert!(!libtorch_text_is_oom(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate  bytes. Error code 12 ("
        ));
        assert!(!libtorch_text_is_oom(
            "DefaultCPUAllocator: can't allocate memory: you tried to allocate 64 bytes. Error code 12 ("
        ));
        assert!(!libtorch_text_is_oom(
            "[enforce fail at other.cpp:1] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate 64 bytes. Error code 12 ("
        ));
        assert!(!libtorch_text_is_oom(
            "mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"
        ));
        assert!(!libtorch_text_is_oom(""));
    }
}
