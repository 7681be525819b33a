//! oomguard's caching allocator under every tch CUDA tensor, opt-in: [`install`], one call
//! before the first CUDA tensor.
//!
//! libtorch lets a program replace its CUDA allocator with a "pluggable" one
//! (`torch::cuda::CUDAPluggableAllocator`, exported by `libtorch_cuda`: the C++ side of
//! PyTorch's `torch.cuda.memory.change_current_allocator`). This crate's C++ shim
//! (`shim/pluggable.cpp`) makes one whose `malloc` / `free` go to an oomguard
//! [`oomguard::Device`] on the GPU, and installs it, as long as libtorch's own allocator is not
//! initialised yet (libtorch refuses to swap an initialised allocator: CUDA's initialisation,
//! by the first CUDA tensor, a CUDA seed, ..., initialises it).
//!
//! [`install`] proves it took effect: it makes and drops a tch CUDA tensor and checks that
//! oomguard served both calls (and that the shim's allocator is both libtorch's current CUDA
//! allocator and the one c10 has registered for CUDA). Otherwise it returns an error and puts
//! libtorch's own allocator back ([`InstallError::StillServing`] when memory it served is still
//! live). After install, tch's tensors are blocks of oomguard's allocator: budgets, leak checks,
//! peak scopes, statistics, `memory_summary`, snapshots, `empty_cache`, the retry engine and
//! `find_max_batch` see them through the returned `Device`. Configuration comes from
//! `OOMGUARD_ALLOC_CONF` as [`oomguard::Device::cuda`] reads it ([`install_with_config`] takes
//! one instead); `PYTORCH_ALLOC_CONF` / `PYTORCH_CUDA_ALLOC_CONF` no longer matter.
//!
//! What each libtorch call does once installed:
//! - `malloc(size, device, stream)`: oomguard's allocation on `stream`. libtorch's default
//!   stream (the legacy stream, handle 0) is oomguard's stream 0; any other stream (libtorch's
//!   pool streams, user streams) is a stream of its own. 0 bytes is a null pointer (as libtorch's
//!   allocator answers). Out of memory, a budget's or a memory fraction's included, is thrown as
//!   `c10::OutOfMemoryError` with a text that starts as libtorch's own ("CUDA out of memory.
//!   Tried to allocate 2.00 GiB. oomguard's allocator on GPU 0 refused 2147483648 bytes against
//!   a budget of 1073741824 bytes: ..."), so tch's `TchError::Torch` is an out-of-memory for
//!   [`oomguard::IsOom`] and for [`crate::tch_error_is_oom`], a budget's is a budget's
//!   (`is_budget_exceeded`: the retry engine skips the same-plan retry, which cannot help), and
//!   `oom_request` gives the request and its budget or capacity
//!   ([`oomguard::retry::libtorch_text_oom_request`]); [`take_last_error`] gives the oomguard
//!   error behind it (budget or device, with its figures). Another GPU than the installed one, and CUDA's per-thread
//!   default stream, are refused with a `c10::Error` naming them.
//! - `free(ptr, ...)`: back to oomguard's cache, on the allocation's stream (libtorch passes
//!   it). It cannot fail towards libtorch (it runs in a tensor's destructor): a pointer oomguard
//!   did not serve is logged as an error and counted ([`Counts::unknown_frees`]).
//! - `recordStream` (`Tensor::record_stream`): oomguard's `record_stream`: the block is reused
//!   only once the work queued on that stream by its free has completed.
//! - `emptyCache` (`c10::cuda::CUDACachingAllocator::emptyCache`, PyTorch's
//!   `torch.cuda.empty_cache`, for any memory pool): oomguard's `empty_cache`.
//! - `setMemoryFraction(f, device)`: oomguard's `set_memory_fraction(f)`.
//!
//! What libtorch's own statistics do under a pluggable allocator (libtorch 2.11's
//! `torch/csrc/cuda/CUDAPluggableAllocator.cpp`; its texts are in `libtorch_cuda.so`): they throw.
//! `getDeviceStats` (PyTorch's `memory_stats`, `memory_allocated`, `memory_reserved`),
//! `resetPeakStats`, `resetAccumulatedStats`, `snapshot`, `recordHistory`, `getMemoryFraction`,
//! `cacheInfo`, `attachOutOfMemoryObserver` and the checkpoint / IPC calls raise
//! "CUDAPluggableAllocator does not yet support ...". So do libtorch's allocator statistics read
//! through this crate's other shim functions. cuDNN convolutions whose workspace choice asks
//! `cacheInfo` for the largest free block (PyTorch's `Conv_v7.cpp` `getMaxWorkspaceSize` in
//! benchmark mode, `Conv_v8.cpp` `get_available_workspace`) throw the same way (not tried here).
//! With oomguard's allocator installed, read the statistics from the returned `Device` (`stats`,
//! `memory_summary`, `snapshot`), not from libtorch. libtorch's pluggable allocator also keeps its
//! own table of live pointers (a hash map insert and erase per allocation, under one mutex), beside
//! oomguard's.
//!
//! The shim also registers its allocator as c10's allocator for the CUDA device type
//! (`c10::SetAllocator`; `changeCurrentAllocator` alone leaves c10's registry on libtorch's
//! own), so `at::accelerator`'s memory calls and `c10::GetAllocator(kCUDA)` reach it too.
//!
//! Not supported under oomguard's allocator: CUDA graph capture (libtorch's graph memory pools:
//! the pluggable interface's `beginAllocateToPool` / `releasePool` are left unset, and an
//! allocation during a capture would reach oomguard, which may map pages or synchronise),
//! cuDNN convolutions that ask `cacheInfo` (above), libtorch's IPC sharing of CUDA tensors, and a second GPU in
//! the process (its allocations are refused by name).
//!
//! What stays outside oomguard (GPU memory it does not see): the CUDA context, loaded kernels,
//! cuBLAS / cuDNN handles, libtorch's pinned host memory, and NCCL's buffers. cuBLAS's
//! workspace is allocated through the current CUDA allocator (libtorch's
//! `allocateCUDABlasWorkspace`), so it is an oomguard block, live for as long as libtorch keeps
//! the handle (the process, in practice): a leak check opened before the first matmul sees it.
//!
//! ```no_run
//! use tch::{Device, Kind, Tensor};
//! // first, before any CUDA tensor:
//! let og: oomguard::Device = oomguard_tch::allocator::install(0)?;
//! let _x = Tensor::zeros([1024, 1024], (Kind::Float, Device::Cuda(0)));
//! assert!(og.stats().allocated_bytes.all.current >= 4 << 20);
//! # Ok::<(), oomguard_tch::allocator::InstallError>(())
//! ```

