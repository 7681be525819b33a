use super::*;
use crate::backend::BackendErrorKind;
use std::fmt;

#[derive(Debug)]
struct Outer(Box<dyn StdError + Send + Sync>);
impl fmt::Display for Outer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // A message that mentions memory must not make it an OOM: classification is typed.
        f.write_str("CUDA out of memory (not really)")
    }
}
impl StdError for Outer {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        Some(&*self.0)
    }
}

#[derive(Debug)]
struct Plain;
impl fmt::Display for Plain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("out of memory")
    }
}
impl StdError for Plain {}

fn oom() -> OomError {
    OomError {
        requested: 1,
        device: 0,
        device_total: 1,
        device_free: 0,
        allocated: 0,
        reserved_unallocated: 0,
        largest_free_block: 0,
        cause: None,
        expandable_segments: false,
        memory_limit: None,
    }
}

#[test]
fn own_types() {
    assert!(IsOom::is_oom(&Error::Oom(oom())));
    assert!(IsOom::is_oom(&Error::BudgetExceeded(BudgetExceeded {
        requested: 1,
        in_use: 1,
        limit: 1,
        opened_at: None,
    })));
    assert!(!IsOom::is_oom(&Error::InvalidArgument("x".into())));
    assert!(IsOom::is_oom(&BackendError::oom("alloc", "x")));
    assert!(!IsOom::is_oom(&BackendError::new(
        BackendErrorKind::Other,
        "alloc",
        "out of memory"
    )));
    assert!(IsOom::is_oom(&Box::new(oom())));
}

#[test]
fn walks_source_chains_by_type() {
    let nested: Box<dyn StdError + Send + Sync> =
        Box::new(Outer(Box::new(Outer(Box::new(Error::Oom(oom()))))));
    assert!(nested.is_oom());
    let backend: Box<dyn StdError + Send + Sync> =
        Box::new(Outer(Box::new(BackendError::oom("map", "x"))));
    assert!(backend.is_oom());
    let not: Box<dyn StdError + Send + Sync> = Box::new(Outer(Box::new(Plain)));
    assert!(!not.is_oom(), "messages are never matched");
    let plain: &(dyn StdError + 'static) = &Plain;
    assert!(!plain.is_oom());
}

#[cfg(feature = "cuda")]
#[test]
fn cudarc_errors_by_code() {
    use cudarc::cublas::result::CublasError;
    use cudarc::cublas::sys::cublasStatus_t;
    use cudarc::driver::result::DriverError;
    use cudarc::driver::sys::CUresult;
    assert!(DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY).is_oom());
    assert!(!DriverError(CUresult::CUDA_ERROR_INVALID_VALUE).is_oom());
    assert!(CublasError(cublasStatus_t::CUBLAS_STATUS_ALLOC_FAILED).is_oom());
    assert!(!CublasError(cublasStatus_t::CUBLAS_STATUS_EXECUTION_FAILED).is_oom());
    // nested in a user's error, as candle nests cudarc's
    let nested: Box<dyn StdError + Send + Sync> = Box::new(Outer(Box::new(DriverError(
        CUresult::CUDA_ERROR_OUT_OF_MEMORY,
    ))));
    assert!(nested.is_oom());
    let blas: Box<dyn StdError + Send + Sync> = Box::new(Outer(Box::new(CublasError(
        cublasStatus_t::CUBLAS_STATUS_ALLOC_FAILED,
    ))));
    assert!(blas.is_oom());
}
