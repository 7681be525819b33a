//! libtorch's own CUDA caching allocator (`c10::cuda::CUDACachingAllocator`), reached through
//! the crate's C++ shim: what `torch.cuda.empty_cache`, `memory_stats`,
//! `set_per_process_memory_fraction` and friends do in PyTorch, for a tch program.
//!
//! Every function checks its arguments first, then that libtorch sees a CUDA device; without
//! one (no driver, no visible device, or a shim built against a CPU libtorch) it returns an
//! `oomguard::Error::Backend` of kind `Unavailable` and never calls into CUDA. libtorch's own
//! errors come back as `Backend` errors carrying its message (without c10's backtrace); an
//! out-of-memory inside libtorch as a `Backend` out-of-memory.
//!
//! These act on libtorch's process-wide allocator, whatever allocated through it (every tch
//! CUDA tensor). [`LibtorchCudaSource`](crate::LibtorchCudaSource) puts them behind oomguard's
//! `MemorySource`.

use std::ffi::c_char;

use crate::device_stats::DeviceStats;
use crate::shim::{self, call};

fn ordinal(device: usize) -> oomguard::Result<i64> {
    i64::try_from(device).map_err(|_| {
        oomguard::Error::InvalidArgument(format!("CUDA device {device}: not a device index"))
    })
}

/// The number of CUDA devices libtorch sees: 0 without a driver or a visible device, or when the
/// shim was built against a libtorch without CUDA. Never initialises CUDA on a device.
pub fn cuda_device_count() -> usize {
    let mut n: i64 = 0;
    // SAFETY: `n` is a live i64 the shim writes; the message buffer comes from `call`.
    let r = call("c10::cuda::device_count", |err, len| unsafe {
        shim::oomguard_tch_cuda_device_count(&mut n, err, len)
    });
    match r {
        Ok(()) => usize::try_from(n).unwrap_or(0),
        Err(_) => 0,
    }
}

/// Whether the shim reaches libtorch's CUDA allocator at all: false when it was built against a
/// libtorch without CUDA (or with `OOMGUARD_TCH_CUDA_INCLUDE=none`). Then every other function
/// of this module returns an `Unavailable` error.
pub fn built_with_cuda() -> bool {
    shim::built_with_cuda()
}

/// A CUDA device as libtorch reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaDeviceInfo {
    /// The device's name (`cudaDeviceProp::name`).
    pub name: String,
    /// Free bytes on the device now (`cudaMemGetInfo`), for every process.
    pub free_bytes: u64,
    /// The device's total memory (`cudaMemGetInfo`).
    pub total_bytes: u64,
}

/// The name, free and total memory of CUDA device `device` (through the allocator's
/// `getMemoryInfo`, i.e. `cudaMemGetInfo` on that device). Initialises libtorch's CUDA state, as
/// the first CUDA tensor would.
pub fn device_info(device: usize) -> oomguard::Result<CudaDeviceInfo> {
    let d = ordinal(device)?;
    let (mut free, mut total) = (0u64, 0u64);
    let mut name = [0 as c_char; 256];
    // SAFETY: the out-pointers and the 256-byte name buffer are live for the call; the shim
    // writes at most `name.len()` bytes there, NUL-terminated.
    call("CUDAAllocator::getMemoryInfo", |err, len| unsafe {
        shim::oomguard_tch_device_info(
            d,
            &mut free,
            &mut total,
            name.as_mut_ptr(),
            name.len(),
            err,
            len,
        )
    })?;
    Ok(CudaDeviceInfo {
        name: shim::fixed_str(&name),
        free_bytes: free,
        total_bytes: total,
    })
}

/// libtorch's allocator statistics for `device` (`torch.cuda.memory_stats`).
pub fn device_stats(device: usize) -> oomguard::Result<DeviceStats> {
    let d = ordinal(device)?;
    let mut out = DeviceStats::default();
    // SAFETY: `out` is a live `DeviceStats`, whose `repr(C)` layout is the shim's
    // `OomguardTchDeviceStats` (same fields, same order, all i64).
    call("CUDACachingAllocator::getDeviceStats", |err, len| unsafe {
        shim::oomguard_tch_device_stats(d, &mut out, err, len)
    })?;
    Ok(out)
}

/// Resets every peak of [`device_stats`] to its current value (`resetPeakStats`).
pub fn reset_peak_stats(device: usize) -> oomguard::Result<()> {
    let d = ordinal(device)?;
    // SAFETY: plain values and the buffer from `call`.
    call("CUDACachingAllocator::resetPeakStats", |err, len| unsafe {
        shim::oomguard_tch_reset_peak_stats(d, err, len)
    })
}

