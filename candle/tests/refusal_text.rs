//! oomguard-candle's own refusals carry their text alone. `candle_core::bail!` and
//! `Error::msg` attach a backtrace when `RUST_BACKTRACE` is set (about 35 frames in the message);
//! a retry report quotes every attempt's message, so the glue's refusals are built without one.
//! One test in this file: the process's first backtrace capture reads the variable set below.

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{linear, Optimizer, VarBuilder, VarMap, SGD};
use oomguard::retry::RetryEngine;
use oomguard::ByteSize;
use oomguard_candle::{chunk_rows, train_step, TrainStepError};

#[test]
fn refusals_carry_no_backtrace_with_rust_backtrace_set() {
    std::env::set_var("RUST_BACKTRACE", "1");
    // candle's own errors do carry one here, so the check below can fail
    let own = candle_core::Error::msg("x").to_string();
    assert!(own.lines().count() > 1, "{own}");

    let card = oomguard::Device::sim(ByteSize::gib(1));
    let dev = Device::Cpu;
    let varmap = VarMap::new();
    let lin = linear(
        4,
        2,
        VarBuilder::from_varmap(&varmap, DType::F32, &dev).pp("fc"),
    )
    .unwrap();
    let mut opt = SGD::new(varmap.all_vars(), 0.1).unwrap();
    let x = Tensor::ones((8, 4), DType::F32, &dev).unwrap();
    let y = Tensor::zeros((8, 2), DType::F32, &dev).unwrap();
    let engine = RetryEngine::new();

    // no gradient reaches the layer: softmax_last_dim is forward-only in candle-nn 0.11
    let e = train_step(&engine, &card, &[&x, &y], &varmap, &mut opt, |_c, rows| {
        let p = candle_nn::ops::softmax_last_dim(&lin.forward(&rows[0])?)?;
        (p - &rows[1])?.sqr()?.mean_all()
    })
    .unwrap_err();
    let text = e.to_string();
    assert!(text.contains("no gradient"), "{text}");
    assert!(!text.contains("Error::bt"), "a backtrace in: {text}");

    // rows beyond the tensor's
    let short = Tensor::ones((2, 4), DType::F32, &dev).unwrap();
    let chunk = oomguard::retry::BatchPlan::new(8, 1)
        .unwrap()
        .chunks()
        .next()
        .unwrap();
    let e = chunk_rows(&short, &chunk).unwrap_err().to_string();
    assert!(e.contains("needs rows up to 8"), "{e}");
    assert_eq!(e.lines().count(), 1, "{e}");

    // a variable of the loss that is not among the step's parameters
    let other = VarMap::new();
    let lin2 = linear(
        4,
        2,
        VarBuilder::from_varmap(&other, DType::F32, &dev).pp("g"),
    )
    .unwrap();
    let e = train_step(&engine, &card, &[&x, &y], &varmap, &mut opt, |_c, rows| {
        let h = (lin.forward(&rows[0])? + lin2.forward(&rows[0])?)?;
        (h - &rows[1])?.sqr()?.mean_all()
    })
    .unwrap_err();
    let text = e.to_string();
    assert!(text.contains("not among the step's parameters"), "{text}");
    assert!(!text.contains("Error::bt"), "a backtrace in: {text}");
    assert!(matches!(e, TrainStepError::Retry(_)), "{e:?}");
}
