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
//! first):", then "frame #0: ..." lines). Out-of-memory is recognised only where that text
//! *starts* with one of libtorch 2.11's out-of-memory messages, read by its exact shape, never by
//! a substring search, and the throw site that backtrace names is that message's (a user's
//! `_assert_async` message worded as an out-of-memory starts the text too, but the site is then
//! the assertion's; see [`libtorch_text_is_oom`]):
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

use super::OomRequest;

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
/// The line of c10's backtrace that names the throw site: this, the function, " at ", the
/// file, ':', the line, then [`SITE_TAIL`].
const SITE: &str = "\nException raised from ";
/// See [`SITE`].
const SITE_TAIL: &str = " (most recent call first):";
/// Where libtorch's CUDA allocators throw [`CACHING`] and [`ASYNC`]: a file of c10's CUDA
/// folder (`c10/cuda/CUDACachingAllocator.cpp`, `c10/cuda/CUDAMallocAsyncAllocator.cpp`; the
/// folder, not the file, so that code moved between its files still counts).
const ALLOCATOR_FOLDER: &str = "c10/cuda/";
/// Where oomguard-tch's allocator shim throws [`CACHING`] for oomguard's refusals.
const SHIM_SITE: &str = "shim/pluggable.cpp";

/// Whether `text` (a `TchError::Torch` message: libtorch's `what()`) is one of libtorch 2.11's
/// out-of-memory errors: it starts with one of their messages (the CUDA caching allocator's
/// "CUDA out of memory. Tried to allocate ...", the `cudaMallocAsync` backend's "Allocation on
/// device N would exceed allowed memory. (out of memory)", the CUDA runtime's "CUDA error: out
/// of memory", cuBLAS's "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling ...", or the CPU
/// allocator's `ENOMEM`), read from the start, by shape, and the place libtorch says it threw
/// from (the "Exception raised from" line of c10's backtrace) is that message's. Text that merely quotes one of them is not an
/// out-of-memory, and neither is a user's message worded as one: libtorch puts the message of
/// a failed `_assert_async` (or any `TORCH_CHECK` with the user's words) first, then its own
/// throw site, which is the assertion's, never an allocator's. Used by `oomguard-tch` on
/// `TchError::Torch` texts and panic messages.
///
/// The throw sites, by message: the caching allocator's and the async backend's in c10's CUDA
/// folder (`c10/cuda/CUDACachingAllocator.cpp`, `c10/cuda/CUDAMallocAsyncAllocator.cpp`), or in
/// oomguard-tch's allocator shim (`shim/pluggable.cpp`, which throws the caching allocator's
/// message for oomguard's refusals); the CUDA runtime's and
/// cuBLAS's in one of libtorch's CUDA sources (a `cuda` folder: `C10_CUDA_CHECK` and
/// `TORCH_CUDABLAS_CHECK` name their caller); the CPU allocator's `CAFFE_ENFORCE` names none
/// (its site, `alloc_cpu.cpp`, is in its message). A text without any throw site (a
/// message alone, e.g. a `TchError::Torch` built by hand) is read by its message.
pub fn libtorch_text_is_oom(text: &str) -> bool {
    let site = throw_site_file(text);
    let in_allocator = || {
        site.as_ref()
            .is_none_or(|f| f.contains(ALLOCATOR_FOLDER) || f.ends_with(SHIM_SITE))
    };
    let in_cuda_source = || site.as_ref().is_none_or(|f| f.contains("/cuda/"));
    if let Some(rest) = text.strip_prefix(CACHING) {
        return (rest.starts_with(|c: char| c.is_ascii_digit())
            || rest.starts_with("more than 1EB memory."))
            && in_allocator();
    }
    if let Some(rest) = text.strip_prefix(ASYNC) {
        return strip_digits(rest).is_some_and(|tail| tail.starts_with(ASYNC_TAIL))
            && in_allocator();
    }
    if let Some(rest) = text.strip_prefix(DRIVER) {
        return (rest.is_empty() || rest.starts_with('\n')) && in_cuda_source();
    }
    if let Some(rest) = text.strip_prefix(CUBLAS) {
        return !rest.is_empty() && in_cuda_source();
    }
    if let Some(rest) = text.strip_prefix(CPU_ENFORCE) {
        return strip_digits(rest)
            .and_then(|rest| rest.strip_prefix(CPU))
            .and_then(strip_digits)
            .is_some_and(|tail| tail.starts_with(CPU_ENOMEM))
            && site.is_none();
    }
    false
}

