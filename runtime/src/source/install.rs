//! The texts of the install failures that every framework's hook of oomguard's allocator shares
//! (oomguard-candle's `alloc_hook::install`, oomguard-tch's `allocator::install`): each crate's
//! `InstallError` keeps its own variants and words these through one [`InstallSite`].

use std::fmt::Display;

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
    /// `AlreadyInstalled(device)`'s text: oomguard serves this site already, on `device`.
    pub fn already_installed(&self, device: &Device) -> String {
        let (serves, name, module) = (self.serves, device.name(), self.module);
        format!(
            "oomguard's allocator serves {serves} already, on {name} (use the Device install \
             returned, or {module}::installed_device)"
        )
    }

    /// `Device(error)`'s text: opening oomguard's device failed.
    pub fn device_failed(&self, error: &Error) -> String {
        format!("opening oomguard's device failed: {error}")
    }

    /// `StillServing { cause, device }`'s text: install failed, and oomguard keeps serving.
    pub fn still_serving(&self, cause: &dyn Display, device: &Device) -> String {
        let (serves, name, module) = (self.serves, device.name(), self.module);
        format!(
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

    #[test]
    fn texts_name_the_site_the_device_and_the_way_back() {
        let site = InstallSite {
            serves: "libtorch",
            module: "oomguard_tch::allocator",
            still_serving: "memory it served is still live",
        };
        let dev = Device::sim(ByteSize::mib(1));
        let already = site.already_installed(&dev);
        assert!(already.starts_with("oomguard's allocator serves libtorch already, on "));
        assert!(already.contains(&dev.name()), "{already}");
        assert!(
            already.ends_with("oomguard_tch::allocator::installed_device)"),
            "{already}"
        );
        let still = site.still_serving(&"no CUDA", &dev);
        assert!(still.starts_with("no CUDA; but oomguard keeps serving libtorch on "));
        assert!(still.ends_with("(memory it served is still live; oomguard_tch::allocator::installed_device returns the device)"), "{still}");
        let err = dev.alloc::<u8>(2 << 20).unwrap_err();
        let failed = format!("opening oomguard's device failed: {err}");
        assert_eq!(site.device_failed(&err), failed);
    }
}
