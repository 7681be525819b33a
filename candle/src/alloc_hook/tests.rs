//! The hook's logic on the simulated device, with the driver replaced by a fake that records
//! what reaches it (CI has no GPU; the real symbols are proven on the H100, docs/GPU.md).

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Barrier};

use oomguard::backend::sim::SimDevice;
use oomguard::{AllocatorConfig, ByteSize, Device, IsOom};
use parking_lot::Mutex;

use super::interposer::{status, Driver, Interposer, Served, LEGACY};

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
    /// Streams capturing a graph; [`LEGACY`] in it: a blocking stream of the context captures
    /// (the driver's answer for the legacy stream).
    capturing: Mutex<Vec<u64>>,
    /// Stops the next thread that asks `is_capturing` until the test lets it go.
    gate: Mutex<Option<Arc<Gate>>>,
}

/// Two rendezvous: the paused thread has arrived; the test lets it go on.
struct Gate {
    arrived: Barrier,
    go_on: Barrier,
}

impl Gate {
    fn new() -> Arc<Self> {
        Arc::new(Gate {
            arrived: Barrier::new(2),
            go_on: Barrier::new(2),
        })
    }
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
        let gate = self.gate.lock().take();
        if let Some(g) = gate {
            g.arrived.wait();
            g.go_on.wait();
        }
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

fn served(hook: &Interposer<FakeDriver>) -> Arc<Served> {
    hook.served(CTX).expect("CTX is served")
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
        (q, served(&h).stream_id(PTDS))
    })
    .join()
    .unwrap();
    assert_ne!(q, p);
    let s = served(&hook);
    assert_ne!(other_id, s.stream_id(PTDS));
    assert_eq!(s.stream_id(0), 0);
    assert_eq!(
        s.stream_id(1),
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
        served(&h).stream_id(PTDS)
    })
    .join()
    .unwrap();
    assert_eq!(
        sim.pending_events(),
        2,
        "an event on the freeing thread's stream at the free, one more at its exit"
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
    let e = super::not_intercepted(false, false);
    assert!(matches!(e, super::InstallError::NotIntercepted { .. }));
    let m = e.to_string();
    for want in [
        "not allocated and not freed",
        "dynamic-loading",
        "candle-core's `cuda` feature",
        "allocator-hook",
    ] {
        assert!(m.contains(want), "{want:?} missing from: {m}");
    }
    let m = super::not_intercepted(true, false).to_string();
    assert!(m.contains("allocated and not freed"), "{m}");
}

/// Issue 32, 1: a thread already inside a served call when a failed install unserves the
/// context. Whatever unserving decides, the pointer that thread gets is freed where it was
/// made, and the device that made it stays served (and alive) while it is live.
#[test]
fn a_failed_install_never_drops_the_device_under_a_call_in_flight() {
    let (hook, dev, _sim) = hook_with(ByteSize::gib(1));
    let hook = Arc::new(hook);
    let gate = Gate::new();
    *hook.driver.gate.lock() = Some(Arc::clone(&gate));
    let h = Arc::clone(&hook);
    let t = std::thread::spawn(move || {
        set_context(CTX);
        h.alloc_async(1 << 20, PTDS)
    });
    gate.arrived.wait(); // the thread is inside the hook, past finding the served device
    let unserved = hook.unserve_if_idle(CTX);
    gate.go_on.wait();
    let p = t.join().unwrap().unwrap();
    assert!(
        p < DRIVER_BASE && !unserved,
        "a served call was in flight: unserving must wait (unserved {unserved}, {p:#x})"
    );
    drop(dev); // the test's handle: the hook alone keeps the device now
    assert_eq!(hook.free_async(p, PTDS), status::SUCCESS);
    assert!(
        hook.driver.calls().is_empty(),
        "the free of oomguard's pointer reached the driver: {:?}",
        hook.driver.calls()
    );
    assert_eq!(served(&hook).device.stats().allocated_bytes.all.current, 0);
    assert!(hook.unserve_if_idle(CTX), "idle now");
}

