//! `#[oom_retry]` on a function returning `Result<_, TchError>`: tch's own error is retryable
//! (oomguard's `tch` feature implements `IsOom` for it), with a real libtorch out-of-memory.

use oomguard::{no_grad, oom_retry};
use tch::{Device, Kind, TchError, Tensor};

/// Asks libtorch's CPU allocator for 2^40 floats (4 TiB) per row beyond 4 rows: a real ENOMEM
/// out-of-memory for a batch above 4, a small tensor at 4 rows or fewer. Evaluation
/// (`#[no_grad]`): `batch =` runs fewer rows, which a training step may not.
#[oom_retry(batch = batch, min = 1)]
#[no_grad]
fn rows_with_cap(batch: usize) -> Result<i64, TchError> {
    let rows = if batch > 4 {
        (batch as i64) << 40
    } else {
        batch as i64
    };
    let t = Tensor::f_zeros([rows], (Kind::Float, Device::Cpu))?;
    Ok(t.size()[0])
}

#[oom_retry(batch = batch, min = 1)]
#[no_grad]
fn shape_error(batch: usize) -> Result<Tensor, TchError> {
    let a = Tensor::f_zeros([batch as i64, 3], (Kind::Float, Device::Cpu))?;
    let b = Tensor::f_zeros([4, 5], (Kind::Float, Device::Cpu))?;
    a.f_matmul(&b)
}

#[test]
fn a_libtorch_oom_shrinks_the_batch_until_it_fits() {
    // 16 (and 16 again after emptying the cache) -> 8 -> 4: three failed attempts, each a
    // libtorch out-of-memory, then 4 rows.
    assert_eq!(rows_with_cap(16).unwrap(), 4);
    let report = oomguard::retry::last_report().expect("a report of the retried call");
    let batches: Vec<usize> = report.attempts.iter().map(|a| a.plan.batch()).collect();
    assert_eq!(batches, [16, 16, 8], "{report}");
    assert_eq!(report.final_plan.batch(), 4, "{report}");
    assert!(report.attempts.iter().all(|a| a
        .error
        .as_deref()
        .is_some_and(|e| e.contains("DefaultCPUAllocator"))));
}

#[test]
fn any_other_tch_error_is_returned_at_once() {
    let err = shape_error(8).unwrap_err();
    assert!(matches!(err, TchError::Torch(_)), "{err:?}");
    let report = oomguard::retry::last_report().expect("a report of the call");
    assert_eq!(report.retries(), 0, "{report}");
}