/// How oomguard-tch's allocator (`oomguard_tch::allocator`, oomguard's allocator under libtorch)
/// names a refusal of oomguard's, after libtorch's "CUDA out of memory. Tried to allocate 2.00
/// GiB. ": this, the GPU, [`REFUSED`], the bytes requested, [`AGAINST_BUDGET`] or
/// [`AGAINST_DEVICE`], the capacity in bytes, then [`REFUSAL_TAIL`] and oomguard's error.
const REFUSAL: &str = "oomguard's allocator on GPU ";
/// See [`REFUSAL`].
const REFUSED: &str = " refused ";
/// See [`REFUSAL`]: a budget's limit.
const AGAINST_BUDGET: &str = " bytes against a budget of ";
/// See [`REFUSAL`]: the device's whole capacity.
const AGAINST_DEVICE: &str = " bytes against the device's capacity of ";
/// See [`REFUSAL`].
const REFUSAL_TAIL: &str = " bytes";

/// The words oomguard-tch's allocator puts after libtorch's "CUDA out of memory. Tried to
/// allocate 2.00 GiB. " when oomguard refuses libtorch an allocation on GPU `ordinal`, so that
/// the request and what it was refused against survive tch (which keeps only the text):
/// "oomguard's allocator on GPU 0 refused 2147483648 bytes against a budget of 1073741824
/// bytes" (or "against the device's capacity of ..."). [`libtorch_text_oom_request`] reads
/// them back; the allocator appends ": " and oomguard's error.
pub fn oomguard_allocator_refusal(ordinal: usize, request: &OomRequest) -> String {
    let against = if request.budget {
        AGAINST_BUDGET
    } else {
        AGAINST_DEVICE
    };
    format!(
        "{REFUSAL}{ordinal}{REFUSED}{}{against}{}{REFUSAL_TAIL}",
        request.requested, request.capacity
    )
}

/// The request that failed, and what it was refused against, of an out-of-memory
/// ([`libtorch_text_is_oom`]) that oomguard-tch's allocator threw for a refusal of oomguard's
/// ([`oomguard_allocator_refusal`]'s words, thrown from its shim, `shim/pluggable.cpp`).
/// `None` for libtorch's own out-of-memory texts (their sizes are rounded for reading, not
/// parsed) and any other text.
pub fn libtorch_text_oom_request(text: &str) -> Option<OomRequest> {
    if !libtorch_text_is_oom(text) {
        return None;
    }
    if throw_site_file(text).is_some_and(|f| !f.ends_with(SHIM_SITE)) {
        return None;
    }
    // "2.00 GiB. oomguard's ..." (the size's own '.' is never followed by a space)
    let (_size, rest) = text.strip_prefix(CACHING)?.split_once(". ")?;
    let rest = strip_digits(rest.strip_prefix(REFUSAL)?)?.strip_prefix(REFUSED)?;
    let (requested, rest) = leading_u64(rest)?;
    let (budget, rest) = match rest.strip_prefix(AGAINST_BUDGET) {
        Some(rest) => (true, rest),
        None => (false, rest.strip_prefix(AGAINST_DEVICE)?),
    };
    let (capacity, rest) = leading_u64(rest)?;
    rest.starts_with(REFUSAL_TAIL).then_some(OomRequest {
        requested,
        capacity,
        budget,
    })
}

/// Whether `text` is the out-of-memory oomguard-tch's allocator threw for a budget of
/// oomguard's ([`libtorch_text_oom_request`] says it was refused against a budget): emptying
/// the cache cannot help, as for oomguard's own `BudgetExceeded`.
pub fn libtorch_text_is_budget_exceeded(text: &str) -> bool {
    libtorch_text_oom_request(text).is_some_and(|r| r.budget)
}

/// The number `s` starts with, and what follows it.
fn leading_u64(s: &str) -> Option<(u64, &str)> {
    let tail = strip_digits(s)?;
    let n = s[..s.len() - tail.len()].parse().ok()?;
    Some((n, tail))
}

/// The file of the place a c10 error says it was thrown from: `TORCH_CHECK` and its kin append,
/// after the message (and its context lines), "Exception raised from FUNCTION at FILE:LINE
/// (most recent call first):", then the frames. The message comes first and may hold any text,
/// such a line included, so the site is the *last* such line (c10's frames never start with
/// those words). `\\` separators (a Windows build's) become `/`. `None` when the text names no
/// site: a `CAFFE_ENFORCE` (its `what()` has the frames only), or a message without c10's
/// backtrace.
fn throw_site_file(text: &str) -> Option<String> {
    let start = text.rfind(SITE)? + SITE.len();
    let line = text[start..].split('\n').next()?;
    let line = line.strip_suffix(SITE_TAIL)?;
    let (_function, at) = line.split_once(" at ")?;
    // FILE:LINE; the file may hold a ':' itself (a drive letter), the line never does
    let (file, number) = at.rsplit_once(':')?;
    number.parse::<u32>().ok()?;
    Some(file.replace('\\', "/"))
}