/// Issue 32, 2: calls made from inside the hook (an OOM observer runs inside an allocation):
/// a free of oomguard's pointer goes to oomguard, an allocation to the driver, and the free of
/// that driver pointer to the driver.
#[test]
fn calls_inside_the_hook_free_oomguard_memory_into_oomguard() {
    let (hook, dev, _sim) = hook_with(ByteSize::mib(64));
    let hook = Arc::new(hook);
    let p = hook.alloc_async(8 << 20, PTDS).unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (h, seen2) = (Arc::clone(&hook), Arc::clone(&seen));
    dev.allocator().attach_oom_observer(move |_| {
        // a tensor dropped in an OOM observer, and one made there
        let freed = h.free_async(p, PTDS);
        let q = h.alloc_async(4096, PTDS).unwrap();
        let freed_q = h.free_async(q, PTDS);
        seen2.lock().push((freed, q, freed_q));
    });
    assert_eq!(
        hook.alloc_async(128 << 20, PTDS),
        Err(status::OUT_OF_MEMORY)
    );
    let (freed, q, freed_q) = seen.lock()[0];
    assert_eq!((freed, freed_q), (status::SUCCESS, status::SUCCESS));
    assert!(
        q >= DRIVER_BASE,
        "an allocation inside the hook is the driver's"
    );
    let calls = hook.driver.calls();
    assert!(
        !calls.contains(&format!("free_async {p:#x} 0x2")),
        "oomguard's pointer went to the driver: {calls:?}"
    );
    assert!(
        calls.contains(&format!("free_async {q:#x} 0x2")),
        "{calls:?}"
    );
    assert_eq!(dev.stats().allocated_bytes.all.current, 0, "p came back");
    assert_eq!(hook.counts().served_frees, 1);
    dev.allocator().check_invariants().unwrap();
}

/// Issue 32, 3: a block of oomguard's freed on a stream that captures a graph is never handed
/// out again (the graph may use it at every replay), and no event is recorded on the stream.
#[test]
fn a_free_during_capture_keeps_the_block_out_of_reuse() {
    let (hook, dev, sim) = hook_with(ByteSize::gib(1));
    let stream = 0x5555_0000;
    let p = hook.alloc_async(1 << 20, stream).unwrap();
    hook.driver.capturing.lock().push(stream);
    assert_eq!(hook.free_async(p, stream), status::SUCCESS);
    assert_eq!(sim.pending_events(), 0, "no event on a capturing stream");
    assert!(
        hook.driver.calls().is_empty(),
        "oomguard's block, not the driver's"
    );
    hook.driver.capturing.lock().clear();
    let again: Vec<u64> = (0..4)
        .map(|_| hook.alloc_async(1 << 20, stream).unwrap())
        .collect();
    assert!(
        !again.contains(&p),
        "reused after capture: {again:x?} {p:#x}"
    );
    assert_eq!(hook.counts().held_after_capture, 1);
    assert_eq!(
        dev.stats().allocated_bytes.all.current,
        5 << 20,
        "the held block stays allocated"
    );
    for q in again {
        assert_eq!(hook.free_async(q, stream), status::SUCCESS);
    }
    assert!(
        !hook.unserve_if_idle(CTX),
        "a held block keeps the device served"
    );
}

/// Issue 32, 3: while a blocking stream of the context captures (another thread's global-mode
/// capture), oomguard serves no allocation (nothing of its own may break the capture) and
/// keeps a `cuMemFree_v2` of its block (an event on the legacy stream is illegal then).
#[test]
fn a_capture_on_a_blocking_stream_sends_allocations_to_the_driver() {
    let (hook, dev, sim) = hook_with(ByteSize::gib(1));
    let ours = hook.alloc(1 << 20).unwrap();
    hook.driver.capturing.lock().push(LEGACY);
    let a = hook.alloc_async(1 << 20, PTDS).unwrap();
    let b = hook.alloc(1 << 20).unwrap();
    assert!(a >= DRIVER_BASE && b >= DRIVER_BASE, "{a:#x} {b:#x}");
    assert_eq!(hook.free(ours), status::SUCCESS);
    assert_eq!(sim.pending_events(), 0);
    assert_eq!(hook.counts().held_after_capture, 1);
    assert_eq!(dev.stats().allocated_bytes.all.current, 1 << 20);
    assert_eq!(
        hook.driver.calls(),
        vec![
            format!("alloc_async {} 0x2", 1 << 20),
            format!("alloc {}", 1 << 20)
        ]
    );
}

