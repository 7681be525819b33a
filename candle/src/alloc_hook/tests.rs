//! The hook's logic on the simulated device, with the driver replaced by a fake that records
//! what reaches it (CI has no GPU; the real symbols are proven on the H100, docs/GPU.md).

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use oomguard::backend::sim::SimDevice;
use oomguard::{AllocatorConfig, ByteSize, Device, IsOom};
use parking_lot::Mutex;

use super::interposer::{status, stream_id, Driver, Interposer};

thread_local! {
    /// The fake driver's current context on this thread (0: none).
    static CONTEXT: Cell<u64> = const { Cell::new(0) };
}

fn set_context(ctx: u64) {
    CONTEXT.with(|c| c.set(ctx));
}

/// A driver that hands out addresses from a range no simulated device uses and records calls.
#[derive(Default)]
struct FakeDriver {
    next: AtomicU64,
    calls: Mutex<Vec<String>>,
    capturing: Mutex<Vec<u64>>,
}

const DRIVER_BASE: u64 = 0x7f00_0000_0000;

impl FakeDriver {
    fn calls(&self) -> Vec<String> {
        self.calls.lock().clone()
    }
    fn give(&self) -> u64 {
        DRIVER_BASE + self.next.fetch_add(1, Relaxed) * 0x1000
    }
}

impl Driver for FakeDriver {
    fn alloc_async(&self, bytes: usize, stream: u64) -> Result<u64, u32> {
        self.calls
            .lock()
            .push(format!("alloc_async {bytes} {stream:#x}"));
        Ok(if bytes == 0 { 0 } else { self.give() })
    }
    fn free_async(&self, ptr: u64, stream: u64) -> u32 {
        self.calls
            .lock()
            .push(format!("free_async {ptr:#x} {stream:#x}"));
        status::SUCCESS
    }
    fn alloc(&self, bytes: usize) -> Result<u64, u32> {
        self.calls.lock().push(format!("alloc {bytes}"));
        if bytes == 0 {
            return Err(status::INVALID_VALUE);
        }
        Ok(self.give())
    }
    fn free(&self, ptr: u64) -> u32 {
        self.calls.lock().push(format!("free {ptr:#x}"));
        status::SUCCESS
    }
    fn current_context(&self) -> Option<u64> {
        Some(CONTEXT.with(Cell::get)).filter(|&c| c != 0)
    }
    fn is_capturing(&self, stream: u64) -> bool {
        self.capturing.lock().contains(&stream)
    }
}

const CTX: u64 = 0xc0;
const PTDS: u64 = 0x2;

fn sim_device(capacity: ByteSize) -> (Device, Arc<SimDevice>) {
    let sim = Arc::new(SimDevice::new(capacity).with_pending_events());
    let dev = Device::from_arc(sim.clone(), AllocatorConfig::default());
    (dev, sim)
}

fn hook_with(capacity: ByteSize) -> (Interposer<FakeDriver>, Device, Arc<SimDevice>) {
    let hook = Interposer::new(FakeDriver::default());
    let (dev, sim) = sim_device(capacity);
    hook.serve(CTX, dev.clone()).ok().unwrap();
    set_context(CTX);
    (hook, dev, sim)
}

#[test]
fn before_serving_every_call_goes_to_the_driver() {
    let hook = Interposer::new(FakeDriver::default());
    set_context(CTX);
    let p = hook.alloc_async(4096, PTDS).unwrap();
    assert!(p >= DRIVER_BASE);
    assert_eq!(hook.free_async(p, PTDS), status::SUCCESS);
    let q = hook.alloc(100).unwrap();
    assert_eq!(hook.free(q), status::SUCCESS);
    assert_eq!(hook.driver.calls().len(), 4, "{:?}", hook.driver.calls());
    assert_eq!(hook.counts().passed_to_driver, 4);
    assert_eq!(hook.counts().served_allocs, 0);
}