/// Resets the accumulated totals (`allocated`, `freed`, `num_alloc_retries`, `num_ooms`, ...) of
/// [`device_stats`] to 0 (`resetAccumulatedStats`).
pub fn reset_accumulated_stats(device: usize) -> oomguard::Result<()> {
    let d = ordinal(device)?;
    // SAFETY: plain values and the buffer from `call`.
    call(
        "CUDACachingAllocator::resetAccumulatedStats",
        |err, len| unsafe { shim::oomguard_tch_reset_accumulated_stats(d, err, len) },
    )
}

/// Returns every cached, unused block of libtorch's default pools to CUDA, on every device
/// (`emptyCache`, what `torch.cuda.empty_cache` calls; it waits for the blocks' pending stream
/// uses). Blocks still holding a live tensor, and unused blocks split from a segment that holds
/// one, stay. `device` must exist: nothing reaches CUDA without one.
pub fn empty_cache(device: usize) -> oomguard::Result<()> {
    let d = ordinal(device)?;
    // SAFETY: plain values and the buffer from `call`.
    call("CUDACachingAllocator::emptyCache", |err, len| unsafe {
        shim::oomguard_tch_empty_cache(d, err, len)
    })
}

/// The per-process memory fraction in force on `device` (1.0 when none is set).
pub fn memory_fraction(device: usize) -> oomguard::Result<f64> {
    let d = ordinal(device)?;
    let mut f = 0.0f64;
    let op = "CUDACachingAllocator::getMemoryFraction";
    call(op, |err, len| {
        // SAFETY: `f` is a live f64 the shim writes; the buffer comes from `call`.
        unsafe { shim::oomguard_tch_get_memory_fraction(d, &mut f, err, len) }
    })?;
    Ok(f)
}

/// Sets libtorch's per-process memory fraction of `device`
/// (`torch.cuda.set_per_process_memory_fraction`): from then on the allocator refuses to
/// *reserve* more than `floor(fraction × total)` bytes on the device (`total`:
/// `cudaDeviceProp::totalGlobalMem`), counting its cache; an allocation that would pass it
/// releases the cache and retries once, then raises libtorch's out-of-memory. 1.0 lifts the
/// cap. It is process-wide state of the device (every thread), overwritten by the next call;
/// memory already reserved beyond it is not released. Refused: a fraction outside (0, 1], or not
/// finite.
pub fn set_memory_fraction(device: usize, fraction: f64) -> oomguard::Result<()> {
    let d = ordinal(device)?;
    // SAFETY: plain values and the buffer from `call`.
    call(
        "CUDACachingAllocator::setMemoryFraction",
        |err, len| unsafe { shim::oomguard_tch_set_memory_fraction(d, fraction, err, len) },
    )
}

/// What libtorch's CUDA allocator is and how it is configured.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllocatorInfo {
    /// `CUDAAllocator::name()`: `"native"` (the caching allocator), `"cudaMallocAsync"`
    /// (`PYTORCH_ALLOC_CONF=backend:cudaMallocAsync`), or a pluggable allocator's.
    pub name: String,
    /// The allocator settings string libtorch last parsed (from `PYTORCH_ALLOC_CONF`, or its
    /// older name `PYTORCH_CUDA_ALLOC_CONF`); empty when none.
    pub settings: String,
    /// Whether expandable segments are on.
    pub expandable_segments: bool,
    /// Whether allocation history is being recorded; `None` when the allocator cannot tell.
    pub history_enabled: Option<bool>,
}

/// The allocator's name and configuration.
pub fn allocator_info() -> oomguard::Result<AllocatorInfo> {
    let mut raw = shim::RawAllocatorInfo {
        name: [0; 64],
        settings: [0; 512],
        expandable_segments: 0,
        history_enabled: -1,
    };
    // SAFETY: `raw` has the shim's `OomguardTchAllocatorInfo` layout (`repr(C)`, same fields);
    // the shim NUL-terminates both strings within their arrays.
    call("CUDAAllocator::name", |err, len| unsafe {
        shim::oomguard_tch_allocator_info(&mut raw, err, len)
    })?;
    Ok(AllocatorInfo {
        name: shim::fixed_str(&raw.name),
        settings: shim::fixed_str(&raw.settings),
        expandable_segments: raw.expandable_segments == 1,
        history_enabled: match raw.history_enabled {
            0 => Some(false),
            1 => Some(true),
            _ => None,
        },
    })
}
