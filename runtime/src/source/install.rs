//! The text of the install failures that every framework's hook of oomguard's allocator shares
//! (oomguard-candle's `alloc_hook::install`, oomguard-tch's `allocator::install`): each crate's
//! `InstallError` keeps its own variants and writes these through one [`InstallSite`].

use std::fmt;

use crate::{Device, Error};

/// Where a framework crate installs oomguard's allocator, as its install errors name it.
#[derive(Clone, Copy, Debug)]
pub struct InstallSite {
    /// What oomguard's allocator serves once installed (`"libtorch"`).
    pub serves: &'static str,
    /// The module of `install` and `installed_device` (`"oomguard_tch::allocator"`).
    pub module: &'static str,
    /// Why a failed install may leave oomguard serving (`"memory it served is still live"`).
    pub still_serving: &'static str,
}

impl InstallSite {
    /// The text of `AlreadyInstalled(device)`: oomguard serves this site already, on `device`.
    pub fn already_installed(&self, f: &mut fmt::Formatter<'_>, device: &Device) -> fmt::Result {
        let (serves, name, module) = (self.serves, device.name(), self.module);
        write!(
            f,
            "oomguard's allocator serves {serves} already, on {name} (use the Device install \
             returned, or {module}::installed_device)"
        )
    }

    /// The text of `Device(error)`: opening oomguard's device failed.
    pub fn device_failed(&self, f: &mut fmt::Formatter<'_>, error: &Error) -> fmt::Result {
        write!(f, "opening oomguard's device failed: {error}")
    }

    /// The text of `StillServing { cause, device }`: install failed, and oomguard keeps serving.
    pub fn still_serving(
        &self,
        f: &mut fmt::Formatter<'_>,
        cause: &dyn fmt::Display,
        device: &Device,
    ) -> fmt::Result {
        let (serves, name, module) = (self.serves, device.name(), self.module);
        write!(
            f,
            "{cause}; but oomguard keeps serving {serves} on {name} ({}; \
             {module}::installed_device returns the device)",
            self.still_serving
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ByteSize;

    struct Shown<F: Fn(&mut fmt::Formatter<'_>) -> fmt::Result>(F);
    impl<F: Fn(&mut fmt::Formatter<'_>) -> fmt::Result> fmt::Display for Shown<F> {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            (self.0)(f)
        }
    }

    #[test]
    fn texts_name_the_site_the_device_and_the_way_back() {
        let site = InstallSite {
            serves: "libtorch",
            module: "oomguard_tch::allocator",
            still_serving: "memory it served is still live",
        };
        let dev = Device::sim(ByteSize::mib(1));
        let name = dev.name();
        let already = Shown(|f| site.already_installed(f, &dev)).to_string();
        assert!(already.starts_with("oomguard's allocator serves libtorch already"));
        assert!(already.contains(&name), "{already}");
        assert!(already.contains("oomguard_tch::allocator::installed_device"));
        let still = Shown(|f| site.still_serving(f, &"no CUDA", &dev)).to_string();
        assert!(still.starts_with("no CUDA; but oomguard keeps serving libtorch on "));
        assert!(still.contains("(memory it served is still live; oomguard_tch::allocator"));
        let err = dev.alloc::<u8>(2 << 20).unwrap_err();
        let failed = Shown(|f| site.device_failed(f, &err)).to_string();
        assert_eq!(failed, format!("opening oomguard's device failed: {err}"));
    }
}