#[test]
fn served_allocations_are_blocks_of_the_allocator() {
    let (hook, dev, _sim) = hook_with(ByteSize::gib(1));
    let p = hook.alloc_async(1000, PTDS).unwrap();
    assert!(p < DRIVER_BASE, "served by the simulated device: {p:#x}");
    assert_eq!(p % 256, 0, "aligned to at least 256 bytes");
    assert_eq!(dev.stats().allocated_bytes.all.current, 1024); // 1000 rounded to 512 B
    let q = hook.alloc(3 << 20).unwrap();
    assert_eq!(q % 256, 0);
    assert!(hook.driver.calls().is_empty(), "{:?}", hook.driver.calls());
    assert_eq!(hook.free_async(p, PTDS), status::SUCCESS);
    assert_eq!(hook.free(q), status::SUCCESS);
    assert_eq!(dev.stats().allocated_bytes.all.current, 0);
    assert!(
        dev.stats().reserved_bytes.all.current > 0,
        "kept in the cache"
    );
    let c = hook.counts();
    assert_eq!(
        (c.served_allocs, c.served_frees, c.passed_to_driver),
        (2, 2, 0)
    );
    dev.allocator().check_invariants().unwrap();
}

#[test]
fn a_context_that_is_not_served_goes_to_the_driver() {
    let (hook, dev, _sim) = hook_with(ByteSize::gib(1));
    set_context(0xbad);
    let p = hook.alloc_async(4096, PTDS).unwrap();
    assert!(p >= DRIVER_BASE);
    set_context(0);
    let q = hook.alloc_async(4096, PTDS).unwrap();
    assert!(q >= DRIVER_BASE, "no current context: the driver answers");
    assert_eq!(dev.stats().allocated_bytes.all.current, 0);
}

#[test]
fn frees_of_pointers_oomguard_did_not_make_go_to_the_driver() {
    let (hook, dev, _sim) = hook_with(ByteSize::gib(1));
    // Allocated by the driver (before install, in our terms), freed after.
    let foreign = DRIVER_BASE + 0x5000;
    assert_eq!(hook.free_async(foreign, PTDS), status::SUCCESS);
    assert_eq!(hook.free(foreign + 0x1000), status::SUCCESS);
    assert_eq!(
        hook.driver.calls(),
        vec![
            format!("free_async {foreign:#x} 0x2"),
            format!("free {:#x}", foreign + 0x1000)
        ]
    );
    // A served pointer freed twice: the second free is not ours any more.
    let p = hook.alloc_async(512, PTDS).unwrap();
    assert_eq!(hook.free_async(p, PTDS), status::SUCCESS);
    assert_eq!(hook.free_async(p, PTDS), status::SUCCESS);
    assert_eq!(hook.driver.calls().len(), 3);
    dev.allocator().check_invariants().unwrap();
}

#[test]
fn zero_byte_requests_get_the_drivers_answer() {
    let (hook, dev, _sim) = hook_with(ByteSize::gib(1));
    // cudarc's CudaStream::null allocates 0 bytes; whatever the driver says is the answer.
    assert_eq!(hook.alloc_async(0, PTDS), Ok(0));
    assert_eq!(hook.alloc(0), Err(status::INVALID_VALUE));
    assert_eq!(hook.driver.calls(), vec!["alloc_async 0 0x2", "alloc 0"]);
    assert_eq!(dev.stats().allocation.all.current, 0);
}

#[test]
fn graph_capture_is_left_to_the_driver() {
    let (hook, dev, _sim) = hook_with(ByteSize::gib(1));
    let capturing = 0x5555_0000;
    hook.driver.capturing.lock().push(capturing);
    let p = hook.alloc_async(1 << 20, capturing).unwrap();
    assert!(
        p >= DRIVER_BASE,
        "a graph's memory node, not a cached block"
    );
    assert_eq!(hook.free_async(p, capturing), status::SUCCESS);
    assert_eq!(hook.driver.calls().len(), 2);
    assert_eq!(dev.stats().allocation.all.current, 0);
    // The same context on a stream that does not capture is served.
    let q = hook.alloc_async(1 << 20, PTDS).unwrap();
    assert!(q < DRIVER_BASE);
}

#[test]
fn out_of_memory_is_the_drivers_status_with_the_oomguard_error_kept() {
    let (hook, _dev, _sim) = hook_with(ByteSize::mib(64));
    let _ = super::take_last_error();
    assert_eq!(
        hook.alloc_async(128 << 20, PTDS),
        Err(status::OUT_OF_MEMORY)
    );
    let e = super::take_last_error().expect("the error behind the status");
    assert!(e.is_oom() && !e.is_budget_exceeded(), "{e}");
    assert!(super::take_last_error().is_none(), "taken once");
    assert!(
        hook.driver.calls().is_empty(),
        "never forwarded after oomguard said no"
    );
}

