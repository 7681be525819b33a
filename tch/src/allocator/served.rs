//! libtorch's allocator calls, served by an oomguard [`Device`]: the pluggable allocator's
//! malloc / free / record_stream / emptyCache / setMemoryFraction, on one GPU. No libtorch here
//! (the shim's callbacks in `ffi.rs` call these), so it is tested on a simulated device.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

use oomguard::backend::{StreamId, RAW_STREAM_TAG};
use oomguard::{Allocation, Device};

/// CUDA's per-thread default stream handle (`cudaStreamPerThread`).
const PER_THREAD: u64 = 0x2;
/// CUDA's legacy default stream handle (`cudaStreamLegacy`); 0 is the same stream.
const LEGACY: u64 = 0x1;

thread_local! {
    /// The oomguard error behind this thread's last allocation that failed.
    static LAST_ERROR: RefCell<Option<oomguard::Error>> = const { RefCell::new(None) };
}

/// Takes the oomguard error behind the calling thread's last failed allocation.
pub(crate) fn take_last_error() -> Option<oomguard::Error> {
    LAST_ERROR.with(|e| e.borrow_mut().take())
}

/// Why an allocation was refused: the message libtorch throws, as which exception.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// Out of memory (the device's, or a budget's or memory fraction's of oomguard):
    /// `c10::OutOfMemoryError`, with a text that starts as libtorch's own ("CUDA out of memory.
    /// Tried to allocate 2.00 GiB."), so that tch's error is classified as out-of-memory, then
    /// the request and its budget or capacity in bytes
    /// ([`oomguard::retry::oomguard_allocator_refusal`]), so that a budget's stays a budget's
    /// ([`oomguard::retry::libtorch_text_oom_request`]).
    Oom(String),
    /// Anything else: `c10::Error`.
    Other(String),
}

/// What the allocator did so far ([`crate::allocator::counts`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Counts {
    /// Allocations oomguard served to libtorch.
    pub served_allocs: u64,
    /// Frees of those allocations.
    pub served_frees: u64,
    /// Allocations refused (out of memory, a budget, another GPU, another failure).
    pub refused_allocs: u64,
    /// Frees of pointers oomguard did not serve (or that failed inside oomguard): each is
    /// logged as an error; nothing is freed.
    pub unknown_frees: u64,
    /// Blocks served and not yet freed.
    pub live: u64,
}

/// One GPU served for libtorch: its oomguard device and the blocks libtorch holds.
pub(crate) struct Served {
    pub(crate) ordinal: usize,
    pub(crate) device: Device,
    live: Mutex<HashMap<u64, Allocation>>,
    allocs: AtomicU64,
    frees: AtomicU64,
    refused: AtomicU64,
    unknown_frees: AtomicU64,
}

/// libtorch's wording of a size (c10's `format_size`), for its out-of-memory message's shape.
pub(crate) fn libtorch_size(bytes: u64) -> String {
    let b = bytes as f64;
    if bytes <= 1024 {
        format!("{bytes} bytes")
    } else if bytes <= 1 << 20 {
        format!("{:.2} KiB", b / 1024.0)
    } else if bytes <= 1 << 30 {
        format!("{:.2} MiB", b / (1u64 << 20) as f64)
    } else {
        format!("{:.2} GiB", b / (1u64 << 30) as f64)
    }
}

impl Served {
    pub(crate) fn new(ordinal: usize, device: Device) -> Self {
        Self {
            ordinal,
            device,
            live: Mutex::new(HashMap::new()),
            allocs: AtomicU64::new(0),
            frees: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            unknown_frees: AtomicU64::new(0),
        }
    }

