//! libtorch's out-of-memory on a real card, raised through tch and classified from the
//! `TchError` it returns (ignored without a CUDA device; run on the H100 by `.gpu` scripts).
//! Each case also prints the throw site libtorch names (`SITE ...`) and checks that the same
//! message, given by a user to a failed `_assert_async`, is not an out-of-memory.
//!
//! Each case runs in a child process (this test binary again, `--exact` on the case), because
//! libtorch's allocator reads `PYTORCH_ALLOC_CONF` / `PYTORCH_NO_CUDA_MEMORY_CACHING` once, when
//! CUDA starts, and a case that fills the card must not leave it full for the next.

use std::process::Command;

use oomguard::IsOom;
use tch::{Device, Kind, TchError, Tensor};

/// Set in a child: run the case's body instead of spawning.
const CHILD: &str = "OOMGUARD_TCH_OOM_CASE_CHILD";

fn text(e: &TchError) -> String {
    match e {
        TchError::Torch(t) => t.clone(),
        other => panic!("expected TchError::Torch, got {other:?}"),
    }
}

/// Runs `name` in a child with `env`, checks it passed, and returns what it printed.
fn in_child(name: &str, env: &[(&str, &str)]) -> String {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        name,
        "--include-ignored",
        "--nocapture",
        "--test-threads",
        "1",
    ]);
    cmd.env(CHILD, "1");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("the test binary runs again");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{name} in a child failed:\n{stdout}\n{stderr}"
    );
    println!("{stdout}");
    stdout
}

/// The first line of libtorch's text (its message; c10's backtrace follows).
fn first_line(t: &str) -> &str {
    t.lines().next().unwrap_or("")
}

/// 1 PiB: more than any card.
const HUGE: i64 = 1 << 50;

/// The line of c10's backtrace that names where libtorch threw (printed for the record).
fn site_line(t: &str) -> &str {
    t.lines()
        .rfind(|l| l.starts_with("Exception raised from "))
        .unwrap_or("(no throw site)")
}

/// libtorch's own out-of-memory `t` is one; the same message given by a user to a failed
/// `_assert_async` (on the CPU: libtorch puts the user's message first, then the assertion's
/// throw site) is not.
fn user_assertion_with_the_same_message_is_not_an_oom(t: &str) {
    println!("SITE {}", site_line(t));
    let message = t.split("\nException raised from ").next().unwrap_or(t);
    let cond = Tensor::zeros([], (Kind::Bool, Device::Cpu));
    let token = Tensor::empty([0], (Kind::Float, Device::Cpu));
    let e = cond
        .f_internal_functional_assert_async(message, &token)
        .unwrap_err();
    assert!(text(&e).starts_with(message), "{}", text(&e));
    assert!(
        !e.is_oom(),
        "a user's assertion taken for an OOM: {}",
        text(&e)
    );
}

fn huge_alloc_case(expect_start: &str) {
    assert!(
        tch::Cuda::is_available(),
        "no CUDA device (or libtorch_cuda not linked)"
    );
    let e = Tensor::f_empty([HUGE], (Kind::Uint8, Device::Cuda(0))).unwrap_err();
    let t = text(&e);
    println!("TEXT {}", first_line(&t));
    assert!(t.starts_with(expect_start), "{t}");
    assert!(e.is_oom(), "not classified as out-of-memory: {t}");
    user_assertion_with_the_same_message_is_not_an_oom(&t);
}

#[test]
#[ignore = "needs a CUDA device"]
fn caching_allocator_oom_through_tch() {
    if std::env::var_os(CHILD).is_none() {
        in_child("caching_allocator_oom_through_tch", &[]);
        return;
    }
    huge_alloc_case("CUDA out of memory. Tried to allocate ");
}

#[test]
#[ignore = "needs a CUDA device"]
fn expandable_segments_oom_through_tch() {
    if std::env::var_os(CHILD).is_none() {
        in_child(
            "expandable_segments_oom_through_tch",
            &[("PYTORCH_ALLOC_CONF", "expandable_segments:True")],
        );
        return;
    }
    huge_alloc_case("CUDA out of memory. Tried to allocate ");
}

#[test]
#[ignore = "needs a CUDA device"]
fn async_backend_oom_through_tch() {
    if std::env::var_os(CHILD).is_none() {
        in_child(
            "async_backend_oom_through_tch",
            &[("PYTORCH_ALLOC_CONF", "backend:cudaMallocAsync")],
        );
        return;
    }
    huge_alloc_case("Allocation on device ");
}

#[test]
#[ignore = "needs a CUDA device"]
fn uncached_cuda_malloc_oom_through_tch() {
    if std::env::var_os(CHILD).is_none() {
        in_child(
            "uncached_cuda_malloc_oom_through_tch",
            &[("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")],
        );
        return;
    }
    huge_alloc_case("CUDA error: out of memory");
}

/// The card filled to its last MiBs by tch tensors, then the process's first matmul: cuBLAS's
/// handle or workspace cannot be allocated. Which message comes depends on where cuBLAS fails
/// (its own `cudaMalloc` in `cublasCreate`: CUBLAS_STATUS_ALLOC_FAILED; its workspace through
/// the caching allocator: "CUDA out of memory"); either must be an out-of-memory.
#[test]
#[ignore = "needs a CUDA device"]
fn cublas_allocation_failure_through_tch() {
    if std::env::var_os(CHILD).is_none() {
        let out = in_child("cublas_allocation_failure_through_tch", &[]);
        assert!(out.contains("TEXT "), "{out}");
        return;
    }
    assert!(
        tch::Cuda::is_available(),
        "no CUDA device (or libtorch_cuda not linked)"
    );
    let dev = Device::Cuda(0);
    // The matmul's operands and output first, so that the matmul itself allocates nothing but
    // cuBLAS's handle and workspace.
    let a = Tensor::ones([64, 64], (Kind::Float, dev));
    let out = Tensor::empty([64, 64], (Kind::Float, dev));
    let mut held = Vec::new();
    // Fill: 1 GiB blocks, then 16 MiB, then 1 MiB, until each size fails.
    for block in [1i64 << 30, 16 << 20, 1 << 20] {
        while let Ok(t) = Tensor::f_empty([block], (Kind::Uint8, dev)) {
            held.push(t);
        }
    }
    let e = match Tensor::f_matmul_out(&out, &a, &a) {
        Err(e) => e,
        // An error of the kernel itself would surface at a read.
        Ok(c) => match c.f_sum(Kind::Float).and_then(|s| s.f_double_value(&[])) {
            Err(e) => e,
            Ok(v) => panic!("the matmul ran on a full card (sum {v}); nothing to classify"),
        },
    };
    let t = text(&e);
    println!("TEXT {}", first_line(&t));
    assert!(e.is_oom(), "not classified as out-of-memory: {t}");
    drop(held);
    user_assertion_with_the_same_message_is_not_an_oom(&t);
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_shape_error_on_cuda_is_not_an_oom() {
    assert!(
        tch::Cuda::is_available(),
        "no CUDA device (or libtorch_cuda not linked)"
    );
    let a = Tensor::ones([2, 3], (Kind::Float, Device::Cuda(0)));
    let b = Tensor::ones([4, 5], (Kind::Float, Device::Cuda(0)));
    let e = a.f_matmul(&b).unwrap_err();
    println!("TEXT {}", first_line(&text(&e)));
    assert!(!e.is_oom());
}