/// Issue 32, 4: `cuMemFree_v2` of a `cuMemAlloc_v2` block records an event on the legacy
/// stream; the next `cuMemAlloc_v2` gets the block only once that stream passed the free.
#[test]
fn a_v2_free_of_a_v2_block_waits_for_the_legacy_stream() {
    let (hook, dev, sim) = hook_with(ByteSize::gib(1));
    let p = hook.alloc(1 << 20).unwrap();
    assert!(p < DRIVER_BASE);
    assert_eq!(hook.free(p), status::SUCCESS);
    assert_eq!(sim.pending_events(), 1, "an event on the legacy stream");
    let q = hook.alloc(1 << 20).unwrap();
    assert_ne!(q, p, "reused before the legacy stream passed the free");
    assert_eq!(hook.free(q), status::SUCCESS);
    sim.synchronize_stream(0);
    let got: Vec<u64> = (0..2).map(|_| hook.alloc(1 << 20).unwrap()).collect();
    assert!(
        got.contains(&p),
        "reused once the event completed: {got:x?}"
    );
    assert!(hook.driver.calls().is_empty());
    dev.allocator().check_invariants().unwrap();
}

/// Eight threads, one after the other, allocate and free 20 MiB through the hook and exit.
/// Returns (reserved bytes, address ranges held, segments) after the first thread and after
/// the last.
fn threads_come_and_go(config: AllocatorConfig) -> [(u64, u64, u64); 2] {
    let hook = Arc::new(Interposer::new(FakeDriver::default()));
    let sim = Arc::new(SimDevice::new(ByteSize::gib(4)));
    let dev = Device::from_arc(sim.clone(), config);
    hook.serve(CTX, dev.clone()).ok().unwrap();
    let mut seen = Vec::new();
    for _ in 0..8 {
        let h = Arc::clone(&hook);
        std::thread::spawn(move || {
            set_context(CTX);
            let p = h.alloc_async(20 << 20, PTDS).unwrap();
            assert_eq!(h.free_async(p, PTDS), status::SUCCESS);
        })
        .join()
        .unwrap();
        let calls = sim.calls();
        let st = dev.stats();
        seen.push((
            st.reserved_bytes.all.current,
            calls.reserve - calls.release,
            st.segment.all.current,
        ));
    }
    assert_eq!(dev.stats().allocated_bytes.all.current, 0);
    dev.allocator().check_invariants().unwrap();
    [seen[0], seen[7]]
}

/// Issue 32, 5: a thread's memory is not stranded when it exits (fixed segments: a cached
/// segment per dead thread before).
#[test]
fn threads_that_exit_leave_their_memory_to_the_next_fixed() {
    let [first, last] = threads_come_and_go(AllocatorConfig::native());
    assert!(first.0 >= 20 << 20);
    assert_eq!(last, first, "8 threads came and went: reserved grew");
}

/// Issue 32, 5: the same with growable segments (an address range per stream before).
#[test]
fn threads_that_exit_leave_their_memory_to_the_next_growable() {
    let [first, last] = threads_come_and_go(AllocatorConfig::default());
    assert!(first.0 >= 20 << 20 && first.1 >= 1, "{first:?}");
    assert_eq!(
        last, first,
        "8 threads came and went: reserved bytes or address ranges grew"
    );
}

/// Issue 32, 5: a dead thread's id (and its cached blocks) goes to a new thread only once the
/// dead thread's stream has passed its last work.
#[test]
fn an_exited_thread_s_stream_is_reused_only_after_its_event() {
    let (hook, _dev, sim) = hook_with(ByteSize::gib(1));
    let hook = Arc::new(hook);
    let run = |hook: &Arc<Interposer<FakeDriver>>| {
        let h = Arc::clone(hook);
        std::thread::spawn(move || {
            set_context(CTX);
            let p = h.alloc_async(1 << 20, PTDS).unwrap();
            assert_eq!(h.free_async(p, PTDS), status::SUCCESS);
            (served(&h).stream_id(PTDS), p)
        })
        .join()
        .unwrap()
    };
    let (dead, p) = run(&hook);
    assert_eq!(served(&hook).retired_ids(), vec![dead]);
    assert_eq!(
        sim.pending_events(),
        1,
        "an event on the exiting thread's stream"
    );
    let (second, q) = run(&hook);
    assert_ne!(second, dead, "taken over before the dead stream finished");
    assert_ne!(q, p);
    sim.synchronize_stream(dead);
    let (third, r) = run(&hook);
    assert_eq!(third, dead);
    assert_eq!(r, p, "the new thread got the dead thread's cached block");
}