/// `TchError::Torch(text)` is an out-of-memory when `text` starts with one of libtorch 2.11's
/// out-of-memory messages ([`libtorch_text_is_oom`]); tch's other variants (its own conversions,
/// I/O, shapes, `FileFormat`, ...) never are. A per-process memory fraction's out-of-memory is
/// libtorch's caching allocator's, so it is an out-of-memory, not a budget's
/// ([`IsOom::is_budget_exceeded`](super::IsOom::is_budget_exceeded) stays `false`): the
/// fraction caps reserved memory, and emptying the cache can make room under it. Under
/// oomguard-tch's allocator, a refusal of oomguard's carries its request and what it was
/// refused against ([`libtorch_text_oom_request`]): a budget's is a budget's.
#[cfg(feature = "tch")]
impl super::IsOom for tch::TchError {
    fn is_oom(&self) -> bool {
        matches!(self, tch::TchError::Torch(text) if libtorch_text_is_oom(text))
    }
    fn is_budget_exceeded(&self) -> bool {
        matches!(self, tch::TchError::Torch(text) if libtorch_text_is_budget_exceeded(text))
    }
    fn oom_request(&self) -> Option<OomRequest> {
        match self {
            tch::TchError::Torch(text) => libtorch_text_oom_request(text),
            _ => None,
        }
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
    /// c10's backtrace after a `TORCH_CHECK` thrown in `file`.
    fn bt(function: &str, file: &str) -> String {
        format!("\nException raised from {function} at {file}:1450 (most recent call first):\nframe #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x9d (0x7f in libc10.so)\n")
    }
    const CACHING_BT: &str = "/pytorch/c10/cuda/CUDACachingAllocator.cpp";
    /// A `CAFFE_ENFORCE`'s backtrace: frames only.
    const ENFORCE_BT: &str = "\nframe #0: c10::ThrowEnforceNotMet(char const*, int, char const*, std::string const&, void const*) + 0x50 (0x7f in libc10.so)\n";
    /// Where libtorch throws a failed `_assert_async` with the user's message.
    const ASSERT_SITE: (&str, &str) = (
        "_assert_async_msg_cpu",
        "/pytorch/aten/src/ATen/native/TensorCompare.cpp",
    );

    /// Each form's message and a throw site libtorch gives it.
    fn forms() -> Vec<(String, String)> {
        let caching = bt("malloc", CACHING_BT);
        vec![
            (
                "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 3.12 GiB is free.".into(),
                caching.clone(),
            ),
            ("CUDA out of memory. Tried to allocate 512 bytes. GPU 0 has".into(), caching.clone()),
            ("CUDA out of memory. Tried to allocate more than 1EB memory.".into(), caching.clone()),
            (
                "CUDA out of memory. Tried to allocate 2.00 GiB. oomguard's allocator on GPU 0: x".into(),
                bt("throw_failure", "/src/oomguard/tch/shim/pluggable.cpp"),
            ),
            (
                "Allocation on device 0 would exceed allowed memory. (out of memory)\nCurrently allocated     : 1.00 GiB".into(),
                bt("mallocAsync", "/pytorch/c10/cuda/CUDAMallocAsyncAllocator.cpp"),
            ),
            (
                "CUDA error: out of memory\nSearch for `cudaErrorMemoryAllocation' in https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html for more information.".into(),
                caching.clone(),
            ),
            (
                "CUDA error: out of memory".into(),
                bt("copy_kernel_cuda", "C:\\actions\\pytorch\\aten\\src\\ATen\\native\\cuda\\Copy.cu"),
            ),
            (
                "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`".into(),
                bt("createCublasHandle", "/pytorch/aten/src/ATen/cuda/CublasHandlePool.cpp"),
            ),
            (
                "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate 4503599627370496 bytes. Error code 12 (Cannot allocate memory)".into(),
                ENFORCE_BT.into(),
            ),
        ]
    }

    #[test]
    fn libtorch_oom_shapes_are_recognised() {
        for (message, site) in forms() {
            assert!(
                libtorch_text_is_oom(&format!("{message}{site}")),
                "{message}{site}"
            );
            // the message alone (no backtrace: a hand-made error) is read by its shape
            assert!(libtorch_text_is_oom(&message), "{message}");
        }
    }

    #[test]
    fn a_user_message_worded_as_an_oom_is_not_one() {
        let (function, file) = ASSERT_SITE;
        let assert_bt = bt(function, file);
        for (message, site) in forms() {
            // libtorch's assertion: the user's message, then the assertion's site
            let t = format!("{message}{assert_bt}");
            assert!(!libtorch_text_is_oom(&t), "{t}");
            // a message that forges the allocator's site: the real one comes last
            let t = format!("{message}{site}{assert_bt}");
            assert!(!libtorch_text_is_oom(&t), "{t}");
        }
        // each form's own sites only: the allocators' messages from outside c10's CUDA folder
        assert!(!libtorch_text_is_oom(&format!(
            "Allocation on device 0 would exceed allowed memory. (out of memory){}",
            bt("f", "/pytorch/aten/src/ATen/native/cuda/TensorCompare.cu")
        )));
        assert!(!libtorch_text_is_oom(&format!(
            "CUDA out of memory. Tried to allocate 2.00 GiB.{}",
            bt("f", "/pytorch/aten/src/ATen/cuda/CublasHandlePool.cpp")
        )));
        assert!(!libtorch_text_is_oom(&format!(
            "CUDA error: out of memory{}",
            bt("check", "/my/extension/op.cpp")
        )));
        // a throw site line that does not parse is no site: read by the message
        assert!(libtorch_text_is_oom(
            "CUDA error: out of memory\nException raised from nowhere"
        ));
    }

    #[test]
    fn oomguards_allocator_refusal_carries_its_request() {
        let shim = bt("throw_failure", "/src/oomguard/tch/shim/pluggable.cpp");
        for (budget, capacity) in [(true, 1 << 20), (false, 80 << 30)] {
            let req = OomRequest {
                requested: 2 << 20,
                capacity,
                budget,
            };
            let message = format!(
                "CUDA out of memory. Tried to allocate 2.00 MiB. {}: memory budget exceeded",
                oomguard_allocator_refusal(0, &req)
            );
            for text in [message.clone(), format!("{message}{shim}")] {
                assert!(libtorch_text_is_oom(&text), "{text}");
                assert_eq!(libtorch_text_oom_request(&text), Some(req), "{text}");
                assert_eq!(libtorch_text_is_budget_exceeded(&text), budget, "{text}");
            }
            // the same words from a user's assertion, or thrown elsewhere, carry nothing
            let (function, file) = ASSERT_SITE;
            let forged = format!("{message}{shim}{}", bt(function, file));
            assert!(!libtorch_text_is_oom(&forged));
            assert_eq!(libtorch_text_oom_request(&forged), None);
            assert!(!libtorch_text_is_budget_exceeded(&forged));
            let cached = format!("{message}{}", bt("malloc", CACHING_BT));
            assert!(libtorch_text_is_oom(&cached));
            assert_eq!(libtorch_text_oom_request(&cached), None);
        }
        // 1 EB and more: libtorch's words for the size
        let req = OomRequest {
            requested: 1 << 61,
            capacity: 80 << 30,
            budget: false,
        };
        let text = format!(
            "CUDA out of memory. Tried to allocate more than 1EB memory. {}: x",
            oomguard_allocator_refusal(3, &req)
        );
        assert_eq!(libtorch_text_oom_request(&text), Some(req));
        // libtorch's own texts and near misses carry no request
        for text in [
            "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB",
            "CUDA out of memory. Tried to allocate 2.00 MiB. oomguard's allocator on GPU 0: x",
            "CUDA out of memory. Tried to allocate 2.00 MiB. oomguard's allocator on GPU 0 refused 2097152 bytes against a budget of  bytes: x",
            "CUDA out of memory. Tried to allocate 2.00 MiB. oomguard's allocator on GPU 0 refused 2097152 bytes against a limit of 1048576 bytes: x",
            "CUDA out of memory. Tried to allocate 2.00 MiB. oomguard's allocator on GPU 0 refused 99999999999999999999999 bytes against a budget of 1048576 bytes: x",
            "Allocation on device 0 would exceed allowed memory. (out of memory)",
            "mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)",
        ] {
            assert_eq!(libtorch_text_oom_request(text), None, "{text}");
            assert!(!libtorch_text_is_budget_exceeded(text), "{text}");
        }
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
