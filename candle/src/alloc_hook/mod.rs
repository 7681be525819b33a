//! oomguard's caching allocator under candle's CUDA tensors, with no change to candle or cudarc
//! (feature `allocator-hook`, off by default; [`install`] is the entry point).
//!
//! candle allocates every CUDA tensor through cudarc, which calls the driver's
//! `cuMemAllocAsync` / `cuMemFreeAsync` (or `cuMemAlloc_v2` / `cuMemFree_v2` on a device without
//! memory pools). candle-core turns on cudarc's `dynamic-linking`, in which those calls are bound
//! by the linker; with this feature, this crate defines the four symbols, so the linker binds
//! cudarc's calls to oomguard instead of to `libcuda.so`.
//!
//! - **Nothing changes until [`install`]**: every hooked call goes straight to the driver
//!   (through its library handle) until a device is installed, and afterwards for every context
//!   that is not installed.
//! - [`install`] (or [`install_with_config`]; both need the feature) opens an oomguard
//!   [`oomguard::Device`] on the candle device's GPU (configuration from `OOMGUARD_ALLOC_CONF`
//!   in PyTorch's syntax, as `Device::cuda`; memory limit with `per_process_memory_fraction` or
//!   `Device::allocator().set_memory_limit`), makes it the memory source of that candle device
//!   ([`crate::memory_source`] returns it from then on), and proves it: it makes and drops a
//!   candle tensor and checks that oomguard served both calls. When it cannot (a build in which
//!   cudarc resolves the driver with `dlsym`: cudarc's `dynamic-loading` mode, as in a build
//!   without candle-core's `cuda` feature; another definition of the symbols winning the link),
//!   it returns [`InstallError::NotIntercepted`] and leaves nothing installed; when memory it
//!   served meanwhile is still live, it says so ([`InstallError::StillServing`]) and keeps
//!   serving that context.
//! - After install, candle's tensors are blocks of oomguard's allocator: budgets, leak checks,
//!   peak scopes, statistics, `memory_summary`, history and snapshots, `empty_cache`, the retry
//!   engine and `find_max_batch` see them through the returned `Device`.
//!
//! What the hook does with each call, on an installed context:
//! - `cuMemAllocAsync(n, stream)`: served by the allocator on `stream`. The legacy default
//!   stream (0 and `CU_STREAM_LEGACY`) is one stream; the per-thread default stream (handle
//!   `0x2`, candle's default, the same value on every thread) is a separate stream for each
//!   thread, so a block freed in one thread's stream order is never handed to another thread's
//!   work before that work's stream has passed the free; other handles are their own stream.
//! - `cuMemFreeAsync(p, stream)`: a pointer oomguard made goes back to its cache (also when the
//!   free comes from inside the hook, e.g. a tensor dropped in an OOM observer); when `stream`
//!   is not the stream it was allocated on (a tensor dropped on another thread), the block is
//!   reused only after the work queued on `stream` by then has finished (an event, PyTorch's
//!   `record_stream`). Pointers oomguard did not make (allocated before install, by a context
//!   that is not installed, during graph capture, from inside the hook) go to the driver.
//! - `cuMemAlloc_v2`: served on the legacy default stream, in a pool of its own;
//!   `cuMemFree_v2`: the block is reused only after an event on the legacy default stream
//!   (recorded at the free) has completed.
//! - **Graph capture**: while a graph is being captured on the request's stream or on any
//!   blocking stream of the context (the driver's answer for the legacy stream), allocations go
//!   to the driver (the graph's memory nodes, never blocks of the cache, and nothing of
//!   oomguard's runs that would break a capture: no page mapping, synchronization or segment
//!   free). A block of oomguard's freed on the capturing stream (or on the legacy stream, by
//!   `cuMemFree_v2`) then is kept out of reuse for the rest of the process (a replay of the
//!   graph may still use it; no event can be recorded on a capturing stream):
//!   [`HookCounts::held_after_capture`] counts them. One freed on another stream, which does not
//!   capture, gets an event there and goes back to the cache at a call made after the capture,
//!   once that event is done ([`HookCounts::waiting_for_capture_end`]). A capture in global
//!   mode on a
//!   *non-blocking* stream of another thread cannot be seen: capture such streams in
//!   thread-local or relaxed mode (`CU_STREAM_CAPTURE_MODE_THREAD_LOCAL`) while other threads
//!   allocate.
//! - **Threads that exit**: each thread's per-thread stream id is retired when the thread
//!   exits, with an event on its stream; once that event has completed, a new thread takes over
//!   the id and the blocks cached for it, so a pool of threads that come and go holds at most
//!   the memory of its most threads alive at once (released, as every cached block, on
//!   out-of-memory and by `empty_cache`).
//! - Passed to the driver unchanged: zero-byte requests (the driver's own answer), requests
//!   made from inside the hook, and calls on a context with no installed device.
//! - Pointers are aligned to 512 bytes (the driver guarantees 256).
//! - Out of memory (and a budget of oomguard's that is exceeded) is answered
//!   `CUDA_ERROR_OUT_OF_MEMORY`, so candle's error and its classification ([`oomguard::IsOom`],
//!   [`crate::train_step`]) are unchanged; another driver failure inside oomguard keeps the
//!   driver's code; [`take_last_error`] gives the oomguard error behind the calling thread's
//!   last failed allocation (budget or device, with its figures).
//! - **cuBLAS's workspace** comes from oomguard: install gives candle's cuBLAS handle a block of
//!   [`CUBLAS_WORKSPACE_BYTES`] (`cublasSetWorkspace`), held for the rest of the process.
//!
//! What stays outside (memory on the GPU the hook does not see): cuBLAS's handles, the CUDA
//! context itself, loaded kernels, candle-kernels' host code that calls the runtime's
//! `cudaMallocAsync` (the runtime resolves the driver through `cuGetProcAddress`, not the
//! linker), and anything allocated before install. See the repository README's section
//! "oomguard's allocator under candle's tensors (feature `allocator-hook`)" for figures measured
//! on an H100.
//!
//! Leak reports name the allocating site as the hook itself (candle's call stack is not known
//! to the allocator); `Device::allocator().record_history_with` with full backtraces records
//! candle's stack for every allocation.