#[test]
fn a_budget_on_the_device_caps_candle_memory_too() {
    let (hook, dev, _sim) = hook_with(ByteSize::gib(1));
    let budget = dev.thread_budget(ByteSize::mib(4));
    let p = hook.alloc_async(3 << 20, PTDS).unwrap();
    assert_eq!(hook.alloc_async(2 << 20, PTDS), Err(status::OUT_OF_MEMORY));
    let e = super::take_last_error().unwrap();
    assert!(e.is_budget_exceeded(), "{e}");
    assert_eq!(hook.free_async(p, PTDS), status::SUCCESS);
    drop(budget);
    let leak = dev.leak_check();
    let q = hook.alloc_async(1 << 20, PTDS).unwrap();
    let report = leak.finish();
    assert!(
        report.is_err(),
        "the leak check sees the hook's live allocation"
    );
    assert_eq!(hook.free_async(q, PTDS), status::SUCCESS);
}

#[test]
fn each_thread_s_per_thread_stream_is_its_own_pool() {
    let (hook, dev, _sim) = hook_with(ByteSize::gib(1));
    let hook = Arc::new(hook);
    let p = hook.alloc_async(1 << 20, PTDS).unwrap();
    assert_eq!(hook.free_async(p, PTDS), status::SUCCESS);
    // Same thread, same stream: the cached block comes back.
    let p2 = hook.alloc_async(1 << 20, PTDS).unwrap();
    assert_eq!(p2, p);
    assert_eq!(hook.free_async(p2, PTDS), status::SUCCESS);
    // Another thread on "the same" handle 0x2 is another stream: never that block, which work
    // on this thread's stream may still be using.
    let h = Arc::clone(&hook);
    let (q, other_id) = std::thread::spawn(move || {
        set_context(CTX);
        let q = h.alloc_async(1 << 20, PTDS).unwrap();
        assert_eq!(h.free_async(q, PTDS), status::SUCCESS);
        (q, stream_id(PTDS))
    })
    .join()
    .unwrap();
    assert_ne!(q, p);
    assert_ne!(other_id, stream_id(PTDS));
    assert_eq!(stream_id(0), 0);
    assert_eq!(
        stream_id(1),
        0,
        "CU_STREAM_LEGACY is the legacy default stream"
    );
    dev.allocator().check_invariants().unwrap();
}

#[test]
fn a_tensor_dropped_on_another_thread_waits_for_that_thread_s_stream() {
    let (hook, dev, sim) = hook_with(ByteSize::gib(1));
    let hook = Arc::new(hook);
    let p = hook.alloc_async(1 << 20, PTDS).unwrap();
    let h = Arc::clone(&hook);
    // Freed on another thread (candle tensors are Send): its per-thread stream may still have
    // work using the block queued, so the block waits for an event there.
    let freeing_stream = std::thread::spawn(move || {
        set_context(CTX);
        assert_eq!(h.free_async(p, PTDS), status::SUCCESS);
        stream_id(PTDS)
    })
    .join()
    .unwrap();
    assert_eq!(
        sim.pending_events(),
        1,
        "an event on the freeing thread's stream"
    );
    let q = hook.alloc_async(1 << 20, PTDS).unwrap();
    assert_ne!(q, p, "not reused before the freeing stream passed the free");
    assert_eq!(hook.free_async(q, PTDS), status::SUCCESS);
    sim.synchronize_stream(freeing_stream);
    dev.allocator().check_invariants().unwrap();
    // Once the event completed, the block is free for the allocating thread again.
    let got: Vec<u64> = (0..2)
        .map(|_| hook.alloc_async(1 << 20, PTDS).unwrap())
        .collect();
    assert!(got.contains(&p), "{got:x?} {p:#x}");
}

#[test]
fn a_legacy_free_of_a_stream_allocation_waits_for_the_legacy_stream() {
    let (hook, _dev, sim) = hook_with(ByteSize::gib(1));
    let p = hook.alloc_async(1 << 20, PTDS).unwrap();
    assert_eq!(hook.free(p), status::SUCCESS); // cuMemFree_v2: no stream, any may use it
    assert_eq!(sim.pending_events(), 1, "an event on the legacy stream");
    let q = hook.alloc_async(1 << 20, PTDS).unwrap();
    assert_ne!(q, p, "not reused before the legacy stream passed the free");
    sim.synchronize_stream(0);
    let r = hook.alloc_async(1 << 20, PTDS).unwrap();
    assert_eq!(r, p, "reused once the event completed");
}

