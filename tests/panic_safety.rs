//! Panic safety: a panic inside a retried step, inside each guard's scope, and inside a step
//! while a budget and a leak check are active leaves the allocator consistent, nothing
//! allocated, the grad mode restored and no guard scope open.

use std::panic::{catch_unwind, AssertUnwindSafe};

use oomguard::{
    is_grad_enabled, leak_check, memory_budget, no_grad, oom_retry, ByteSize, Device, Error,
};

#[oom_retry(batch = rows)]
#[memory_budget("8 MiB")]
#[leak_check(action = error)]
#[no_grad]
fn step(dev: &Device, rows: usize, panic_at: usize) -> Result<usize, Error> {
    let mut held = Vec::new();
    for i in 0..rows {
        held.push(dev.alloc::<u8>(1 << 20)?);
        assert!(i != panic_at, "panic inside the step at row {i}");
    }
    Ok(held.len())
}

fn consistent(dev: &Device) {
    dev.allocator().check_invariants().unwrap();
    assert_eq!(dev.stats().allocated_bytes.all.current, 0);
    assert!(is_grad_enabled(), "grad mode restored");
    // no budget left open: a big allocation outside the step succeeds
    drop(dev.alloc::<u8>(64 << 20).unwrap());
}

#[test]
fn a_panic_inside_a_retried_guarded_step_leaves_everything_consistent() {
    let dev = Device::sim(ByteSize::gib(1));
    // rows 4: fits the 8 MiB budget; panic at row 2
    let r = catch_unwind(AssertUnwindSafe(|| step(&dev, 4, 2)));
    assert!(r.is_err());
    consistent(&dev);
    // rows 16: over budget, retried with halved batches (16 -> 8), then panics at row 5 of 8
    let r = catch_unwind(AssertUnwindSafe(|| step(&dev, 16, 5)));
    assert!(r.is_err());
    consistent(&dev);
    // and the same function still works afterwards
    assert_eq!(step(&dev, 16, usize::MAX).unwrap(), 8);
    consistent(&dev);
}

#[test]
fn a_panic_inside_each_guard_scope_closes_it() {
    let dev = Device::sim(ByteSize::gib(1));
    for name in [
        "budget",
        "device budget",
        "peak scope",
        "thread budget",
        "no_grad",
    ] {
        let r = catch_unwind(AssertUnwindSafe(|| {
            let _b = (name == "budget").then(|| dev.thread_budget(ByteSize::mib(1)));
            let _d = (name == "device budget").then(|| dev.device_budget(ByteSize::mib(1)));
            let _p = (name == "peak scope").then(|| dev.peak_scope());
            let _t =
                (name == "thread budget").then(|| oomguard::guard::thread_budget(ByteSize::mib(1)));
            let _g = (name == "no_grad").then(no_grad);
            let _kept = dev.alloc::<u8>(1000).unwrap();
            panic!("boom in {name}");
        }));
        assert!(r.is_err(), "{name}");
        consistent(&dev);
    }
    // a leak check that is unwinding reports instead of panicking twice
    let r = catch_unwind(AssertUnwindSafe(|| {
        let _check = dev.leak_check();
        let kept = dev.alloc::<u8>(1000).unwrap();
        std::mem::forget(kept); // really leaked: the block stays allocated
        panic!("boom in leak check");
    }));
    assert!(r.is_err());
    assert_eq!(dev.stats().allocated_bytes.all.current, 512 * 2);
}
