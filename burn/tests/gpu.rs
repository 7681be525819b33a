//! oomguard-burn on a real GPU (feature `cuda`, an NVIDIA GPU; `#[ignore]`d: run with
//! `cargo test -p oomguard-burn --features cuda --test gpu -- --ignored --test-threads=1`).
//! The count of cubecl out-of-memory panics is process-wide: run these one at a time.
#![cfg(feature = "cuda")]

use burn::backend::cuda::CudaDevice;
use burn::backend::{Autodiff, Cuda};
use burn::nn::{Linear, LinearConfig};
use burn::optim::SgdConfig;
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor};
use oomguard::retry::RetryEngine;
use oomguard::IsOom;
use oomguard_burn::{catch_oom, chunk_rows, memory_source, train_step, Error};

type G = Cuda;
type AG = Autodiff<Cuda>;

/// 1 GiB of f32.
const GIB_F32: usize = 1 << 28;

/// Allocating 1 GiB tensors until the device runs out: the out-of-memory (a panic on cubecl's
/// device thread, then `CallError` or an error on the read) is an `Error::DevicePanic` or an
/// OOM `ExecutionError`, and afterwards the device computes correctly.
#[test]
#[ignore = "needs a CUDA device"]
fn a_real_oom_is_caught_and_the_device_recovers() {
    let dev = CudaDevice::default();
    let err = catch_oom(|| -> Result<f32, Error> {
        let mut held = Vec::new();
        for _ in 0..256 {
            held.push(Tensor::<G, 1>::ones([GIB_F32], &dev));
            G::sync(&dev)?;
        }
        Ok(held
            .last()
            .unwrap()
            .clone()
            .sum()
            .try_into_data()?
            .iter::<f32>()
            .next()
            .unwrap())
    })
    .unwrap_err();
    assert!(err.is_oom(), "{err}");
    G::memory_cleanup(&dev);
    let a = Tensor::<G, 2>::ones([1024, 1024], &dev);
    let s: f32 = (a.clone() + a).sum().into_scalar();
    assert_eq!(s, 2.0 * 1024.0 * 1024.0, "the device works after the OOM");
}

/// The CUDA source: usage follows a 1 GiB tensor, `empty_cache` returns cubecl's pages.
#[test]
#[ignore = "needs a CUDA device"]
fn the_cubecl_source_reads_the_pool() {
    let dev = CudaDevice::default();
    let src = memory_source::<G>(&dev).unwrap();
    src.empty_cache().unwrap();
    let before = src.usage().unwrap();
    let t = Tensor::<G, 1>::ones([GIB_F32], &dev);
    G::sync(&dev).unwrap();
    let held = src.usage().unwrap();
    assert!(
        held.used >= before.used + (1 << 30),
        "{before:?} -> {held:?}"
    );
    assert!(held.used_peak >= held.used);
    drop(t);
    src.empty_cache().unwrap();
    let after = src.usage().unwrap();
    assert!(after.used < held.used, "{held:?} -> {after:?}");
    assert!(
        src.memory_summary().contains("cubecl"),
        "{}",
        src.memory_summary()
    );
}

/// `train_step` with a real OOM: each row of a micro-batch holds 2 GiB, so the batch of 64
/// (128 GiB) cannot run whole; the step splits, trains on every row, and the next call starts
/// from the remembered plan with no retry.
#[test]
#[ignore = "needs a CUDA device"]
fn train_step_survives_a_real_oom_by_accumulation() {
    let dev = CudaDevice::default();
    let source = memory_source::<AG>(&dev).unwrap();
    let mut model: Linear<AG> = LinearConfig::new(256, 1).init(&dev);
    let mut sgd = SgdConfig::new().init();
    let x = Tensor::<AG, 2>::random([64, 256], Distribution::Default, &dev);
    let engine = RetryEngine::new();
    let mut reports = Vec::new();
    for _ in 0..2 {
        let done = train_step(
            &engine,
            &source,
            64,
            &mut model,
            &mut sgd,
            0.01,
            |m, chunk| {
                let waste = Tensor::<AG, 2>::ones([chunk.len(), 2 * GIB_F32], &dev);
                let loss = m.forward(chunk_rows(&x, chunk)?).powi_scalar(2).mean();
                Ok(loss + waste.sum().mul_scalar(0.0))
            },
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(done.rows, 64);
        reports.push(done.report);
    }
    assert!(reports[0].retries() >= 1, "{}", reports[0]);
    assert!(reports[0].final_plan.micro_batch() <= 32, "{}", reports[0]);
    assert!(
        reports[1].retries() == 0 && reports[1].from_memory,
        "{}",
        reports[1]
    );
}

/// `ones([n])` summed and read under `catch_oom` (the read surfaces a failed reservation).
fn make_and_sum(dev: &CudaDevice, n: usize) -> Result<f32, Error> {
    catch_oom(|| -> Result<f32, Error> {
        let t = Tensor::<G, 1>::ones([n], dev);
        Ok(t.sum()
            .try_into_data()?
            .iter::<f32>()
            .next()
            .unwrap_or(f32::NAN))
    })
}

/// A budget on the cubecl source caps cubecl: with 12 GiB of room a 6 GiB tensor (which
/// cubecl puts in a page of a quarter of the card) runs out of memory, caught as such, a 1 GiB
/// tensor is made, cubecl's reserved memory stays within the limit; after the budget the 6 GiB
/// tensor is made. 0, a limit below what cubecl holds and a second budget are refused.
#[test]
#[ignore = "needs a CUDA device"]
fn a_budget_caps_cubecl() {
    let dev = CudaDevice::default();
    let src = memory_source::<G>(&dev).unwrap();
    // cubecl holds something (its client's first pages) before the budget.
    assert!(make_and_sum(&dev, 1024).unwrap() > 0.0);
    src.empty_cache().unwrap();
    let held = src.usage().unwrap().reserved;
    assert!(src.budget(0).is_err());
    if held > 0 {
        let e = src.budget(held).unwrap_err().to_string();
        assert!(e.contains("already holds"), "{e}");
    }
    let limit = held + (12 << 30);
    let budget = src.budget(limit).unwrap();
    assert_eq!(budget.limit(), limit);
    let e = src.budget(limit).unwrap_err().to_string();
    assert!(e.contains("already in force"), "{e}");
    let room = src.available().unwrap();
    assert!(
        room <= (12 << 30) + oomguard::source::BALLAST_PAGE,
        "{room} B available under a 12 GiB room"
    );
    src.reset_peak().unwrap();
    let err = make_and_sum(&dev, 6 * GIB_F32).unwrap_err();
    assert!(err.is_oom(), "{err}");
    G::memory_cleanup(&dev);
    let small = make_and_sum(&dev, GIB_F32).unwrap();
    assert!(
        (small / GIB_F32 as f32 - 1.0).abs() < 1e-3,
        "sum of 2^28 ones: {small}"
    );
    let peak = src.usage().unwrap().reserved_peak;
    assert!(
        peak <= limit + oomguard::source::BALLAST_PAGE,
        "cubecl reserved {peak} B under a budget of {limit} B"
    );
    drop(budget);
    G::memory_cleanup(&dev);
    let big = make_and_sum(&dev, 6 * GIB_F32).unwrap();
    assert!(big > 0.0, "{big}");
}
