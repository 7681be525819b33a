//! What a candle user reads when a step retries or leaks (issue 32, point 14): one line per
//! attempt in a retry report whatever `RUST_BACKTRACE` is, and a leak charged through `charge`
//! named at the caller's line.
//!
//! One test: it sets `RUST_BACKTRACE=1` before anything captures a backtrace (std reads the
//! variable once per process).

use candle_core::{Device, Tensor, Var};
use candle_nn::{Optimizer, SGD};
use oomguard::retry::RetryEngine;
use oomguard::ByteSize;
use oomguard_candle::train_step;

#[test]
fn retry_reports_keep_one_line_per_attempt_and_leaks_name_the_caller() {
    // Backtraces on, as when debugging: candle's `Error::bt()` then appends about 35 lines.
    std::env::set_var("RUST_BACKTRACE", "1");
    let card = oomguard::Device::sim(ByteSize::mib(40));
    let x = Tensor::arange(0f32, 256., &Device::Cpu)
        .unwrap()
        .reshape((64, 4))
        .unwrap();
    let y = x.sum_keepdim(1).unwrap();
    let w = Var::zeros((4, 1), candle_core::DType::F32, &Device::Cpu).unwrap();
    let mut opt = SGD::new(vec![w.clone()], 1e-4).unwrap();
    // false: the OOM as `charge` returns it; true: with a backtrace attached, as candle's own
    // CUDA errors are (`bt()`).
    for with_bt in [false, true] {
        let done = train_step(
            &RetryEngine::new(),
            &card,
            &[&x, &y],
            std::slice::from_ref(&w),
            &mut opt,
            |chunk, rows| {
                // 1 MiB of "activations" per row: 64 rows do not fit in 40 MiB.
                let acts = oomguard_candle::charge(&card, chunk.len() << 20);
                let _acts = if with_bt {
                    acts.map_err(|e| e.bt())?
                } else {
                    acts?
                };
                (rows[0].matmul(w.as_tensor())? - &rows[1])?
                    .sqr()?
                    .mean_all()
            },
        )
        .unwrap();
        let report = &done.report;
        assert!(report.retries() >= 1, "{report}");
        let stored = report.attempts[0].error.as_deref().unwrap();
        if with_bt {
            assert!(
                stored.lines().count() > 1,
                "a backtrace was attached: {stored}"
            );
        } else {
            assert_eq!(stored.lines().count(), 1, "no backtrace: {stored}");
        }
        let text = report.to_string();
        assert_eq!(
            text.lines().count(),
            1 + report.attempts.len(),
            "a headline and one line per attempt:\n{text}"
        );
        assert!(text.contains("out of memory"), "{text}");
    }

    let check = card.leak_check();
    let kept = oomguard_candle::charge(&card, 4096).unwrap();
    let line = line!() - 1;
    let leak = check.finish().unwrap_err();
    assert_eq!(leak.leaks.len(), 1);
    assert_eq!(leak.leaks[0].location.file(), file!(), "{leak}");
    assert_eq!(leak.leaks[0].location.line(), line, "{leak}");
    assert!(
        leak.to_string().contains("OOMGUARD_LEAK_BACKTRACE=1"),
        "{leak}"
    );
    drop(kept);
}
