//! libtorch's out-of-memory, raised for real by libtorch 2.11 (on the CPU here; on a GPU in the
//! ignored tests), classified through tch's error and through a tch method's panic.

use std::panic;

use oomguard::IsOom;
use oomguard_tch::{catch_oom, panic_message_is_oom, tch_error_is_oom, Error};
use tch::{Device, Kind, TchError, Tensor};

/// 4 PiB: more than any host has, so libtorch's CPU allocator fails with ENOMEM.
const HUGE: i64 = 1 << 50;

fn cpu_oom() -> TchError {
    Tensor::f_empty([HUGE], (Kind::Float, Device::Cpu)).unwrap_err()
}

fn text(e: &TchError) -> &str {
    match e {
        TchError::Torch(t) => t,
        other => panic!("expected TchError::Torch, got {other:?}"),
    }
}

#[test]
fn a_real_cpu_allocation_failure_is_an_oom() {
    let e = cpu_oom();
    let t = text(&e);
    // what tch keeps: the CAFFE_ENFORCE message, then c10's backtrace lines
    assert!(
        t.starts_with(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate \
             memory: you tried to allocate 4503599627370496 bytes. Error code 12 (Cannot \
             allocate memory)\nframe #0: "
        ),
        "{t}"
    );
    assert!(tch_error_is_oom(&e));
    assert!(Error::from(e).is_oom());
}

#[test]
fn quoted_or_prefixed_oom_text_and_other_errors_are_not_oom() {
    // tch's own prefix (VarStore::load and friends): the text no longer starts with the message
    let prefixed = cpu_oom().path_context("model.pt");
    assert!(text(&prefixed).starts_with("model.pt: [enforce fail"));
    assert!(!tch_error_is_oom(&prefixed));
    // a libtorch error that is not an out-of-memory
    let a = Tensor::zeros([2, 3], (Kind::Float, Device::Cpu));
    let b = Tensor::zeros([4, 5], (Kind::Float, Device::Cpu));
    let shape = a.f_matmul(&b).unwrap_err();
    assert!(text(&shape).starts_with("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"));
    assert!(!tch_error_is_oom(&shape));
    assert!(!Error::from(shape).is_oom());
    // tch's own errors
    assert!(!tch_error_is_oom(&TchError::Kind("out of memory".into())));
}

#[test]
fn a_plain_tch_method_panicking_with_an_oom_is_caught() {
    let want = text(&cpu_oom()).lines().next().unwrap().to_string();
    let err = catch_oom(|| Ok::<_, Error>(Tensor::empty([HUGE], (Kind::Float, Device::Cpu))))
        .unwrap_err();
    assert!(err.is_oom());
    match &err {
        Error::OomPanic { message } => assert_eq!(message.lines().next(), Some(want.as_str())),
        other => panic!("expected OomPanic, got {other:?}"),
    }
    // the panic message itself, as the panic hook sees it
    let payload =
        panic::catch_unwind(|| Tensor::empty([HUGE], (Kind::Float, Device::Cpu))).unwrap_err();
    let message = payload.downcast_ref::<String>().expect("a String payload");
    assert!(message.starts_with("called `Result::unwrap()` on an `Err` value: Torch(\""));
    assert!(panic_message_is_oom(message));
}

#[test]
fn other_panics_continue_and_errors_pass_through() {
    let a = Tensor::zeros([2, 3], (Kind::Float, Device::Cpu));
    let b = Tensor::zeros([4, 5], (Kind::Float, Device::Cpu));
    // a non-OOM libtorch panic is not turned into an error
    let r = panic::catch_unwind(panic::AssertUnwindSafe(|| {
        catch_oom(|| Ok::<_, Error>(a.matmul(&b)))
    }));
    let payload = r.expect_err("the shape panic must continue");
    assert!(!panic_message_is_oom(
        payload.downcast_ref::<String>().unwrap()
    ));
    // the closure's own error is returned as it is
    let err = catch_oom(|| a.f_matmul(&b).map_err(Error::from)).unwrap_err();
    assert!(matches!(err, Error::Torch(_)) && !err.is_oom());
    let err = catch_oom(|| Tensor::f_empty([HUGE], (Kind::Float, Device::Cpu))).unwrap_err();
    assert!(matches!(err, Error::Torch(_)) && err.is_oom());
}

/// FIXTURE: the exact texts of libtorch 2.11's CUDA out-of-memory errors, recorded on the H100
/// by `tch/scripts/oom_messages.py` (PyTorch 2.11, CUDA 13.0) into
/// `tch/tests/fixtures/oom_messages_cuda.json`. Each case says whether it must be an
/// out-of-memory; the same text behind another error's words must not be.
#[test]
#[ignore = "needs tests/fixtures/oom_messages_cuda.json from tch/scripts/oom_messages.py on a GPU"]
fn the_cuda_messages_recorded_on_the_h100_classify() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/oom_messages_cuda.json"
    );
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("the fixture")).unwrap();
    let cases = json["cases"].as_array().expect("cases");
    let mut seen = Vec::new();
    for c in cases {
        let name = c["case"].as_str().unwrap();
        // what() through the C++ extension is tch's exact text; Python's is the fallback
        let Some(t) = c["what"].as_str().or(c["python_text"].as_str()) else {
            panic!("case {name} recorded no error: {c}");
        };
        if name == "cublas" && !t.starts_with("CUDA error: CUBLAS_STATUS_ALLOC_FAILED") {
            panic!("cublas case did not fail with ALLOC_FAILED: {t}");
        }
        let expect = c["expect_oom"].as_bool().unwrap();
        let e = TchError::Torch(t.to_string());
        assert_eq!(tch_error_is_oom(&e), expect, "{name}: {t}");
        let panic_msg = format!("called `Result::unwrap()` on an `Err` value: {e:?}");
        assert_eq!(
            panic_message_is_oom(&panic_msg),
            expect,
            "{name} as a panic"
        );
        assert!(
            !tch_error_is_oom(&TchError::Torch(format!("while loading: {t}"))),
            "{name}"
        );
        seen.push(name.to_string());
    }
    for want in [
        "caching",
        "expandable",
        "fraction",
        "async",
        "driver",
        "cublas",
        "not_oom",
    ] {
        assert!(
            seen.iter().any(|s| s == want),
            "case {want} missing from the fixture"
        );
    }
}

/// On a CUDA device: more than the device holds, through tch (the caching allocator's message).
#[test]
#[ignore = "needs a CUDA device"]
fn a_real_cuda_oom_is_an_oom() {
    assert!(tch::Cuda::is_available(), "no CUDA device");
    let e = Tensor::f_empty([HUGE], (Kind::Uint8, Device::Cuda(0))).unwrap_err();
    assert!(
        text(&e).starts_with("CUDA out of memory. Tried to allocate "),
        "{}",
        text(&e)
    );
    assert!(tch_error_is_oom(&e));
    let err = catch_oom(|| Ok::<_, Error>(Tensor::empty([HUGE], (Kind::Uint8, Device::Cuda(0)))))
        .unwrap_err();
    assert!(matches!(err, Error::OomPanic { .. }));
    // the device is usable after
    let t = Tensor::ones([4], (Kind::Float, Device::Cuda(0)));
    assert_eq!(t.sum(Kind::Float).double_value(&[]), 4.0);
}
