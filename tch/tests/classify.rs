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

/// The cases `tch/tests/fixtures/oom_texts_h100_python.txt` holds: what
/// `tch/scripts/oom_messages.py` printed on the H100 (PyTorch 2.11.0+cu130) before its run timed
/// out, one `[case] python.Type: ['first line of the text']` per case.
const H100_CASES: [&str; 7] = [
    "caching",
    "expandable",
    "fraction",
    "async",
    "driver",
    "cublas",
    "cpu",
];

/// c10's backtrace as libtorch's `what()` appends it after a `TORCH_CHECK`'s message thrown by
/// `function` in `file` (the C++ exception tch keeps).
fn torch_check_bt(function: &str, file: &str) -> String {
    format!(
        "\nException raised from {function} at {file}:1450 (most recent call first):\nframe #0: \
         c10::Error::Error(c10::SourceLocation, std::string) + 0x9d (0x7f2b3c6a1e9d in \
         /usr/lib/python3/site-packages/torch/lib/libc10.so)\nframe #1: <unknown function> + \
         0x3e4b2 (0x7f2b3c9d84b2 in /usr/lib/python3/site-packages/torch/lib/libc10_cuda.so)\n"
    )
}

/// The CPU allocator's `CAFFE_ENFORCE` appends the frames only.
const ENFORCE_BT: &str = "\nframe #0: c10::ThrowEnforceNotMet(char const*, int, char const*, \
     std::string const&, void const*) + 0x50 (0x7f2b3c6a2f10 in libc10.so)\n";

/// What libtorch appends to a case's message: nothing (the first line alone, as the fixture
/// holds it), or the backtrace naming where libtorch 2.11 throws it.
fn what_suffixes(case: &str) -> [String; 2] {
    let site = match case {
        "caching" | "expandable" | "fraction" => {
            torch_check_bt("malloc", "/pytorch/c10/cuda/CUDACachingAllocator.cpp")
        }
        "async" => torch_check_bt(
            "mallocAsync",
            "/pytorch/c10/cuda/CUDAMallocAsyncAllocator.cpp",
        ),
        // C10_CUDA_CHECK names its caller: the uncached cudaMalloc of the caching allocator
        "driver" => torch_check_bt("malloc", "/pytorch/c10/cuda/CUDACachingAllocator.cpp"),
        "cublas" => torch_check_bt(
            "getCurrentCUDABlasHandle",
            "/pytorch/aten/src/ATen/cuda/CublasHandlePool.cpp",
        ),
        "cpu" => ENFORCE_BT.to_string(),
        other => panic!("unexpected case {other}"),
    };
    [String::new(), site]
}

/// Where libtorch 2.11 throws a failed `_assert_async` with the user's message (on the CPU).
fn assert_bt() -> String {
    torch_check_bt(
        "_assert_async_msg_cpu",
        "/pytorch/aten/src/ATen/native/TensorCompare.cpp",
    )
}

/// One line of the fixture: `(case, python type, text)`; the text is Python's `repr` of a string
/// inside a one-element list (`['...']` or `["..."]`).
fn parse_fixture_line(line: &str) -> (String, String, String) {
    let bad = |why: &str| -> ! { panic!("fixture line {line:?}: {why}") };
    let rest = line.strip_prefix('[').unwrap_or_else(|| bad("no [case]"));
    let (case, rest) = rest.split_once("] ").unwrap_or_else(|| bad("no [case]"));
    let (ty, rest) = rest.split_once(": [").unwrap_or_else(|| bad("no `: [`"));
    let repr = rest
        .strip_suffix(']')
        .unwrap_or_else(|| bad("no closing ]"));
    let quote = repr.chars().next().unwrap_or_else(|| bad("empty text"));
    if !(quote == '\'' || quote == '"') || repr.len() < 2 || !repr.ends_with(quote) {
        bad("the text is not a quoted Python string");
    }
    let mut text = String::new();
    let mut chars = repr[1..repr.len() - 1].chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            text.push(c);
            continue;
        }
        match chars.next() {
            Some(e @ ('\\' | '\'' | '"')) => text.push(e),
            Some('n') => text.push('\n'),
            other => bad(&format!("unknown escape \\{other:?}")),
        }
    }
    (case.to_string(), ty.to_string(), text)
}

fn read_h100_fixture() -> Vec<(String, String, String)> {
    // Compiled in: the test binary also runs on a GPU machine without this checkout.
    let file = include_str!("fixtures/oom_texts_h100_python.txt");
    file.lines()
        .filter(|l| !l.trim().is_empty())
        .map(parse_fixture_line)
        .collect()
}

