//! libtorch's CUDA allocator through the shim, with no CUDA device visible: every call is a
//! clear error, nothing panics, and bad arguments are refused before any device is looked for.
//!
//! One test function: it hides every device (`CUDA_VISIBLE_DEVICES=""`) before libtorch first
//! counts them (c10 counts once per process), so it means the same on a machine with a GPU.

use oomguard::backend::BackendErrorKind;
use oomguard_tch::cuda_allocator as alloc;
use oomguard_tch::memory_history::{self, HistoryOptions};
use oomguard_tch::LibtorchCudaSource;

fn unavailable(r: oomguard::Result<impl std::fmt::Debug>, op: &str) {
    match r {
        Err(oomguard::Error::Backend(b)) => {
            assert_eq!(b.kind, BackendErrorKind::Unavailable, "{op}: {b}");
            assert!(
                b.message.contains("no CUDA device") || b.message.contains("without CUDA"),
                "{op}: {b}"
            );
            assert!(!oomguard::Error::Backend(b).is_oom(), "{op}");
        }
        other => panic!("{op}: expected an Unavailable backend error, got {other:?}"),
    }
}

fn invalid(r: oomguard::Result<impl std::fmt::Debug>, what: &str) {
    match r {
        Err(oomguard::Error::InvalidArgument(m)) => assert!(m.contains(what), "{m}"),
        other => panic!("expected InvalidArgument naming {what:?}, got {other:?}"),
    }
}

#[test]
fn without_a_device_every_call_is_a_clear_error() {
    // SAFETY (of the environment write): no other thread of this test binary exists yet that
    // reads the environment (this is its only test), and libtorch has not counted devices.
    std::env::set_var("CUDA_VISIBLE_DEVICES", "");

    assert_eq!(alloc::cuda_device_count(), 0);
    // CI builds this test a second time with the shim built without CUDA: make sure it was
    if option_env!("OOMGUARD_TCH_CUDA_INCLUDE") == Some("none") {
        assert!(
            !alloc::built_with_cuda(),
            "OOMGUARD_TCH_CUDA_INCLUDE=none built a CUDA shim"
        );
    }

    // the source itself
    unavailable(LibtorchCudaSource::new(0), "LibtorchCudaSource::new");
    let e = LibtorchCudaSource::new(0).unwrap_err().to_string();
    if alloc::built_with_cuda() {
        assert_eq!(
            e,
            "device error: CUDAAllocator::getMemoryInfo: no CUDA device: libtorch counts 0 (no \
             NVIDIA driver, or no visible device)"
        );
    } else {
        // a shim built without CUDA (OOMGUARD_TCH_CUDA_INCLUDE=none) says that instead
        assert!(
            e.contains("oomguard-tch's shim was built against a libtorch without CUDA"),
            "{e}"
        );
    }
    invalid(LibtorchCudaSource::of(tch::Device::Cpu), "Cpu");

    // each allocator call
    unavailable(alloc::device_info(0), "device_info");
    unavailable(alloc::device_stats(0), "device_stats");
    unavailable(alloc::reset_peak_stats(0), "reset_peak_stats");
    unavailable(alloc::reset_accumulated_stats(0), "reset_accumulated_stats");
    unavailable(alloc::empty_cache(0), "empty_cache");
    unavailable(alloc::memory_fraction(0), "memory_fraction");
    unavailable(alloc::set_memory_fraction(0, 0.5), "set_memory_fraction");
    unavailable(alloc::allocator_info(), "allocator_info");
    unavailable(
        memory_history::record_history(HistoryOptions::default()),
        "record_history",
    );
    unavailable(memory_history::stop_history(), "stop_history");
    unavailable(memory_history::snapshot_pickle(), "snapshot_pickle");

    // arguments are checked first (by the shim, in C++, for the fraction), whatever the device
    for f in [0.0, -0.25, 1.5, f64::NAN, f64::INFINITY] {
        invalid(alloc::set_memory_fraction(0, f), "it must be in (0, 1]");
    }
    invalid(alloc::device_stats(usize::MAX), "not a device index");
    invalid(
        memory_history::record_history(HistoryOptions {
            max_entries: 0,
            ..HistoryOptions::default()
        }),
        "max_entries of 0",
    );

    // a snapshot that cannot be taken writes no file, and says why
    let dir = std::env::temp_dir().join(format!("oomguard-tch-no-device-{}", std::process::id()));
    let path = dir.join("snapshot.pickle");
    let e = memory_history::write_snapshot(&path)
        .unwrap_err()
        .to_string();
    let why = if alloc::built_with_cuda() {
        "no CUDA device"
    } else {
        "built against a libtorch without CUDA"
    };
    assert!(e.contains(why), "{e}");
    assert!(!path.exists());

    // tch agrees that there is no device (the shim and tch share one libtorch)
    assert!(!tch::Cuda::is_available());
}