/// Issue 32, 6: a failed install leaves nothing served when nothing it served is live, and
/// says that it keeps serving (with the device) otherwise.
#[test]
fn a_failed_install_says_whether_it_keeps_serving() {
    let (hook, _dev, _sim) = hook_with(ByteSize::gib(1));
    let cause = || super::InstallError::NotCuda("x".into());
    let p = hook.alloc_async(4096, PTDS).unwrap();
    let e = super::abandon(&hook, CTX, cause());
    assert!(
        matches!(&e, super::InstallError::StillServing { cause, .. }
            if matches!(**cause, super::InstallError::NotCuda(_))),
        "{e:?}"
    );
    assert!(e.to_string().contains("keeps serving"), "{e}");
    assert!(hook.served(CTX).is_some());
    assert_eq!(hook.free_async(p, PTDS), status::SUCCESS);
    let e = super::abandon(&hook, CTX, cause());
    assert!(matches!(e, super::InstallError::NotCuda(_)), "{e:?}");
    assert!(hook.served(CTX).is_none());
}

/// Issue 32, 6: a driver failure inside oomguard keeps the driver's code.
#[test]
fn driver_failures_keep_the_driver_s_code() {
    use oomguard::backend::{BackendError, BackendErrorKind};
    let err = |kind, m: &str| oomguard::Error::Backend(BackendError::new(kind, "cuMemMap", m));
    let s = super::interposer::status_of;
    assert_eq!(
        s(&err(
            BackendErrorKind::Other,
            "CUDA_ERROR_ILLEGAL_ADDRESS (an illegal memory access was encountered)"
        )),
        700
    );
    assert_eq!(
        s(&err(
            BackendErrorKind::Unavailable,
            "CUDA_ERROR_NOT_SUPPORTED (x)"
        )),
        801
    );
    assert_eq!(s(&err(BackendErrorKind::Other, "something else")), 999);
    assert_eq!(
        s(&err(BackendErrorKind::InvalidArgument, "no segment")),
        status::INVALID_VALUE
    );
    assert_eq!(
        s(&err(
            BackendErrorKind::OutOfMemory,
            "CUDA_ERROR_OUT_OF_MEMORY (x)"
        )),
        status::OUT_OF_MEMORY
    );
    assert_eq!(super::codes::code_of("CUDA_SUCCESS"), Some(0));
    assert_eq!(super::codes::code_of("CUDA_ERROR_UNKNOWN"), Some(999));
    assert_eq!(super::codes::code_of("CUDA_ERROR_NOPE"), None);
}

/// Issue 32, 3: a free on this thread's stream (not capturing) while another thread's blocking
/// stream captures: an event on the freeing stream now, the block back to the cache only at a
/// call made after the capture, once that event is done (never held for good, never reused
/// before).
#[test]
fn a_free_beside_a_capture_waits_for_its_end() {
    let (hook, dev, sim) = hook_with(ByteSize::gib(1));
    let p = hook.alloc_async(1 << 20, PTDS).unwrap();
    let own = served(&hook).stream_id(PTDS);
    hook.driver.capturing.lock().push(LEGACY);
    assert_eq!(hook.free_async(p, PTDS), status::SUCCESS);
    assert_eq!(sim.pending_events(), 1, "an event on the freeing stream");
    let c = hook.counts();
    assert_eq!((c.held_after_capture, c.waiting_for_capture_end), (0, 1));
    assert_eq!(dev.stats().allocated_bytes.all.current, 1 << 20);
    assert!(
        !hook.unserve_if_idle(CTX),
        "a waiting block keeps the device served"
    );
    hook.driver.capturing.lock().clear();
    // capture over, event pending: not back yet
    let q = hook.alloc_async(1 << 20, PTDS).unwrap();
    assert_ne!(q, p);
    assert_eq!(hook.counts().waiting_for_capture_end, 1);
    sim.synchronize_stream(own);
    let r = hook.alloc_async(4096, PTDS).unwrap(); // any call after the event gives it back
    assert_eq!(hook.counts().waiting_for_capture_end, 0);
    assert_eq!(dev.stats().allocated_bytes.all.current, (1 << 20) + 4096);
    for x in [q, r] {
        assert_eq!(hook.free_async(x, PTDS), status::SUCCESS);
    }
    assert_eq!(dev.stats().allocated_bytes.all.current, 0);
    assert!(hook.driver.calls().is_empty(), "{:?}", hook.driver.calls());
    dev.allocator().check_invariants().unwrap();
}