    fn live(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Allocation>> {
        // Only inserts and removes happen under the lock: a poisoned map is still valid.
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn counts(&self) -> Counts {
        Counts {
            served_allocs: self.allocs.load(Relaxed),
            served_frees: self.frees.load(Relaxed),
            refused_allocs: self.refused.load(Relaxed),
            unknown_frees: self.unknown_frees.load(Relaxed),
            live: self.live().len() as u64,
        }
    }

    /// The allocator's stream id for a `cudaStream_t` libtorch passes: its default stream (the
    /// legacy stream, handle 0) is oomguard's stream 0; any other handle (libtorch's pool
    /// streams, user streams) is its own stream, tagged raw (oomguard records events on it).
    fn stream_id(&self, raw: u64) -> Result<StreamId, String> {
        match raw {
            0 | LEGACY => Ok(0),
            // libtorch's own builds never pass it (c10's default stream is the legacy one);
            // refused rather than guessed: its id would depend on the calling thread.
            PER_THREAD => Err(format!(
                "oomguard's allocator on GPU {} does not serve CUDA's per-thread default stream \
                 (cudaStreamPerThread): libtorch built with per-thread default streams is not \
                 supported",
                self.ordinal
            )),
            h => Ok(h | RAW_STREAM_TAG),
        }
    }

    fn refuse(&self, r: Refusal) -> Result<u64, Refusal> {
        self.refused.fetch_add(1, Relaxed);
        Err(r)
    }

    /// libtorch's `malloc(size, device, stream)`: a device pointer, 0 for 0 bytes (libtorch's
    /// own allocator's answer: no memory).
    pub(crate) fn alloc(&self, size: usize, device: i32, stream: u64) -> Result<u64, Refusal> {
        if size == 0 {
            return Ok(0);
        }
        if usize::try_from(device).ok() != Some(self.ordinal) {
            return self.refuse(Refusal::Other(format!(
                "oomguard's allocator serves GPU {} only (oomguard_tch::allocator::install({})), \
                 and libtorch asked it for {size} bytes on GPU {device}: keep CUDA tensors on \
                 GPU {}",
                self.ordinal, self.ordinal, self.ordinal
            )));
        }
        let id = match self.stream_id(stream) {
            Ok(id) => id,
            Err(m) => return self.refuse(Refusal::Other(m)),
        };
        match self.device.alloc_raw(size as u64, id) {
            Ok(a) => {
                self.live().insert(a.ptr, a);
                self.allocs.fetch_add(1, Relaxed);
                Ok(a.ptr)
            }
            Err(e) => {
                let r = if e.is_oom() {
                    // The request and its budget or capacity in words the classifier reads
                    // back: tch keeps only the text, and a budget's refusal must stay one.
                    let who = match oomguard::IsOom::oom_request(&e) {
                        Some(req) => {
                            oomguard::retry::oomguard_allocator_refusal(self.ordinal, &req)
                        }
                        None => format!("oomguard's allocator on GPU {}", self.ordinal),
                    };
                    Refusal::Oom(format!(
                        "CUDA out of memory. Tried to allocate {}. {who}: {e}",
                        libtorch_size(size as u64),
                    ))
                } else {
                    Refusal::Other(format!(
                        "oomguard's allocator on GPU {} could not allocate {size} bytes: {e}",
                        self.ordinal
                    ))
                };
                LAST_ERROR.with(|l| *l.borrow_mut() = Some(e));
                self.refuse(r)
            }
        }
    }

    /// libtorch's `free(ptr, size, device, stream)` (the stream is the allocation's). Never
    /// fails towards libtorch (it runs in a tensor's destructor): a pointer oomguard did not
    /// serve, or a free oomguard refuses, is counted and logged as an error.
    pub(crate) fn free(&self, ptr: u64, size: usize) {
        if ptr == 0 {
            return;
        }
        let taken = self.live().remove(&ptr);
        let result = match taken {
            Some(a) => self.device.free_raw(a).map_err(|e| e.to_string()),
            None => Err("not a block oomguard's allocator served to libtorch".to_string()),
        };
        match result {
            Ok(()) => {
                self.frees.fetch_add(1, Relaxed);
            }
            Err(why) => {
                self.unknown_frees.fetch_add(1, Relaxed);
                tracing::error!(ptr, size, %why, "oomguard's allocator under libtorch: a free was not served");
                if !tracing::dispatcher::has_been_set() {
                    eprintln!(
                        "oomguard error: libtorch freed {ptr:#x} ({size} bytes) through oomguard's \
                         allocator on GPU {}, which did not free it: {why}",
                        self.ordinal
                    );
                }
            }
        }
    }

    /// libtorch's `recordStream(ptr, stream)` (`Tensor::record_stream`): the block is not
    /// reused, once freed, until the work queued on `stream` by then has completed.
    pub(crate) fn record_stream(&self, ptr: u64, stream: u64) -> Result<(), String> {
        let Some(a) = self.live().get(&ptr).copied() else {
            return Err(format!(
                "record_stream on {ptr:#x}: not a live block oomguard's allocator served to \
                 libtorch on GPU {}",
                self.ordinal
            ));
        };
        let id = self.stream_id(stream)?;
        self.device
            .allocator()
            .record_stream(&a, id)
            .map_err(|e| e.to_string())
    }

    /// libtorch's `emptyCache` (any memory pool): oomguard's `empty_cache`.
    pub(crate) fn empty_cache(&self) -> Result<(), String> {
        self.device.empty_cache().map_err(|e| {
            format!(
                "oomguard's allocator on GPU {}: empty_cache failed: {e}",
                self.ordinal
            )
        })
    }

    /// libtorch's `setMemoryFraction(fraction, device)`: oomguard's memory fraction (a cap on
    /// what its cache holds, out-of-memory past it).
    pub(crate) fn set_memory_fraction(&self, fraction: f64, device: i32) -> Result<(), String> {
        if usize::try_from(device).ok() != Some(self.ordinal) {
            return Err(format!(
                "oomguard's allocator serves GPU {} only; setMemoryFraction was asked for GPU \
                 {device}",
                self.ordinal
            ));
        }
        self.device
            .set_memory_fraction(fraction)
            .map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use oomguard::retry::libtorch_text_is_oom;
    use oomguard::{ByteSize, IsOom};

    fn served() -> Served {
        Served::new(0, Device::sim(ByteSize::mib(64)))
    }

    #[test]
    fn sizes_are_worded_as_libtorch_words_them() {
        assert_eq!(libtorch_size(512), "512 bytes");
        assert_eq!(libtorch_size(1024), "1024 bytes");
        assert_eq!(libtorch_size(1536), "1.50 KiB");
        assert_eq!(libtorch_size(3 << 20), "3.00 MiB");
        assert_eq!(libtorch_size(5 << 30), "5.00 GiB");
    }

    #[test]
    fn allocations_and_frees_go_to_the_device() {
        let s = served();
        let p = s.alloc(4096, 0, 0).unwrap();
        assert_ne!(p, 0);
        let st = s.device.stats();
        assert_eq!(st.allocation.all.current, 1);
        assert!(st.allocated_bytes.all.current >= 4096);
        // a pool stream of libtorch's is a stream of its own
        let q = s.alloc(4096, 0, 0x7f00_1234_5600).unwrap();
        assert_eq!(
            s.live().get(&q).unwrap().stream,
            0x7f00_1234_5600 | RAW_STREAM_TAG
        );
        s.free(p, 4096);
        s.free(q, 4096);
        assert_eq!(s.device.stats().allocation.all.current, 0);
        let c = s.counts();
        assert_eq!((c.served_allocs, c.served_frees, c.live), (2, 2, 0));
    }

    #[test]
    fn zero_bytes_is_a_null_pointer_and_its_free_nothing() {
        let s = served();
        assert_eq!(s.alloc(0, 0, 0), Ok(0));
        s.free(0, 0);
        assert_eq!(s.counts(), Counts::default());
    }

    #[test]
    fn out_of_memory_is_worded_as_libtorch_words_it() {
        let s = served();
        let Err(Refusal::Oom(text)) = s.alloc(1 << 30, 0, 0) else {
            panic!("1 GiB on a 64 MiB device must be an out-of-memory");
        };
        assert!(text.starts_with("CUDA out of memory. Tried to allocate 1024.00 MiB."));
        assert!(libtorch_text_is_oom(&text), "{text}");
        assert!(take_last_error().unwrap().is_oom());
        assert!(take_last_error().is_none());
        assert_eq!(s.counts().refused_allocs, 1);
    }

    #[test]
    fn a_budget_is_an_out_of_memory_and_says_so() {
        let s = served();
        let _b = s.device.device_budget(ByteSize::mib(1));
        let Err(Refusal::Oom(text)) = s.alloc(2 << 20, 0, 0) else {
            panic!("2 MiB under a 1 MiB budget must be refused as out-of-memory");
        };
        assert!(libtorch_text_is_oom(&text), "{text}");
        assert!(take_last_error().unwrap().is_budget_exceeded());
        // tch's error of that text is a budget's, with the request and the budget's limit: the
        // engine skips the same-plan retry, which cannot help
        let e = tch::TchError::Torch(text.clone());
        assert!(e.is_oom() && e.is_budget_exceeded(), "{text}");
        let r = e.oom_request().expect("the request is in the text");
        assert_eq!(
            (r.requested, r.capacity, r.budget),
            (2 << 20, 1 << 20, true)
        );
        assert!(r.exceeds_capacity());
        let e = crate::Error::OomPanic { message: text };
        assert!(e.is_oom() && e.is_budget_exceeded());
        assert_eq!(e.oom_request(), Some(r));
    }

    #[test]
    fn a_device_oom_carries_its_request_and_is_not_a_budgets() {
        let s = served();
        let Err(Refusal::Oom(text)) = s.alloc(1 << 30, 0, 0) else {
            panic!("1 GiB on a 64 MiB device must be an out-of-memory");
        };
        let e = tch::TchError::Torch(text.clone());
        assert!(e.is_oom() && !e.is_budget_exceeded(), "{text}");
        let r = e.oom_request().expect("the request is in the text");
        assert_eq!(
            (r.requested, r.capacity, r.budget),
            (1 << 30, 64 << 20, false)
        );
        assert!(crate::Error::from(e).oom_request().is_some());
    }

    #[test]
    fn another_gpu_and_the_per_thread_stream_are_refused_by_name() {
        let s = served();
        let Err(Refusal::Other(text)) = s.alloc(64, 1, 0) else {
            panic!("GPU 1 is not served");
        };
        assert!(
            text.contains("serves GPU 0 only") && text.contains("on GPU 1"),
            "{text}"
        );
        assert!(!libtorch_text_is_oom(&text));
        let Err(Refusal::Other(text)) = s.alloc(64, 0, PER_THREAD) else {
            panic!("the per-thread stream is not served");
        };
        assert!(text.contains("cudaStreamPerThread"), "{text}");
        assert_eq!(s.counts().refused_allocs, 2);
        assert_eq!(s.device.stats().allocation.all.allocated, 0);
    }

    #[test]
    fn a_free_of_a_pointer_not_served_is_counted_and_frees_nothing() {
        let s = served();
        let p = s.alloc(4096, 0, 0).unwrap();
        s.free(p + 512, 4096);
        s.free(p, 4096);
        s.free(p, 4096); // twice
        let c = s.counts();
        assert_eq!((c.served_frees, c.unknown_frees), (1, 2));
        assert_eq!(s.device.stats().allocation.all.current, 0);
    }

    #[test]
    fn record_stream_reaches_the_allocator_and_unknown_pointers_are_named() {
        let s = served();
        let p = s.alloc(4096, 0, 0).unwrap();
        s.record_stream(p, 0x5000).unwrap();
        let e = s.record_stream(p + 8, 0x5000).unwrap_err();
        assert!(e.contains("not a live block"), "{e}");
        s.free(p, 4096);
        assert_eq!(s.counts().served_frees, 1);
    }

    #[test]
    fn empty_cache_and_memory_fraction_reach_the_device() {
        let s = served();
        let p = s.alloc(8 << 20, 0, 0).unwrap();
        s.free(p, 8 << 20);
        assert!(s.device.stats().reserved_bytes.all.current > 0);
        s.empty_cache().unwrap();
        assert_eq!(s.device.stats().reserved_bytes.all.current, 0);
        s.set_memory_fraction(0.25, 0).unwrap();
        assert!(matches!(s.alloc(32 << 20, 0, 0), Err(Refusal::Oom(_))));
        assert!(s
            .set_memory_fraction(0.5, 3)
            .unwrap_err()
            .contains("GPU 0 only"));
        assert!(s.set_memory_fraction(2.0, 0).is_err());
    }
}