/// The first lines of libtorch's real out-of-memory texts, as the H100 raised them, classify as
/// out-of-memory through the path a `TchError::Torch(text)` takes, alone and with c10's
/// backtrace after them; the same texts inside another error's words, and a shape error, do not.
#[test]
fn the_texts_recorded_on_the_h100_classify() {
    let cases = read_h100_fixture();
    let names: Vec<&str> = cases.iter().map(|(c, _, _)| c.as_str()).collect();
    assert_eq!(names, H100_CASES, "the fixture's cases");
    for (case, ty, t) in &cases {
        // the cases are the errors they claim to be (the fixture is not a stand-in)
        let want = match case.as_str() {
            "caching" | "expandable" | "fraction" => "CUDA out of memory. Tried to allocate ",
            "async" => "Allocation on device 0 would exceed allowed memory. (out of memory)",
            "driver" => "CUDA error: out of memory",
            "cublas" => "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(",
            "cpu" => "[enforce fail at alloc_cpu.cpp:",
            other => panic!("unexpected case {other}"),
        };
        assert!(t.starts_with(want), "{case} ({ty}): {t}");
        if case == "cpu" {
            assert!(t.ends_with("Error code 12 (Cannot allocate memory)"), "{t}");
        }
        for suffix in what_suffixes(case) {
            let what = format!("{t}{suffix}");
            let e = TchError::Torch(what.clone());
            assert!(tch_error_is_oom(&e), "{case} ({ty}) is an OOM: {what:?}");
            let panic_msg = format!("called `Result::unwrap()` on an `Err` value: {e:?}");
            assert!(panic_message_is_oom(&panic_msg), "{case} as a panic");
            assert!(Error::from(e).is_oom(), "{case} through Error");
            // the same text inside another message: a prefix, a quote, a TORCH_CHECK's words
            for other in [
                format!("model.pt: {what}"),
                format!("while loading: {what}"),
                format!("worker 3 failed with '{what}'"),
                format!("\"{what}\""),
                format!(" {what}"),
                format!("Expected all tensors to be on the same device, but got error: {what}"),
                // a user's assertion worded as this text (with or without a forged site)
                format!("{t}{}", assert_bt()),
                format!("{what}{}", assert_bt()),
            ] {
                let e = TchError::Torch(other.clone());
                assert!(!tch_error_is_oom(&e), "{case} quoted: {other:?}");
                assert!(!Error::from(e).is_oom(), "{case} quoted, through Error");
            }
        }
    }
    // a libtorch shape error with the same backtrace is not an out-of-memory
    for suffix in what_suffixes("caching")
        .into_iter()
        .chain(what_suffixes("cpu"))
    {
        let shape = format!("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5){suffix}");
        assert!(
            !tch_error_is_oom(&TchError::Torch(shape.clone())),
            "{shape:?}"
        );
        assert!(!Error::from(TchError::Torch(shape)).is_oom());
    }
}

#[test]
fn the_fixture_parser_reads_python_repr_and_rejects_other_lines() {
    let (case, ty, text) =
        parse_fixture_line(r#"[cpu] builtins.RuntimeError: ["can't \\ \"x\" \'y\'"]"#);
    assert_eq!(
        (case.as_str(), ty.as_str(), text.as_str()),
        ("cpu", "builtins.RuntimeError", r#"can't \ "x" 'y'"#)
    );
    for bad in [
        "caching torch.OutOfMemoryError: ['x']",
        "[caching] torch.OutOfMemoryError: 'x'",
        "[caching] torch.OutOfMemoryError: ['x\"]",
        r"[caching] torch.OutOfMemoryError: ['\x41']",
    ] {
        assert!(
            panic::catch_unwind(|| parse_fixture_line(bad)).is_err(),
            "{bad}"
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

/// A failed `_assert_async` with the user's message, raised by libtorch on the CPU: libtorch
/// puts the message first, then its throw site (`_assert_async_msg_cpu`).
fn user_assert(message: &str) -> TchError {
    let cond = Tensor::zeros([], (Kind::Bool, Device::Cpu));
    let token = Tensor::empty([0], (Kind::Float, Device::Cpu));
    cond.f_internal_functional_assert_async(message, &token)
        .unwrap_err()
}

/// A user's assertion whose message reads like one of libtorch's out-of-memory messages (each
/// recorded H100 text, and a short one) is not an out-of-memory: the text starts with the
/// message, but the throw site libtorch appends is the assertion's.
#[test]
fn a_user_assertion_worded_as_an_oom_is_not_one() {
    let mut messages: Vec<String> = read_h100_fixture().into_iter().map(|c| c.2).collect();
    messages.push("CUDA out of memory. Tried to allocate 2 GiB".into());
    for m in &messages {
        let e = user_assert(m);
        let t = text(&e);
        assert!(
            t.starts_with(m.as_str()),
            "libtorch puts the message first: {t}"
        );
        assert!(
            t.contains("\nException raised from _assert_async_msg_cpu at "),
            "{t}"
        );
        assert!(!tch_error_is_oom(&e), "{t}");
        assert!(!Error::from(e).is_oom());
        // the plain method's panic is not caught as an out-of-memory either
        let cond = Tensor::zeros([], (Kind::Bool, Device::Cpu));
        let token = Tensor::empty([0], (Kind::Float, Device::Cpu));
        let r = panic::catch_unwind(panic::AssertUnwindSafe(|| {
            catch_oom(|| Ok::<_, Error>(cond.internal_functional_assert_async(m, &token)))
        }));
        let payload = r.expect_err("a non-OOM panic continues");
        assert!(!panic_message_is_oom(
            payload.downcast_ref::<String>().unwrap()
        ));
    }
}
