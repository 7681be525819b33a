//! oomguard's allocator under candle's CUDA tensors, on a real GPU (ignored without one: run by
//! `.gpu/run` on the H100, docs/GPU.md). The hook is process-wide, so every test shares one
//! installed device; run with `--test-threads=1`.

use std::sync::OnceLock;

use candle_core::{DType, Device, Tensor};
use oomguard::IsOom;
use oomguard_candle::alloc_hook;

fn hooked() -> &'static (Device, oomguard::Device) {
    static H: OnceLock<(Device, oomguard::Device)> = OnceLock::new();
    H.get_or_init(|| {
        let dev = Device::new_cuda(0).expect("a CUDA device");
        let og = alloc_hook::install(&dev).expect("install");
        (dev, og)
    })
}

#[test]
#[ignore = "needs a CUDA device"]
fn install_proves_itself_and_candle_tensors_are_oomguard_blocks() {
    let (dev, og) = hooked();
    let c0 = alloc_hook::counts();
    assert!(c0.served_allocs >= 1 && c0.served_frees >= 1, "{c0:?}");
    let before = og.stats().allocated_bytes.all.current;
    let a = Tensor::arange(0f32, 1024. * 1024., dev)
        .unwrap()
        .reshape((1024, 1024))
        .unwrap();
    let b = Tensor::ones((1024, 1024), DType::F32, dev).unwrap();
    let c = a.matmul(&b).unwrap();
    let during = og.stats().allocated_bytes.all.current;
    assert!(
        during >= before + 3 * 4 * 1024 * 1024,
        "{before} -> {during}"
    );
    // Correct result: row i of a·1 is the sum of row i of a.
    let row0: Vec<f32> = c.get(0).unwrap().to_vec1().unwrap();
    let want: f32 = (0..1024).map(|j| j as f32).sum();
    assert!(
        row0.iter().all(|&x| (x - want).abs() / want < 1e-3),
        "{}",
        row0[0]
    );
    drop((a, b, c));
    dev.synchronize().unwrap();
    assert_eq!(og.stats().allocated_bytes.all.current, before);
    og.allocator().check_invariants().unwrap();
    let c1 = alloc_hook::counts();
    println!("hook counts after a matmul: {c1:?}");
    assert!(c1.served_allocs >= c0.served_allocs + 3);
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_second_install_is_refused_with_the_serving_device() {
    let (dev, og) = hooked();
    match alloc_hook::install(dev) {
        Err(alloc_hook::InstallError::AlreadyInstalled(d)) => assert!(d.same_device(og)),
        other => panic!("{other:?}"),
    }
    assert!(alloc_hook::installed_device(dev).unwrap().same_device(og));
    assert!(matches!(
        alloc_hook::install(&Device::Cpu),
        Err(alloc_hook::InstallError::NotCuda(_))
    ));
}

#[test]
#[ignore = "needs a CUDA device"]
fn tensors_dropped_on_other_threads_stay_correct() {
    let (dev, og) = hooked();
    let before = og.stats().allocated_bytes.all.current;
    for round in 0..20 {
        let d = dev.clone();
        // Made and computed on one thread, dropped on another; meanwhile this thread reuses.
        let t = std::thread::spawn(move || {
            Tensor::full(round as f32, (256, 1024), &d)
                .unwrap()
                .exp()
                .unwrap()
        })
        .join()
        .unwrap();
        let h = std::thread::spawn(move || drop(t));
        let u = Tensor::full(1f32, (256, 1024), dev).unwrap();
        let s: f32 = (&u * 2.0).unwrap().sum_all().unwrap().to_scalar().unwrap();
        assert_eq!(s, 2.0 * 256.0 * 1024.0);
        h.join().unwrap();
    }
    dev.synchronize().unwrap();
    assert_eq!(og.stats().allocated_bytes.all.current, before);
    og.allocator().check_invariants().unwrap();
}

#[test]
#[ignore = "needs a CUDA device"]
fn out_of_memory_reaches_candle_as_the_drivers_oom() {
    let (dev, _og) = hooked();
    let _ = alloc_hook::take_last_error();
    let e = Tensor::zeros(200usize << 30, DType::U8, dev).unwrap_err();
    assert!(e.is_oom(), "classified as OOM: {e}");
    let why = alloc_hook::take_last_error().expect("oomguard's error");
    assert!(why.is_oom() && !why.is_budget_exceeded(), "{why}");
    // The device works afterwards.
    let t = Tensor::ones(1000, DType::F32, dev).unwrap();
    assert_eq!(t.sum_all().unwrap().to_scalar::<f32>().unwrap(), 1000.0);
}

#[test]
#[ignore = "needs a CUDA device"]
fn guards_see_candle_memory() {
    let (dev, og) = hooked();
    {
        let _budget = og.thread_budget(oomguard::ByteSize::mib(64));
        let ok = Tensor::zeros(8 << 20, DType::F32, dev).unwrap(); // 32 MiB
        let e = Tensor::zeros(16 << 20, DType::F32, dev).unwrap_err(); // 64 MiB more
        assert!(e.is_oom(), "{e}");
        assert!(alloc_hook::take_last_error().unwrap().is_budget_exceeded());
        drop(ok);
    }
    let leak = og.leak_check();
    let kept = Tensor::zeros(1 << 20, DType::F32, dev).unwrap();
    let report = leak.finish().unwrap_err();
    println!("{report}");
    drop(kept);
    let peak = og.peak_scope();
    let t = Tensor::zeros(4 << 20, DType::F32, dev).unwrap();
    drop(t);
    assert!(peak.peak_bytes() >= 16 << 20, "{}", peak.peak_bytes());
    let summary = og.memory_summary();
    assert!(summary.contains("Allocated memory"), "{summary}");
}

#[test]
#[ignore = "needs a CUDA device"]
fn memory_outside_the_hook_is_measured() {
    let (dev, og) = hooked();
    let t = Tensor::ones((4096, 4096), DType::F32, dev).unwrap();
    let _u = t.matmul(&t).unwrap();
    dev.synchronize().unwrap();
    let info = og.mem_info().unwrap();
    let used = info.total - info.free;
    let reserved = og.stats().reserved_bytes.all.current;
    println!(
        "RESULT unseen: device used {used} B, oomguard reserved {reserved} B, outside {} B",
        used - reserved
    );
    assert!(reserved <= used);
}