mod ffi;
mod served;

use std::sync::{Arc, Mutex, PoisonError};

pub use served::Counts;
use served::Served;

/// Why [`install`] did not install oomguard's allocator. After every error but
/// [`InstallError::StillServing`], libtorch's own allocator is its CUDA allocator.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InstallError {
    /// No CUDA here: this build of the shim has no CUDA, libtorch sees no CUDA device (no driver,
    /// no GPU), or not the one asked for.
    #[error("oomguard's allocator cannot be installed under libtorch: {0}")]
    NoCuda(String),
    /// libtorch's CUDA allocator is initialised already: install must come before CUDA is
    /// initialised (the first CUDA tensor, a CUDA seed, ...).
    #[error(
        "oomguard's allocator must be installed before CUDA is initialised: {0}; call \
         oomguard_tch::allocator::install first thing in the program"
    )]
    TooLate(String),
    /// oomguard's allocator is installed already (the device serving it is given).
    #[error("{}", SITE.already_installed(.0))]
    AlreadyInstalled(oomguard::Device),
    /// Opening oomguard's device on the GPU failed (driver, `OOMGUARD_ALLOC_CONF`).
    #[error("{}", SITE.device_failed(.0))]
    Device(#[source] oomguard::Error),
    /// tch failed while install proved the allocator (making its probe tensor).
    #[error("tch failed while proving oomguard's allocator: {0}")]
    Torch(#[source] tch::TchError),
    /// The probe tensor's allocation or free did not reach oomguard.
    #[error("oomguard's allocator was installed but libtorch did not use it: {0}")]
    NotServed(String),
    /// libtorch refused the swap for another reason (its message).
    #[error("libtorch refused oomguard's allocator: {0}")]
    Libtorch(String),
    /// Install failed (`cause`) after oomguard had started serving libtorch, and memory it
    /// served is still live (or libtorch's allocator could not be put back): oomguard keeps
    /// serving libtorch with `device` (what [`installed_device`] returns).
    #[error("{}", SITE.still_serving(.cause, .device))]
    StillServing {
        /// Why install failed.
        #[source]
        cause: Box<InstallError>,
        /// The device that keeps serving libtorch.
        device: oomguard::Device,
    },
}

/// How [`InstallError`]'s texts name this allocator (written once in the core, as
/// oomguard-candle's).
const SITE: oomguard::source::InstallSite = oomguard::source::InstallSite {
    serves: "libtorch as its CUDA allocator",
    module: "oomguard_tch::allocator",
    still_serving: "memory it served is still live, or libtorch's allocator could not be put back",
};

/// Installs oomguard's allocator as libtorch's CUDA allocator, serving GPU `ordinal`,
/// configured from `OOMGUARD_ALLOC_CONF` as [`oomguard::Device::cuda`] is, and returns the
/// oomguard `Device` that then serves every CUDA tensor tch makes. Call it before anything
/// initialises CUDA in libtorch (the first CUDA tensor). See the [module docs](self) for what it
/// proves, what each libtorch call does, and what libtorch's own statistics do afterwards.
pub fn install(ordinal: usize) -> Result<oomguard::Device, InstallError> {
    install_inner(ordinal, None)
}

/// [`install`] with an explicit allocator configuration (`OOMGUARD_ALLOC_CONF` is not read).
pub fn install_with_config(
    ordinal: usize,
    config: oomguard::AllocatorConfig,
) -> Result<oomguard::Device, InstallError> {
    install_inner(ordinal, Some(config))
}

/// The oomguard `Device` serving libtorch's CUDA tensors, when [`install`] installed one.
pub fn installed_device() -> Option<oomguard::Device> {
    ffi::served().map(|s| s.device.clone())
}

/// What oomguard's allocator did for libtorch so far (all zero before [`install`]).
pub fn counts() -> Counts {
    ffi::served().map(|s| s.counts()).unwrap_or_default()
}

/// The oomguard error behind the calling thread's last allocation that oomguard refused
/// libtorch (tch returned it as an out-of-memory or another `TchError`), taken: a second call
/// returns `None`. Tells a budget of oomguard's from the device running out, with the figures.
pub fn take_last_error() -> Option<oomguard::Error> {
    served::take_last_error()
}

/// Serialises installs.
static INSTALLING: Mutex<()> = Mutex::new(());

fn install_inner(
    ordinal: usize,
    config: Option<oomguard::AllocatorConfig>,
) -> Result<oomguard::Device, InstallError> {
    let _one = INSTALLING.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(s) = ffi::served() {
        return Err(InstallError::AlreadyInstalled(s.device.clone()));
    }
    match ffi::allocator_state() {
        Err(why) => return Err(InstallError::NoCuda(why)),
        Ok((true, name)) => {
            return Err(InstallError::TooLate(format!(
                "libtorch's CUDA allocator (\"{name}\") is initialised already"
            )))
        }
        Ok((false, _)) => {}
    }
    let count = tch::Cuda::device_count();
    if count <= 0 {
        return Err(InstallError::NoCuda(
            "libtorch sees no CUDA device (no NVIDIA driver, or no GPU)".into(),
        ));
    }
    if ordinal as i64 >= count {
        return Err(InstallError::NoCuda(format!(
            "there is no GPU {ordinal}: libtorch sees {count}"
        )));
    }
    let dev = match config {
        Some(c) => oomguard::Device::cuda_with_config(ordinal, c),
        None => oomguard::Device::cuda(ordinal),
    }
    .map_err(InstallError::Device)?;
    let served = Arc::new(Served::new(ordinal, dev.clone()));
    ffi::set_served(Some(Arc::clone(&served)));
    if let Err((code, why)) = ffi::install() {
        ffi::set_served(None);
        return Err(match code {
            ffi::code::TOO_LATE => InstallError::TooLate(why),
            ffi::code::NO_CUDA => InstallError::NoCuda(why),
            _ => InstallError::Libtorch(why),
        });
    }
    // The proof: a tch CUDA tensor made and dropped must reach oomguard.
    let before = served.counts();
    let probe = tch::Tensor::f_zeros([1024], (tch::Kind::Float, tch::Device::Cuda(ordinal)));
    let probe = match probe {
        Ok(t) => t,
        Err(e) => return Err(abandon(&served, InstallError::Torch(e))),
    };
    let allocated = served.counts().served_allocs > before.served_allocs;
    drop(probe);
    let freed = served.counts().served_frees > before.served_frees;
    let current = ffi::is_current();
    if !(allocated && freed && current) {
        return Err(abandon(
            &served,
            InstallError::NotServed(format!(
                "a 4 KiB tch tensor on GPU {ordinal} was {} and {} by oomguard, and the shim's \
                 allocator is {}libtorch's current CUDA allocator",
                if allocated {
                    "allocated"
                } else {
                    "not allocated"
                },
                if freed { "freed" } else { "not freed" },
                if current { "" } else { "not " },
            )),
        ));
    }
    Ok(dev)
}

/// A failed install after the swap: puts libtorch's allocator back when nothing oomguard served
/// is live; otherwise keeps serving and says so.
fn abandon(served: &Arc<Served>, cause: InstallError) -> InstallError {
    let still = |cause| InstallError::StillServing {
        cause: Box::new(cause),
        device: served.device.clone(),
    };
    if served.counts().live != 0 {
        return still(cause);
    }
    match ffi::uninstall() {
        Ok(()) => {
            ffi::set_served(None);
            cause
        }
        Err((_, why)) => still(InstallError::Libtorch(format!(
            "{cause}; putting libtorch's allocator back failed: {why}"
        ))),
    }
}
