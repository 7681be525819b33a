//! [`IsOom`] for `candle_core::Error` (feature `candle`).
//!
//! candle reports a CUDA failure as `Error::Cuda(Box<dyn Error>)`, `#[error(transparent)]`, so a
//! `source()` walk never reaches the driver's error: the box is downcast instead. Inside it:
//! candle's `CudaError::Cuda(DriverError)` (`CUDA_ERROR_OUT_OF_MEMORY` from `cuMemAllocAsync`),
//! `CudaError::Cublas(CUBLAS_STATUS_ALLOC_FAILED)` and `CudaError::Load { cuda, .. }` (feature
//! `candle-cuda`, which names candle's CUDA types), or a cudarc / oomguard error boxed directly.
//! The wrappers candle adds on the way up (`WithBacktrace`, `Context`, `WithPath`,
//! `WrappedContext`) are unwrapped. No message text is ever matched.

use std::error::Error as StdError;

use super::classify::{chain_is_budget, chain_is_oom, chain_oom_in_use, chain_oom_request};
use super::IsOom;
use crate::retry_report::OomRequest;

impl IsOom for candle_core::Error {
    fn is_oom(&self) -> bool {
        candle_is_oom(self, 0)
    }
    /// A memory budget's out-of-memory (oomguard's `BudgetExceeded`) carried inside the error:
    /// the retry engine then skips the same-plan retry, as for oomguard's own errors.
    fn is_budget_exceeded(&self) -> bool {
        candle_find(self, 0, &|e| chain_is_budget(e).then_some(())).is_some()
    }
    /// The failed request and its capacity of an oomguard out-of-memory carried inside the
    /// error (candle's own CUDA errors do not say what was requested: `None`).
    fn oom_request(&self) -> Option<OomRequest> {
        candle_find(self, 0, &chain_oom_request)
    }
    /// The bytes in use when an oomguard out-of-memory carried inside the error failed.
    fn oom_in_use(&self) -> Option<u64> {
        candle_find(self, 0, &chain_oom_in_use)
    }
}

/// [`candle_is_oom`]'s walk, for what `find` answers of an oomguard error inside (a budget's
/// out-of-memory, the request that failed: candle's own CUDA errors carry neither).
fn candle_find<T>(
    e: &candle_core::Error,
    depth: usize,
    find: &dyn Fn(&(dyn StdError + 'static)) -> Option<T>,
) -> Option<T> {
    use candle_core::Error as E;
    if depth > 64 {
        return None;
    }
    let boxed = |b: &(dyn StdError + Send + Sync + 'static)| match b.downcast_ref::<E>() {
        Some(inner) => candle_find(inner, depth + 1, find),
        None => find(b),
    };
    match e {
        E::Cuda(b) | E::WrappedContext { wrapped: b, .. } => boxed(b.as_ref()),
        E::WithBacktrace { inner, .. } | E::Context { inner, .. } | E::WithPath { inner, .. } => {
            candle_find(inner, depth + 1, find)
        }
        other => other.source().and_then(find),
    }
}

fn candle_is_oom(e: &candle_core::Error, depth: usize) -> bool {
    use candle_core::Error as E;
    if depth > 64 {
        return false;
    }
    match e {
        E::Cuda(boxed) => {
            let oom = boxed_is_oom(boxed.as_ref());
            #[cfg(not(feature = "candle-cuda"))]
            if !oom && !boxed.is::<candle_core::Error>() {
                warn_unclassified();
            }
            oom
        }
        E::WithBacktrace { inner, .. } | E::Context { inner, .. } | E::WithPath { inner, .. } => {
            candle_is_oom(inner, depth + 1)
        }
        E::WrappedContext { wrapped, .. } => boxed_is_oom(wrapped.as_ref()),
        // Every other variant is about shapes, dtypes, files or user messages; a source chain
        // (e.g. an io::Error holding an oomguard error) is still followed.
        other => other.source().is_some_and(chain_is_oom),
    }
}

/// Without `candle-cuda`, candle's own `CudaError` cannot be named, so a CUDA OOM inside it is
/// not recognised: say so once instead of failing silently.
#[cfg(not(feature = "candle-cuda"))]
fn warn_unclassified() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let msg = "oomguard: a candle CUDA error could not be classified (out-of-memory or not): \
                   enable oomguard's `candle-cuda` feature (oomguard-candle's `cuda` feature does)";
        tracing::warn!(target: "oomguard::retry", "{msg}");
        eprintln!("{msg}");
    });
}