#[test]
fn several_gpus_each_have_their_own_allocator() {
    let hook = Interposer::new(FakeDriver::default());
    let (a, _) = sim_device(ByteSize::gib(1));
    let (b, _) = sim_device(ByteSize::gib(1));
    hook.serve(0xa, a.clone()).ok().unwrap();
    hook.serve(0xb, b.clone()).ok().unwrap();
    assert!(
        hook.serve(0xb, a.clone()).is_err(),
        "one device per context"
    );
    set_context(0xa);
    let pa = hook.alloc_async(1 << 20, PTDS).unwrap();
    set_context(0xb);
    let pb = hook.alloc_async(2 << 20, PTDS).unwrap();
    assert_eq!(a.stats().allocated_bytes.all.current, 1 << 20);
    assert_eq!(b.stats().allocated_bytes.all.current, 2 << 20);
    // A free finds its device whatever context is current.
    assert_eq!(hook.free_async(pa, PTDS), status::SUCCESS);
    assert_eq!(a.stats().allocated_bytes.all.current, 0);
    set_context(0xa);
    assert_eq!(hook.free_async(pb, PTDS), status::SUCCESS);
    assert_eq!(b.stats().allocated_bytes.all.current, 0);
    assert!(hook.driver.calls().is_empty());
}

#[test]
fn unserving_is_refused_while_memory_is_live() {
    let (hook, _dev, _sim) = hook_with(ByteSize::gib(1));
    let p = hook.alloc_async(4096, PTDS).unwrap();
    assert!(!hook.unserve_if_idle(CTX));
    assert_eq!(hook.free_async(p, PTDS), status::SUCCESS);
    assert!(hook.unserve_if_idle(CTX));
    assert!(hook.alloc_async(4096, PTDS).unwrap() >= DRIVER_BASE);
}

#[test]
fn many_threads_allocate_and_free_across_threads() {
    let (hook, dev, _sim) = hook_with(ByteSize::gib(4));
    let hook = Arc::new(hook);
    let (tx, rx) = std::sync::mpsc::channel::<u64>();
    let producers: Vec<_> = (0..4)
        .map(|t| {
            let h = Arc::clone(&hook);
            let tx = tx.clone();
            std::thread::spawn(move || {
                set_context(CTX);
                for i in 0..200u64 {
                    let p = h
                        .alloc_async(((i % 7) as usize + 1) * 100_000 + t, PTDS)
                        .unwrap();
                    tx.send(p).unwrap();
                }
            })
        })
        .collect();
    drop(tx);
    let h = Arc::clone(&hook);
    let consumer = std::thread::spawn(move || {
        set_context(CTX);
        rx.iter()
            .filter(|&p| h.free_async(p, PTDS) == status::SUCCESS)
            .count()
    });
    for p in producers {
        p.join().unwrap();
    }
    assert_eq!(consumer.join().unwrap(), 800);
    assert_eq!(dev.stats().allocated_bytes.all.current, 0);
    let c = hook.counts();
    assert_eq!((c.served_allocs, c.served_frees), (800, 800));
    dev.allocator().check_invariants().unwrap();
}

/// An install whose proof fails (the probe tensor did not reach oomguard, as in a build where
/// cudarc resolves the driver with `dlsym`) is an error that says what was seen, why, and what
/// to build instead.
#[test]
fn a_failed_proof_says_what_was_seen_and_what_to_build() {
    let e = super::not_intercepted(false, false, "nothing was installed");
    assert!(matches!(e, super::InstallError::NotIntercepted { .. }));
    let m = e.to_string();
    for want in [
        "not allocated and not freed",
        "nothing was installed",
        "dynamic-loading",
        "candle-core's `cuda` feature",
        "allocator-hook",
    ] {
        assert!(m.contains(want), "{want:?} missing from: {m}");
    }
    let m = super::not_intercepted(true, false, "x").to_string();
    assert!(m.contains("allocated and not freed"), "{m}");
}
