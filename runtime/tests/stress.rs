//! Concurrency stress: many threads of random alloc/free/empty_cache/record_stream on one
//! allocator, in both modes; afterwards no block is lost or doubled, stats equal a recount and
//! nothing is reserved after freeing all and emptying the cache.

use std::sync::Arc;

use oomguard_runtime::backend::sim::SimDevice;
use oomguard_runtime::{AllocatorConfig, ByteSize, CachingAllocator};

#[test]
fn twelve_threads_of_random_operations() {
    for cfg in [AllocatorConfig::default(), AllocatorConfig::native()] {
        let sim = SimDevice::address_only(ByteSize::gib(2));
        let a = Arc::new(CachingAllocator::new(Arc::new(sim.clone()), cfg));
        let ooms = std::sync::atomic::AtomicU64::new(0);
        std::thread::scope(|s| {
            for t in 0..12u64 {
                let (a, ooms) = (&a, &ooms);
                s.spawn(move || {
                    let mut rng = 0x1234_5678u64 ^ (t << 32);
                    let mut next = move || {
                        rng ^= rng << 13;
                        rng ^= rng >> 7;
                        rng ^= rng << 17;
                        rng
                    };
                    let mut live = Vec::new();
                    for _ in 0..4000 {
                        let r = next();
                        match r % 10 {
                            0..=5 => {
                                let size = match r % 3 {
                                    0 => (r >> 8) % 4096 + 1,
                                    1 => (r >> 8) % (1 << 20) + 1,
                                    _ => (r >> 8) % (32 << 20) + 1,
                                };
                                match a.allocate(size, (r >> 40) % 3) {
                                    Ok(x) => live.push(x),
                                    Err(e) => {
                                        assert!(e.is_oom(), "{e}");
                                        ooms.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                                    }
                                }
                            }
                            6..=8 if !live.is_empty() => {
                                let i = (r >> 8) as usize % live.len();
                                a.free(live.swap_remove(i)).unwrap();
                            }
                            9 if r % 7 == 0 => a.empty_cache().unwrap(),
                            9 if !live.is_empty() => {
                                let x = live[(r >> 8) as usize % live.len()];
                                a.record_stream(&x, 3).unwrap();
                            }
                            _ => {}
                        }
                    }
                    for x in live {
                        a.free(x).unwrap();
                    }
                });
            }
        });
        a.check_invariants().unwrap();
        let s = a.stats();
        assert_eq!(s.allocated_bytes.all.current, 0);
        assert_eq!(s.num_ooms, ooms.into_inner());
        a.empty_cache().unwrap();
        a.check_invariants().unwrap();
        let s = a.stats();
        assert_eq!(s.active_bytes.all.current, 0, "pending frees completed");
        assert_eq!(s.reserved_bytes.all.current, 0);
        assert_eq!(sim.used(), 0);
    }
}

/// Eight threads allocate through a `Device` while opening and closing budgets, peak scopes and
/// a device-wide budget, and hand buffers to each other to free: afterwards nothing is lost or
/// doubled and every scope's accounting is back to zero.
#[test]
fn eight_threads_with_guard_scopes_and_cross_thread_frees() {
    use oomguard_runtime::Device;
    let sim = SimDevice::new(ByteSize::gib(2));
    let dev = Device::new(sim.clone(), AllocatorConfig::default());
    let (tx, rx) = std::sync::mpsc::channel::<oomguard_runtime::DeviceBuffer<u8>>();
    let rx = std::sync::Mutex::new(rx);
    let wide = dev.device_budget(ByteSize::gib(1));
    std::thread::scope(|s| {
        for t in 0..8u64 {
            let (dev, tx, rx) = (dev.clone(), tx.clone(), &rx);
            s.spawn(move || {
                let mut rng = 0x9e37_79b9u64 ^ (t << 20);
                let mut next = move || {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    rng
                };
                for _ in 0..300 {
                    let r = next();
                    let budget = (r % 3 == 0).then(|| dev.thread_budget(ByteSize::mib(8)));
                    let peak = (r % 5 == 0).then(|| dev.peak_scope());
                    let mut held = Vec::new();
                    for _ in 0..(r >> 8) % 6 {
                        match dev.alloc::<u8>(((next() >> 8) % (3 << 20)) as usize + 1) {
                            Ok(b) => held.push(b),
                            Err(e) => assert!(e.is_oom(), "{e}"),
                        }
                    }
                    if let Some(b) = &budget {
                        assert!(b.used() <= 8 << 20);
                    }
                    // give some buffers to another thread to free, take some back
                    if let Some(b) = held.pop() {
                        tx.send(b).unwrap();
                    }
                    if let Ok(b) = rx.lock().unwrap().try_recv() {
                        drop(b);
                    }
                    drop(held);
                    drop(peak);
                    drop(budget);
                }
            });
        }
    });
    drop(tx);
    for b in rx.into_inner().unwrap().try_iter() {
        drop(b);
    }
    assert_eq!(
        wide.used(),
        0,
        "every charge to the device-wide budget was credited back"
    );
    drop(wide);
    dev.allocator().check_invariants().unwrap();
    assert_eq!(dev.stats().allocated_bytes.all.current, 0);
    dev.empty_cache().unwrap();
    assert_eq!(sim.used(), 0);
}