fn boxed_is_oom(e: &(dyn StdError + Send + Sync + 'static)) -> bool {
    #[cfg(feature = "candle-cuda")]
    if let Some(c) = e.downcast_ref::<candle_core::cuda_backend::CudaError>() {
        use candle_core::cuda_backend::CudaError as C;
        return match c {
            C::Cuda(d) | C::Load { cuda: d, .. } => IsOom::is_oom(d),
            C::Cublas(b) => IsOom::is_oom(b),
            _ => false,
        };
    }
    if let Some(inner) = e.downcast_ref::<candle_core::Error>() {
        return candle_is_oom(inner, 1);
    }
    chain_is_oom(e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ByteSize, Device};

    fn oom() -> crate::Error {
        Device::sim(ByteSize::mib(1))
            .alloc::<u8>(2 << 20)
            .unwrap_err()
    }

    #[test]
    fn boxed_and_wrapped_ooms_are_found() {
        let e = candle_core::Error::Cuda(Box::new(oom()));
        assert!(e.is_oom());
        let e = candle_core::Error::Cuda(Box::new(oom())).context("layer 3");
        assert!(e.is_oom());
        let e = candle_core::Error::Cuda(Box::new(oom())).with_path("/tmp/x");
        assert!(e.is_oom());
        let e = candle_core::Error::WithBacktrace {
            inner: Box::new(candle_core::Error::Cuda(Box::new(oom()))),
            backtrace: Box::new(std::backtrace::Backtrace::capture()),
        };
        assert!(e.is_oom());
        let e = candle_core::Error::Io(std::io::Error::other(oom()));
        assert!(e.is_oom(), "an OOM inside an io::Error is followed");
    }

    #[test]
    fn a_budget_inside_a_candle_error_stays_a_budget() {
        let dev = Device::sim(ByteSize::mib(64));
        let _b = dev.thread_budget(1 << 20);
        let budget = dev.alloc::<u8>(2 << 20).unwrap_err();
        assert!(budget.is_budget_exceeded());
        let e = candle_core::Error::Cuda(Box::new(budget))
            .context("layer 3")
            .bt();
        assert!(e.is_oom());
        assert!(e.is_budget_exceeded());
        let e = candle_core::Error::Cuda(Box::new(candle_core::Error::Cuda(Box::new(
            dev.alloc::<u8>(2 << 20).unwrap_err(),
        ))));
        assert!(e.is_budget_exceeded());
        // a plain out-of-memory is not a budget's
        let e = candle_core::Error::Cuda(Box::new(oom()));
        assert!(e.is_oom() && !e.is_budget_exceeded());
    }

    #[test]
    fn messages_are_not_matched() {
        assert!(!candle_core::Error::Msg("CUDA_ERROR_OUT_OF_MEMORY out of memory".into()).is_oom());
        assert!(!candle_core::Error::Wrapped(Box::new("out of memory")).is_oom());
        let shape =
            candle_core::Tensor::zeros((2, 3), candle_core::DType::F32, &candle_core::Device::Cpu)
                .unwrap()
                .reshape((4, 4))
                .unwrap_err();
        assert!(!shape.is_oom());
        let e = candle_core::Error::Cuda(Box::new(std::io::Error::other("out of memory")));
        assert!(!e.is_oom());
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn driver_and_cublas_errors_in_the_box() {
        use cudarc::cublas::{result::CublasError, sys::cublasStatus_t};
        use cudarc::driver::{result::DriverError, sys::CUresult};
        let d = DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
        assert!(candle_core::Error::Cuda(Box::new(d)).bt().is_oom());
        let d = DriverError(CUresult::CUDA_ERROR_INVALID_VALUE);
        assert!(!candle_core::Error::Cuda(Box::new(d)).is_oom());
        let b = CublasError(cublasStatus_t::CUBLAS_STATUS_ALLOC_FAILED);
        assert!(candle_core::Error::Cuda(Box::new(b)).is_oom());
    }
}