// The logic is built (and tested on the simulated device) without the feature too.
mod codes;
#[cfg_attr(not(feature = "allocator-hook"), allow(dead_code))]
mod interposer;
#[cfg(feature = "allocator-hook")]
mod symbols;
#[cfg(test)]
mod tests;

pub use interposer::Counts as HookCounts;

/// Why [`install`] did not install oomguard's allocator. After every error but
/// [`InstallError::StillServing`] nothing is installed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InstallError {
    /// The candle device is not a CUDA device.
    #[error("oomguard's allocator can only be installed for a CUDA device, not {0}")]
    NotCuda(String),
    /// This program's calls to the driver do not reach the hook, so oomguard cannot serve them.
    #[error("oomguard's allocator hook is not reached by this program's CUDA calls: {reason}")]
    NotIntercepted {
        /// What was seen, and what to do.
        reason: String,
    },
    /// A device is installed for this GPU already (the one serving it is given).
    #[error("{}", SITE.already_installed(.0))]
    AlreadyInstalled(oomguard::Device),
    /// Opening oomguard's device on the GPU failed (driver, configuration), or giving candle's
    /// cuBLAS handle its workspace did.
    #[error("{}", SITE.device_failed(.0))]
    Device(#[source] oomguard::Error),
    /// candle failed while install proved the hook (allocating its probe tensor).
    #[error("candle failed while proving the hook: {0}")]
    Candle(#[source] candle_core::Error),
    /// Install failed (`cause`) after oomguard had started serving the context, and memory it
    /// served meanwhile (another thread's tensors) is still live: oomguard keeps serving the
    /// context with `device` (what [`installed_device`] returns), so that this memory stays
    /// valid and its frees come back to oomguard.
    #[error("{}", SITE.still_serving(.cause, .device))]
    StillServing {
        /// Why install failed.
        #[source]
        cause: Box<InstallError>,
        /// The device that keeps serving the context.
        device: oomguard::Device,
    },
}

/// How [`InstallError`]'s texts name this hook (written once in the core, as oomguard-tch's).
const SITE: oomguard::source::InstallSite = oomguard::source::InstallSite {
    serves: "candle's CUDA context",
    module: "oomguard_candle::alloc_hook",
    still_serving: "memory it served meanwhile is still live",
};

/// A failed install after `serve`: stops serving `ctx` when nothing served is live and no
/// thread is inside a served call; otherwise keeps serving it and says so.
#[cfg_attr(not(feature = "allocator-hook"), allow(dead_code))]
fn abandon<D: interposer::Driver>(
    hook: &interposer::Interposer<D>,
    ctx: u64,
    cause: InstallError,
) -> InstallError {
    if hook.unserve_if_idle(ctx) {
        return cause;
    }
    match hook.served(ctx) {
        Some(s) => InstallError::StillServing {
            cause: Box::new(cause),
            device: s.device.clone(),
        },
        None => cause, // unserved meanwhile by nobody else: install is the only caller
    }
}

/// Installs oomguard's allocator for `device`'s GPU (feature `allocator-hook`), configured from
/// `OOMGUARD_ALLOC_CONF` as `oomguard::Device::cuda` is, and returns the oomguard `Device`
/// that then serves every allocation candle (or anything on cudarc) makes on that GPU's
/// context. See the [module docs](self) for what it proves and what it cannot see.
///
/// ```ignore
/// let dev = candle_core::Device::new_cuda(0)?;
/// let og: oomguard::Device = oomguard_candle::alloc_hook::install(&dev)?;
/// ```
///
/// Without the feature, this page exists for the documentation only: the function is not
/// compiled.
#[cfg(any(doc, feature = "allocator-hook"))]
pub fn install(device: &candle_core::Device) -> Result<oomguard::Device, InstallError> {
    imp::install_inner(device, None)
}

/// [`install`] with an explicit allocator configuration (the environment is not read; feature
/// `allocator-hook`).
#[cfg(any(doc, feature = "allocator-hook"))]
pub fn install_with_config(
    device: &candle_core::Device,
    config: oomguard::AllocatorConfig,
) -> Result<oomguard::Device, InstallError> {
    imp::install_inner(device, Some(config))
}

/// The oomguard `Device` serving `device`'s GPU, when [`install`] installed one (feature
/// `allocator-hook`).
#[cfg(any(doc, feature = "allocator-hook"))]
pub fn installed_device(device: &candle_core::Device) -> Option<oomguard::Device> {
    imp::installed_device(device)
}

/// What the hook did so far (all zero before [`install`]; feature `allocator-hook`).
#[cfg(any(doc, feature = "allocator-hook"))]
pub fn counts() -> HookCounts {
    imp::counts()
}

/// The oomguard error behind the calling thread's last hooked allocation that failed (it was
/// answered `CUDA_ERROR_OUT_OF_MEMORY` or another driver status), taken: a second call returns
/// `None`. Tells a budget of oomguard's from the device running out, with the figures.
pub fn take_last_error() -> Option<oomguard::Error> {
    interposer::take_last_error()
}

/// The cuBLAS workspace given to candle's cuBLAS handle at install: 32 MiB, cuBLAS's recommended
/// size on Hopper (`cublasSetWorkspace`; 4 MiB on older GPUs).
pub const CUBLAS_WORKSPACE_BYTES: u64 = 32 << 20;

/// The documentation build without the feature: the entry points have pages, no body runs.
#[cfg(all(doc, not(feature = "allocator-hook")))]
mod imp {
    use super::{HookCounts, InstallError};

    fn missing() -> String {
        "oomguard-candle was built without its `allocator-hook` feature".into()
    }
    pub(super) fn install_inner(
        _: &candle_core::Device,
        _: Option<oomguard::AllocatorConfig>,
    ) -> Result<oomguard::Device, InstallError> {
        Err(InstallError::NotIntercepted { reason: missing() })
    }
    pub(super) fn installed_device(_: &candle_core::Device) -> Option<oomguard::Device> {
        None
    }
    pub(super) fn counts() -> HookCounts {
        HookCounts::default()
    }
}

#[cfg(feature = "allocator-hook")]
mod imp {
    use super::CUBLAS_WORKSPACE_BYTES;
    use super::{abandon, interposer, not_intercepted, symbols, HookCounts, InstallError};

    pub(super) fn installed_device(device: &candle_core::Device) -> Option<oomguard::Device> {
        let ctx = context_of(device).ok()?;
        symbols::HOOK.get()?.served(ctx).map(|s| s.device.clone())
    }

    pub(super) fn counts() -> HookCounts {
        symbols::HOOK
            .get()
            .map(interposer::Interposer::counts)
            .unwrap_or_default()
    }

    fn context_of(device: &candle_core::Device) -> Result<u64, InstallError> {
        match device {
            candle_core::Device::Cuda(d) => Ok(d.cuda_stream().context().cu_ctx() as usize as u64),
            other => Err(InstallError::NotCuda(format!("{other:?}"))),
        }
    }

    /// Gives candle's cuBLAS handle a workspace from oomguard's allocator, so that cuBLAS does not
    /// take its own from the driver for the handle's calls. The block stays allocated for the rest
    /// of the process (the handle may use it until it is destroyed, which oomguard cannot see).
    #[allow(unsafe_code)]
    fn set_cublas_workspace(
        cuda: &candle_core::CudaDevice,
        dev: &oomguard::Device,
    ) -> Result<(), InstallError> {
        use oomguard::cudarc::cublas::sys;
        let ws = dev
            .alloc_raw(CUBLAS_WORKSPACE_BYTES, 0)
            .map_err(InstallError::Device)?;
        let blas = cuda.cublas_handle();
        // SAFETY: the handle is candle's live cuBLAS handle (kept alive by `blas` here and by the
        // candle device afterwards); the workspace is a block of CUBLAS_WORKSPACE_BYTES on its GPU
        // that is never freed (the handle can use it for as long as it lives) and is 512-byte
        // aligned (cuBLAS needs 256).
        let status = unsafe {
            sys::cublasSetWorkspace_v2(
                *blas.handle(),
                ws.ptr as usize as *mut std::ffi::c_void,
                CUBLAS_WORKSPACE_BYTES as usize,
            )
        };
        if status != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            let _ = dev.free_raw(ws);
            return Err(InstallError::Device(oomguard::Error::InvalidArgument(
                format!("cublasSetWorkspace_v2 on candle's cuBLAS handle failed ({status:?})"),
            )));
        }
        Ok(())
    }

    pub(super) fn install_inner(
        device: &candle_core::Device,
        config: Option<oomguard::AllocatorConfig>,
    ) -> Result<oomguard::Device, InstallError> {
        use std::sync::atomic::Ordering::Relaxed;

        let ctx = context_of(device)?;
        let candle_core::Device::Cuda(cuda) = device else {
            unreachable!("context_of accepts CUDA devices only");
        };
        // Keep the definitions linked (see `symbols::definitions`).
        std::hint::black_box(symbols::definitions());
        oomguard::backend::cuda::direct::available().map_err(|e| InstallError::NotIntercepted {
            reason: format!("the driver's entry points cannot be reached: {e}"),
        })?;
        let hook = symbols::HOOK.get_or_init(|| interposer::Interposer::new(symbols::RealDriver));
        if let Some(s) = hook.served(ctx) {
            return Err(InstallError::AlreadyInstalled(s.device.clone()));
        }
        let ordinal = cuda.cuda_stream().context().ordinal();
        let dev = match config {
            Some(c) => oomguard::Device::cuda_with_config(ordinal, c),
            None => oomguard::Device::cuda(ordinal),
        }
        .map_err(InstallError::Device)?;
        let own_ctx = dev.cuda_context().map_err(InstallError::Device)?.cu_ctx() as usize as u64;
        if own_ctx != ctx {
            return Err(InstallError::NotIntercepted {
                reason: format!(
                    "candle's device uses a CUDA context ({ctx:#x}) that is not the primary \
                     context of GPU {ordinal} ({own_ctx:#x}); only devices on the primary context \
                     (candle's Device::new_cuda) can be served"
                ),
            });
        }
        let served = hook
            .serve(ctx, dev.clone())
            .map_err(|s| InstallError::AlreadyInstalled(s.device.clone()))?;
        // The proof: a tensor made and dropped through candle must reach oomguard.
        let (allocs, frees) = (served.allocs.load(Relaxed), served.frees.load(Relaxed));
        let probe = candle_core::Tensor::zeros(1024, candle_core::DType::F32, device)
            .and_then(|t| device.synchronize().map(|()| t));
        let probe = match probe {
            Ok(t) => t,
            Err(e) => return Err(abandon(hook, ctx, InstallError::Candle(e))),
        };
        let allocated = served.allocs.load(Relaxed) > allocs;
        drop(probe);
        let freed = served.frees.load(Relaxed) > frees;
        if !(allocated && freed) {
            return Err(abandon(hook, ctx, not_intercepted(allocated, freed)));
        }
        if let Err(e) = set_cublas_workspace(cuda, &dev) {
            return Err(abandon(hook, ctx, e));
        }
        Ok(dev)
    }
}

/// The error of an install whose proof failed: the probe tensor's allocation and free did not
/// both reach oomguard. Says what was seen, why it happens and what to build instead.
#[cfg_attr(not(feature = "allocator-hook"), allow(dead_code))]
fn not_intercepted(allocated: bool, freed: bool) -> InstallError {
    InstallError::NotIntercepted {
        reason: format!(
            "a candle tensor was {} and {} through oomguard. This happens when cudarc resolves \
             the driver with dlsym (its `dynamic-loading` feature: a build without candle-core's \
             `cuda` feature, or with cudarc's `fallback-dynamic-loading` winning), or when \
             another crate defines cuMemAllocAsync/cuMemFreeAsync as well. Build with \
             candle-core's `cuda` feature (which turns on cudarc's `dynamic-linking`) and \
             oomguard-candle's `allocator-hook`, and link no other definition of these symbols",
            if allocated {
                "allocated"
            } else {
                "not allocated"
            },
            if freed { "freed" } else { "not freed" },
        ),
    }
}
