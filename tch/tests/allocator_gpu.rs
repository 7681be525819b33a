//! oomguard's allocator under libtorch on a GPU (`allocator::install`). Installing is
//! process-wide and must come before CUDA's initialisation, so every test here runs its body in
//! a process of its own: the test re-runs this binary with only itself selected and
//! `OOMGUARD_TCH_GPU_CHILD` naming it; the child runs the body, the parent checks it passed.
//!
//! Run on a GPU machine (see the crate README's "oomguard's allocator under libtorch"):
//! `cargo test --test allocator_gpu -- --ignored --test-threads=1`

use std::process::Command;

use oomguard::{ByteSize, IsOom};
use oomguard_tch::allocator::{self, InstallError};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

const CHILD: &str = "OOMGUARD_TCH_GPU_CHILD";

/// Runs `body` in a fresh process of this test binary (see the module docs).
fn in_own_process(name: &str, body: impl FnOnce()) {
    if std::env::var(CHILD).as_deref() == Ok(name) {
        body();
        return;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let out = Command::new(exe)
        .args([
            name,
            "--exact",
            "--include-ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, name)
        .output()
        .expect("running the test binary again");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "{name}, in its own process, failed:\n{text}"
    );
    assert!(
        text.contains("1 passed"),
        "{name} did not run in its own process:\n{text}"
    );
}

const GPU: Device = Device::Cuda(0);

/// Copies `src`'s variables into `dst`'s (same names).
fn copy_vars(dst: &nn::VarStore, src: &nn::VarStore) {
    let src = src.variables();
    tch::no_grad(|| {
        for (name, mut v) in dst.variables() {
            v.copy_(&src[&name]);
        }
    });
}

/// One SGD step of a Linear layer (forward, MSE loss, backward, step) on `dev`, from the
/// weights of `init`; its loss and the weights after the step, on the CPU.
fn linear_step(dev: Device, init: &nn::VarStore, x: &Tensor, y: &Tensor) -> (f64, Vec<Tensor>) {
    let vs = nn::VarStore::new(dev);
    let layer = nn::linear(vs.root() / "l", 512, 256, Default::default());
    copy_vars(&vs, init);
    let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
    let loss = layer
        .forward(&x.to_device(dev))
        .mse_loss(&y.to_device(dev), tch::Reduction::Mean);
    opt.backward_step(&loss);
    let mut vars: Vec<_> = vs.variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    (
        loss.double_value(&[]),
        vars.into_iter()
            .map(|(_, v)| v.to_device(Device::Cpu))
            .collect(),
    )
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_linear_training_step_is_served_by_oomguard() {
    in_own_process("a_linear_training_step_is_served_by_oomguard", || {
        let og = allocator::install(0).expect("install before any CUDA tensor");
        let after_install = allocator::counts();
        assert!(after_install.served_allocs >= 1 && after_install.served_frees >= 1);

        tch::manual_seed(7);
        let init = nn::VarStore::new(Device::Cpu);
        let _ = nn::linear(init.root() / "l", 512, 256, Default::default());
        let x = Tensor::randn([64, 512], (Kind::Float, Device::Cpu));
        let y = Tensor::randn([64, 256], (Kind::Float, Device::Cpu));

        let (loss_gpu, vars_gpu) = linear_step(GPU, &init, &x, &y);
        tch::Cuda::synchronize(0);
        let (loss_cpu, vars_cpu) = linear_step(Device::Cpu, &init, &x, &y);

        // The step computed on oomguard's memory is the CPU's step.
        assert!(
            (loss_gpu - loss_cpu).abs() <= 1e-4 * loss_cpu.abs(),
            "{loss_gpu} vs {loss_cpu}"
        );
        for (g, c) in vars_gpu.iter().zip(&vars_cpu) {
            let diff = (g - c).abs().max().double_value(&[]);
            assert!(diff < 1e-4, "a parameter differs by {diff} after the step");
        }
        // Every libtorch allocation went to oomguard: its device counts exactly them.
        let c = allocator::counts();
        assert!(
            c.served_allocs >= after_install.served_allocs + 8,
            "forward, backward and step served only {} allocations",
            c.served_allocs - after_install.served_allocs
        );
        let stats = og.stats();
        assert_eq!(stats.allocation.all.allocated, c.served_allocs);
        assert_eq!(stats.allocation.all.current, c.live);
        assert_eq!(c.unknown_frees, 0);
        assert_eq!(c.refused_allocs, 0);

        // A tensor made here and dropped on another thread comes back to oomguard.
        let t = Tensor::ones([1 << 20], (Kind::Float, GPU));
        let live = allocator::counts().live;
        std::thread::spawn(move || drop(t)).join().unwrap();
        assert_eq!(allocator::counts().live, live - 1);
        println!("served {c:?}; {}", og.memory_summary());
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn budgets_and_the_device_running_out_are_libtorch_out_of_memory() {
    in_own_process(
        "budgets_and_the_device_running_out_are_libtorch_out_of_memory",
        || {
            let og = allocator::install(0).unwrap();
            {
                let _budget = og.device_budget(ByteSize::mib(64));
                let err = Tensor::f_zeros([32 << 20], (Kind::Float, GPU)).unwrap_err();
                assert!(err.is_oom(), "{err}");
                assert!(oomguard_tch::tch_error_is_oom(&err));
                // libtorch's own text (tch's Display puts "Internal torch error: " in front)
                let tch::TchError::Torch(text) = &err else {
                    panic!("expected TchError::Torch, got {err:?}")
                };
                assert!(
                    text.starts_with("CUDA out of memory. Tried to allocate 128.00 MiB."),
                    "{text}"
                );
                assert!(allocator::take_last_error().unwrap().is_budget_exceeded());
                // tch's error is a budget's too, with its request and the budget's limit: the
                // retry engine skips the same-plan retry for it
                assert!(err.is_budget_exceeded(), "{text}");
                let r = err
                    .oom_request()
                    .expect("the refusal's request is in the text");
                assert_eq!(
                    (r.requested, r.capacity, r.budget),
                    (128 << 20, 64 << 20, true)
                );
                // the plain method panics with it; catch_oom makes it an error again
                let caught = oomguard_tch::catch_oom(|| {
                    Ok::<_, oomguard_tch::Error>(Tensor::zeros([32 << 20], (Kind::Float, GPU)))
                });
                let caught = caught.unwrap_err();
                assert!(caught.is_oom() && caught.is_budget_exceeded(), "{caught}");
                assert_eq!(caught.oom_request(), Some(r));
            }
            // The device itself running out: 1 TiB.
            let err = Tensor::f_zeros([1i64 << 38], (Kind::Float, GPU)).unwrap_err();
            assert!(err.is_oom(), "{err}");
            let e = allocator::take_last_error().unwrap();
            assert!(e.is_oom() && !e.is_budget_exceeded(), "{e}");
            assert!(!err.is_budget_exceeded(), "{err}");
            let r = err
                .oom_request()
                .expect("the refusal's request is in the text");
            assert!(!r.budget && r.exceeds_capacity(), "{r}");
            // and the budget gone, the same 128 MiB fits
            let t = Tensor::f_zeros([32 << 20], (Kind::Float, GPU)).unwrap();
            assert_eq!(t.sum(Kind::Float).double_value(&[]), 0.0);
            assert!(allocator::counts().refused_allocs >= 3);
        },
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn empty_cache_returns_what_tch_freed() {
    in_own_process("empty_cache_returns_what_tch_freed", || {
        let og = allocator::install(0).unwrap();
        let t = Tensor::ones([64 << 20], (Kind::Float, GPU)); // 256 MiB
        assert_eq!(t.sum(Kind::Float).double_value(&[]), (64u64 << 20) as f64);
        drop(t);
        let held = og.stats().reserved_bytes.all.current;
        assert!(held >= 256 << 20, "reserved {held} after a 256 MiB tensor");
        og.empty_cache().unwrap();
        let after = og.stats().reserved_bytes.all.current;
        assert!(after < 256 << 20, "reserved {after} after empty_cache");
        assert_eq!(allocator::counts().live, og.stats().allocation.all.current);
        // and tch allocates again afterwards
        let t = Tensor::ones([1024], (Kind::Float, GPU));
        assert_eq!(t.sum(Kind::Float).double_value(&[]), 1024.0);
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn install_after_a_cuda_tensor_is_refused_and_libtorch_keeps_its_allocator() {
    in_own_process(
        "install_after_a_cuda_tensor_is_refused_and_libtorch_keeps_its_allocator",
        || {
            let t = Tensor::ones([16], (Kind::Float, GPU));
            let err = allocator::install(0).unwrap_err();
            assert!(matches!(err, InstallError::TooLate(_)), "{err:?}");
            assert!(
                err.to_string().contains("before CUDA is initialised"),
                "{err}"
            );
            assert!(allocator::installed_device().is_none());
            let u = Tensor::ones([16], (Kind::Float, GPU));
            assert_eq!((t + u).sum(Kind::Float).double_value(&[]), 32.0);
            assert_eq!(allocator::counts(), allocator::Counts::default());
        },
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn install_twice_is_refused_with_the_serving_device() {
    in_own_process("install_twice_is_refused_with_the_serving_device", || {
        let og = allocator::install(0).unwrap();
        match allocator::install(0) {
            Err(InstallError::AlreadyInstalled(d)) => assert!(d.same_device(&og)),
            other => panic!("a second install must be refused: {other:?}"),
        }
        let missing = allocator::install(tch::Cuda::device_count() as usize + 1);
        assert!(matches!(missing, Err(InstallError::AlreadyInstalled(_))));
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_gpu_that_does_not_exist_is_named() {
    in_own_process("a_gpu_that_does_not_exist_is_named", || {
        let n = tch::Cuda::device_count() as usize;
        let err = allocator::install(n).unwrap_err();
        assert!(matches!(err, InstallError::NoCuda(_)), "{err:?}");
        assert!(
            err.to_string().contains(&format!("there is no GPU {n}")),
            "{err}"
        );
        // nothing half-installed: GPU 0 can still be installed
        allocator::install(0).unwrap();
    });
}
