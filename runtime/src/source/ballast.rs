//! A ballast: device memory taken from the driver outside every pool and allocator, so that only
//! a given amount of the device stays free. It caps an allocator that oomguard cannot configure
//! (cubecl's pools, which fall back from the driver pool to `cuMemAlloc`): whatever it asks the
//! driver for comes out of what the ballast left.

#![allow(unsafe_code)] // FFI: the two unsafe blocks allocate and free through the driver and say why

use std::sync::Arc;

use cudarc::driver::sys::{CUdeviceptr, CUresult};
use cudarc::driver::{result, CudaContext};

use crate::backend::cuda::direct;
use crate::{ByteSize, Error, Result};

/// The driver hands out memory in pages of this size; the ballast takes whole pages, so up to
/// this much more than asked may stay free.
pub const BALLAST_PAGE: u64 = 2 << 20;

/// When one allocation of the whole amount fails, the ballast tries again this much smaller.
const STEP: u64 = 64 << 20;

/// Rounds of measuring the free memory and taking more: other work on the device may free or
/// allocate between them.
const ROUNDS: usize = 8;

/// Device memory held outside every allocator and pool (`cuMemAlloc_v2`, through the driver
/// library's handle, so no hook sees it), so that about `room` bytes of the device stay free.
/// Freed when dropped.
///
/// It caps the *device's* free memory, not one allocator: everything in this process that
/// allocates afterwards (kernels loaded, library workspaces) draws from the same room, other
/// processes that free memory widen it and those that allocate narrow it.
#[derive(Debug)]
pub struct Ballast {
    ctx: Arc<CudaContext>,
    blocks: Vec<(CUdeviceptr, u64)>,
}

impl Ballast {
    /// Takes the device's free memory (of `ctx`'s device) except `room` bytes, in whole pages of
    /// [`BALLAST_PAGE`]: afterwards between `room` and `room + BALLAST_PAGE` bytes are free, unless
    /// less than `room` was free to begin with (then it takes nothing). Fails when the driver
    /// cannot be reached, or when the free memory could not be brought within a page of `room`.
    pub fn leave_free(ctx: &Arc<CudaContext>, room: u64) -> Result<Self> {
        direct::available().map_err(|e| Error::InvalidArgument(format!("ballast: {e}")))?;
        let mut ballast = Ballast {
            ctx: Arc::clone(ctx),
            blocks: Vec::new(),
        };
        for _ in 0..ROUNDS {
            let free = ballast.free()?;
            let mut want = free.saturating_sub(room) / BALLAST_PAGE * BALLAST_PAGE;
            if want == 0 {
                return Ok(ballast);
            }
            // The largest single allocation may fall short of the free total: step down, and
            // take the rest in the next round.
            loop {
                match ballast.take(want) {
                    Ok(()) => break,
                    Err(CUresult::CUDA_ERROR_OUT_OF_MEMORY) if want > STEP => want -= STEP,
                    Err(CUresult::CUDA_ERROR_OUT_OF_MEMORY) => break,
                    Err(e) => {
                        return Err(Error::InvalidArgument(format!(
                            "ballast: cuMemAlloc_v2 of {} failed: {e:?}",
                            ByteSize(want)
                        )))
                    }
                }
            }
        }
        let free = ballast.free()?;
        if free >= room + BALLAST_PAGE {
            return Err(Error::InvalidArgument(format!(
                "ballast: {} of the device is still free after taking {} in {} blocks (wanted \
                 {} free): the driver would not hand out the rest",
                ByteSize(free),
                ByteSize(ballast.bytes()),
                ballast.blocks.len(),
                ByteSize(room)
            )));
        }
        Ok(ballast)
    }

    /// Bytes the ballast holds.
    pub fn bytes(&self) -> u64 {
        self.blocks.iter().map(|&(_, n)| n).sum()
    }

    /// The device's free memory now (`cuMemGetInfo`).
    pub fn free(&self) -> Result<u64> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| Error::InvalidArgument(format!("ballast: cuCtxSetCurrent: {e}")))?;
        let (free, _) = result::mem_get_info()
            .map_err(|e| Error::InvalidArgument(format!("ballast: cuMemGetInfo: {e}")))?;
        Ok(free as u64)
    }

    fn take(&mut self, bytes: u64) -> std::result::Result<(), CUresult> {
        self.ctx
            .bind_to_thread()
            .map_err(|_| CUresult::CUDA_ERROR_INVALID_CONTEXT)?;
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: `ptr` is valid for one write and the context is current (bound above).
        let status = unsafe { direct::mem_alloc(&mut ptr, bytes as usize) };
        if status != CUresult::CUDA_SUCCESS {
            return Err(status);
        }
        self.blocks.push((ptr, bytes));
        Ok(())
    }
}

impl Drop for Ballast {
    fn drop(&mut self) {
        if self.blocks.is_empty() {
            return;
        }
        if let Err(e) = self.ctx.bind_to_thread() {
            tracing::error!(error = %e, "ballast: cuCtxSetCurrent failed; its memory stays taken");
            return;
        }
        for (ptr, bytes) in self.blocks.drain(..) {
            // SAFETY: `ptr` came from cuMemAlloc_v2 in this context and is freed once (drained).
            let status = unsafe { direct::mem_free(ptr) };
            if status != CUresult::CUDA_SUCCESS {
                tracing::error!(?status, bytes, "ballast: cuMemFree_v2 failed");
            }
        }
    }
}
