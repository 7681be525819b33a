//! `allocator::install` without a usable GPU: a clear error, nothing installed, no panic.
//! On a machine with a GPU it installs instead; then this test checks the install held.

use oomguard_tch::allocator::{self, InstallError};

#[test]
fn install_without_a_gpu_is_a_clear_error_and_installs_nothing() {
    if tch::Cuda::device_count() > 0 {
        // A GPU machine: install must succeed (before any CUDA tensor in this process).
        let dev = allocator::install(0).expect("install on a GPU machine");
        assert!(allocator::installed_device().unwrap().same_device(&dev));
        assert!(allocator::counts().served_allocs >= 1);
        return;
    }
    let err = allocator::install(0).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, InstallError::NoCuda(_)), "{err:?}");
    let expected = if option_env!("OOMGUARD_TCH_SHIM_CUDA") == Some("0") {
        "built without CUDA" // the shim (build.rs: no CUDA headers, or none asked for)
    } else {
        "no CUDA device"
    };
    assert!(text.contains(expected), "{text}");
    assert!(allocator::installed_device().is_none());
    assert_eq!(allocator::counts(), allocator::Counts::default());
    assert!(allocator::take_last_error().is_none());
    // Again: still the same answer (nothing half-installed by the first call).
    assert!(matches!(
        allocator::install(3),
        Err(InstallError::NoCuda(_))
    ));
    // CPU tensors are untouched by all this.
    let t = tch::Tensor::ones([4], (tch::Kind::Float, tch::Device::Cpu));
    assert_eq!(t.sum(tch::Kind::Float).double_value(&[]), 4.0);
}
