//! The device a step that holds none runs on: the one its thread allocated on last.

use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;

use crate::retry::memory::DeviceKey;
use crate::Device;

/// Identities of the devices threads allocated on, as cached by [`thread_device_key`]: a
/// number no other (thread, device) pair had.
static DEVICE_EPOCHS: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// This thread's device: its weak handle, key and epoch.
    static DEVICE_CACHE: std::cell::RefCell<Option<(crate::device::WeakDevice, DeviceKey, u64)>> =
        const { std::cell::RefCell::new(None) };
}

/// The epoch of the device this thread allocated on last (`None`: none yet), cached with its
/// key: equal epochs mean equal device keys.
pub(super) fn thread_device_epoch() -> Option<u64> {
    let addr = Device::thread_device_addr();
    if addr == 0 {
        return None;
    }
    let cached = || {
        DEVICE_CACHE
            .try_with(|c| {
                c.borrow()
                    .as_ref()
                    .filter(|(w, _, _)| w.addr() == addr && w.alive())
                    .map(|(_, _, e)| *e)
            })
            .ok()
            .flatten()
    };
    cached().or_else(|| {
        // fills the cache
        let _ = thread_device_key();
        cached()
    })
}

/// The device key of a step that holds no device: the device this thread allocated on last.
/// Cached per thread (the device's name is a string the backend builds); the cache holds a
/// weak handle, so the address cannot belong to another device while it is cached.
pub(super) fn thread_device_key() -> DeviceKey {
    let addr = Device::thread_device_addr();
    if addr == 0 {
        // No oomguard allocation on this thread: code on another source (candle on a driver
        // pool). With exactly one such source, its device is the step's; otherwise "any".
        return match crate::source::registered().as_slice() {
            [one] => DeviceKey::of(&**one),
            _ => DeviceKey::any(),
        };
    }
    let cached = DEVICE_CACHE
        .try_with(|c| {
            c.borrow()
                .as_ref()
                .filter(|(w, _, _)| w.addr() == addr && w.alive())
                .map(|(_, k, _)| k.clone())
        })
        .ok()
        .flatten();
    if let Some(k) = cached {
        return k;
    }
    match Device::last_used_on_thread() {
        Some(d) => {
            let k = DeviceKey::of(&d);
            let epoch = DEVICE_EPOCHS.fetch_add(1, Relaxed);
            let _ = DEVICE_CACHE
                .try_with(|c| *c.borrow_mut() = Some((d.downgrade(), k.clone(), epoch)));
            k
        }
        None => DeviceKey::any(),
    }
}
