//! `OOMGUARD_ALLOC_CONF` is read by default, as PyTorch reads `PYTORCH_CUDA_ALLOC_CONF` (issue 16
//! point 18). One test in its own binary: the environment is process-wide.

use oomguard_runtime::backend::sim::SimDevice;
use oomguard_runtime::config::ENV_VAR;
use oomguard_runtime::{AllocatorConfig, ByteSize, Device, Error};

#[test]
fn p18_the_environment_variable_configures_devices_unless_a_config_is_given() {
    std::env::set_var(ENV_VAR, "expandable_segments:False,max_split_size_mb:64");
    let dev = Device::sim(ByteSize::gib(1));
    assert!(!dev.allocator().uses_growable_segments());
    assert_eq!(dev.allocator().config().max_split_size, 64 << 20);
    let dev = Device::try_sim(ByteSize::gib(1)).unwrap();
    assert!(!dev.allocator().uses_growable_segments());
    // an explicit configuration overrides the variable
    let dev = Device::new(SimDevice::new(ByteSize::gib(1)), AllocatorConfig::default());
    assert!(dev.allocator().uses_growable_segments());

    // a bad value: a clear error where the constructor can return one
    std::env::set_var(ENV_VAR, "expandable_segments:maybe");
    let e = Device::try_sim(ByteSize::gib(1)).unwrap_err();
    assert!(matches!(e, Error::Config(_)), "{e}");
    let m = e.to_string();
    assert!(
        m.contains("expandable_segments") && m.contains(ENV_VAR),
        "{m}"
    );
    #[cfg(feature = "cuda")]
    {
        let e = Device::cuda(0).unwrap_err();
        assert!(
            matches!(e, Error::Config(_)),
            "checked before the driver: {e}"
        );
    }
    // the infallible constructor logs and uses the default
    let dev = Device::sim(ByteSize::gib(1));
    assert!(dev.allocator().uses_growable_segments());

    std::env::remove_var(ENV_VAR);
    assert!(Device::sim(ByteSize::gib(1))
        .allocator()
        .uses_growable_segments());
}