/// A tensor dropped on a thread without the context current (cudarc frees without binding
/// it): the hook cannot ask about captures there, so the free is served (not held for good on
/// the driver's error).
#[test]
fn a_free_without_the_context_current_is_served() {
    let (hook, dev, _sim) = hook_with(ByteSize::gib(1));
    let p = hook.alloc_async(1 << 20, PTDS).unwrap();
    hook.driver.capturing.lock().push(LEGACY); // what an error would answer
    set_context(0);
    assert_eq!(hook.free_async(p, PTDS), status::SUCCESS);
    let c = hook.counts();
    assert_eq!((c.held_after_capture, c.waiting_for_capture_end), (0, 0));
    assert_eq!(dev.stats().allocated_bytes.all.current, 0);
    assert!(hook.driver.calls().is_empty());
}

/// Eight threads, one after the other, allocate and free 8 MiB on their per-thread default
/// streams and exit, on a device whose streams' work stays pending until synchronised (the
/// `hook_with` device). Each exited thread's stream may still run work, so its id (and the
/// block cached for it) is not given to the next thread: 8 streams, 8 segments. That is not
/// memory lost: (1) once the work is done (hook_gpu synchronises after each thread, so there
/// the second thread already takes over the first one's id), the next thread takes over an
/// exited thread's id and nothing more is reserved; (2) under pressure, the exited streams'
/// free pages move to where a request needs them.
#[test]
fn exited_threads_keep_their_streams_while_their_work_may_run() {
    let (hook, dev, sim) = hook_with(ByteSize::mib(80));
    let hook = Arc::new(hook);
    let run = |hook: &Arc<Interposer<FakeDriver>>, bytes: usize| {
        let h = Arc::clone(hook);
        std::thread::spawn(move || {
            set_context(CTX);
            let p = h.alloc_async(bytes, PTDS).unwrap();
            assert_eq!(h.free_async(p, PTDS), status::SUCCESS);
        })
        .join()
        .unwrap();
        let st = dev.stats();
        (st.reserved_bytes.all.current >> 20, st.segment.all.current)
    };
    let seen: Vec<_> = (0..8).map(|_| run(&hook, 8 << 20)).collect();
    assert_eq!(seen[0], (8, 1));
    assert_eq!(seen[7], (64, 8), "one stream per thread: {seen:?}");
    assert_eq!(served(&hook).retired_ids().len(), 8);
    assert_eq!(sim.pending_events(), 8, "each exit's event still pending");
    // The exited threads' work completes: the next thread takes over one of their streams.
    sim.synchronize_stream(0);
    for id in served(&hook).retired_ids() {
        sim.synchronize_stream(id);
    }
    assert_eq!(run(&hook, 8 << 20), (64, 8), "nothing more reserved");
    assert_eq!(
        served(&hook).retired_ids().len(),
        8,
        "one taken, one retired"
    );
    // Pressure: 40 MiB more would pass the 80 MiB device; the exited streams' free pages move.
    assert_eq!(sim.pending_events(), 1);
    let (reserved, _) = run(&hook, 40 << 20);
    assert!(reserved <= 80, "{reserved} MiB reserved");
    let st = dev.stats();
    assert_eq!(
        (st.num_ooms, st.allocated_bytes.all.current),
        (0, 0),
        "{st:?}"
    );
    assert!(st.num_unmap > 0, "pages moved: {st:?}");
    dev.allocator().check_invariants().unwrap();
}
