//! Misbehaving implementations of the public traits a user or an integration crate implements
//! (`Consensus`, `MemorySource`, `TrainFramework`): each broke its contract first, and oomguard
//! then panicked, aborted the process or gave a wrong `Ok`. Now: an error that says what is
//! wrong, or a panic that stays catchable (from a helper's hostile pass; docs/RELIABILITY.md).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::Duration;

use oomguard_runtime::retry::{
    find_max_batch, Accumulate, BatchPlan, Chunk, Consensus, ConsensusError, FinderError,
    FinderOptions, LocalGroup, RetryEngine,
};
use oomguard_runtime::source::{self, MemorySource, MemoryUsage, SourceBudget, SourceInfo};
use oomguard_runtime::train::{train_step, Gradients, TrainFramework, TrainUpdate};
use oomguard_runtime::{ByteSize, Device, DeviceBuffer, Error};

const MIB: usize = 1 << 20;

/// A user's consensus that reduces with a minimum (NCCL's `ReduceOp::Min` picked by mistake).
#[derive(Debug)]
struct MinReduce(LocalGroup);

impl Consensus for MinReduce {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn world_size(&self) -> usize {
        self.0.world_size()
    }
    fn all_reduce_max(&self, v: &mut [u64]) -> Result<(), ConsensusError> {
        v.iter_mut().for_each(|x| *x = !*x);
        self.0.all_reduce_max(v)?;
        v.iter_mut().for_each(|x| *x = !*x);
        Ok(())
    }
}

/// The rank whose attempt failed while the minimum said "every rank succeeded" panicked
/// (`unreachable!`) and the other rank committed alone. The agreement checks that a maximum is
/// never below this rank's own values now: that rank stops with a consensus error, no panic.
#[test]
fn a_consensus_that_takes_a_minimum_is_an_error_not_a_panic() {
    let (tx, rx) = mpsc::channel();
    for group in LocalGroup::with_timeout(2, Duration::from_secs(10)) {
        let tx = tx.clone();
        thread::spawn(move || {
            let rank = group.rank();
            let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                // rank 1 cannot fit the whole batch (2 MiB a row)
                let dev = Device::sim(ByteSize::mib(if rank == 0 { 1024 } else { 64 }));
                let engine = RetryEngine::new()
                    .with_policy(Accumulate::halving())
                    .with_consensus(MinReduce(group));
                engine
                    .run(
                        &dev,
                        100,
                        |plan: &BatchPlan| {
                            for c in plan.chunks() {
                                dev.alloc::<u8>(c.len() * 2 * MIB)?;
                            }
                            Ok::<_, Error>(())
                        },
                        |()| (),
                    )
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            }));
            let _ = tx.send((rank, out.map_err(|_| "panicked".to_string())));
        });
    }
    drop(tx);
    let mut out: Vec<_> = rx.iter().collect();
    out.sort_by_key(|r| r.0);
    assert_eq!(out.len(), 2);
    let rank1 = out[1].1.as_ref().expect("rank 1 did not panic");
    let e = rank1
        .as_ref()
        .expect_err("rank 1's attempt failed: no commit");
    assert!(e.contains("does not take the maximum"), "{e}");
    assert!(out[0].1.is_ok(), "rank 0 did not panic: {out:?}");
}

/// A transport that panics on its second collective (a communicator error unwrapped).
#[derive(Debug, Default)]
struct PanicsOnSecondCall(AtomicU64);

impl Consensus for PanicsOnSecondCall {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        2
    }
    fn all_reduce_max(&self, _v: &mut [u64]) -> Result<(), ConsensusError> {
        if self.0.fetch_add(1, Ordering::SeqCst) >= 1 {
            panic!("communicator aborted");
        }
        Ok(())
    }
}

/// The loop, dropped while that panic unwound, cast its failed vote through the same consensus,
/// which panicked again inside a destructor: the process aborted ("panic in a destructor during
/// cleanup"). The vote's panic is caught now, and the first one reaches the caller.
#[test]
fn a_consensus_that_panics_is_a_panic_the_caller_catches() {
    let dev = Device::sim(ByteSize::mib(64));
    let engine = RetryEngine::new().with_consensus(PanicsOnSecondCall::default());
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        engine.run(&dev, 4, |_: &BatchPlan| Ok::<_, Error>(()), |()| ())
    }));
    assert!(r.is_err(), "the consensus's panic reaches the caller");
}

/// A registered source whose figures read `u64::MAX` ("unknown", -1 as `u64`).
#[derive(Debug)]
struct Unknown;

impl MemorySource for Unknown {
    fn info(&self) -> SourceInfo {
        SourceInfo {
            device_name: "unknown".into(),
            ordinal: 7,
            total_bytes: 1 << 30,
            kind: "test pool",
        }
    }
    fn usage(&self) -> oomguard_runtime::Result<MemoryUsage> {
        Ok(MemoryUsage {
            used: u64::MAX,
            used_peak: u64::MAX,
            reserved: u64::MAX,
            reserved_peak: u64::MAX,
        })
    }
    fn available(&self) -> oomguard_runtime::Result<u64> {
        Ok(0)
    }
    fn reset_peak(&self) -> oomguard_runtime::Result<()> {
        Ok(())
    }
    fn empty_cache(&self) -> oomguard_runtime::Result<()> {
        Ok(())
    }
    fn memory_summary(&self) -> String {
        String::new()
    }
    fn budget(&self, _limit: u64) -> oomguard_runtime::Result<SourceBudget> {
        Err(Error::InvalidArgument("no budgets".into()))
    }
    fn source_id(&self) -> usize {
        0x05e4_71e1
    }
}

/// A step that holds no source sums the registered sources with its thread's device: the sum
/// overflowed (a debug-build panic, a wrapped figure in release).
#[test]
fn figures_of_u64_max_do_not_overflow_a_steps_readings() {
    let unknown: Arc<dyn MemorySource> = Arc::new(Unknown);
    source::register(&unknown);
    let dev = Device::sim(ByteSize::mib(64));
    let _keep = dev.alloc::<u8>(MIB).unwrap();
    let lp =
        RetryEngine::new().begin_any::<Error>("hostile_traits:1", BatchPlan::whole(4).unwrap());
    let held = lp.as_ref().map(|l| l.report().held_bytes.clone()).ok();
    drop(lp);
    drop(unknown);
    assert_eq!(held.unwrap(), vec![u64::MAX], "saturated");
}

/// A device whose `available()` says `u64::MAX` ("no limit").
#[derive(Debug)]
struct NoLimit(Device);

impl MemorySource for NoLimit {
    fn info(&self) -> SourceInfo {
        self.0.info()
    }
    fn usage(&self) -> oomguard_runtime::Result<MemoryUsage> {
        self.0.usage()
    }
    fn available(&self) -> oomguard_runtime::Result<u64> {
        Ok(u64::MAX)
    }
    fn reset_peak(&self) -> oomguard_runtime::Result<()> {
        MemorySource::reset_peak(&self.0)
    }
    fn empty_cache(&self) -> oomguard_runtime::Result<()> {
        MemorySource::empty_cache(&self.0)
    }
    fn memory_summary(&self) -> String {
        self.0.memory_summary()
    }
    fn budget(&self, limit: u64) -> oomguard_runtime::Result<SourceBudget> {
        MemorySource::budget(&self.0, limit)
    }
    fn source_id(&self) -> usize {
        self.0.source_id() ^ 1
    }
}

/// The finder's checks against 0.1 % of the budget were off with a budget of `u64::MAX`: a step
/// keeping 1 MiB at every call was reported safe for a loop (177 rows, `Ok`). The budget is
/// never more than the device's capacity now.
#[test]
fn a_source_without_a_limit_does_not_hide_a_leaking_step() {
    let dev = Device::sim(ByteSize::mib(256));
    let mut kept = Vec::new();
    let r = find_max_batch(&NoLimit(dev.clone()), FinderOptions::default(), |rows| {
        let _ws = dev.alloc::<u8>(16 * MIB)?;
        let _acts = dev.alloc::<u8>(rows * MIB)?;
        kept.push(dev.alloc::<u8>(MIB)?);
        Ok::<_, Error>(())
    });
    assert!(
        matches!(r, Err(FinderError::StepKeepsMemory { .. })),
        "{:?}",
        r.map(|r| r.max_batch)
    );
}

/// A framework that can panic in its loss, and again when its gradients are discarded, and
/// whose accumulator counts only the last chunk's rows.
struct Careless {
    card: Device,
    panic_in_loss: bool,
    panic_in_discard: bool,
}

impl TrainFramework for Careless {
    type Error = Error;
    type Batch = [f64];
    type Loss = (f64, DeviceBuffer<u8>);
    type Accumulator = (f64, usize);
    type Grads = f64;
    fn batch_rows(&self, b: &[f64]) -> Result<Option<usize>, String> {
        Ok(Some(b.len()))
    }
    fn chunk_loss(&mut self, b: &[f64], c: &Chunk) -> Result<Self::Loss, Error> {
        assert!(!self.panic_in_loss, "the framework's assertion in the loss");
        let rows = &b[c.rows()];
        let mean = rows.iter().sum::<f64>() / rows.len() as f64;
        Ok((mean, self.card.alloc::<u8>(c.len() * MIB)?))
    }
    fn accumulator(&mut self) -> Result<(f64, usize), Error> {
        Ok((0.0, 0))
    }
    fn backward(&self, acc: &mut (f64, usize), l: Self::Loss, c: &Chunk) -> Result<(), Error> {
        acc.0 += l.0 * c.weight();
        acc.1 = c.len(); // careless: the last chunk's rows, not their sum
        Ok(())
    }
    fn gradients(&self, acc: (f64, usize)) -> Result<Gradients<f64>, Error> {
        Ok(Gradients {
            grads: acc.0,
            loss: acc.0,
            rows: acc.1,
        })
    }
    fn batch_error(m: String) -> Error {
        Error::InvalidArgument(m)
    }
    fn discard_gradients(&mut self) {
        assert!(
            !self.panic_in_discard,
            "the device was left broken by the earlier panic"
        );
    }
}

impl TrainUpdate for Careless {
    type Updated = ();
    fn update(&mut self, _g: f64) -> Result<(), Error> {
        Ok(())
    }
}

/// Discarding the gradients panicked while the loss's panic unwound: a panic inside a destructor
/// during cleanup aborted the process. It is caught and logged now; the first panic reaches the
/// caller.
#[test]
fn a_framework_that_panics_while_discarding_is_a_catchable_panic() {
    let card = Device::sim(ByteSize::mib(64));
    let mut fw = Careless {
        card: card.clone(),
        panic_in_loss: true,
        panic_in_discard: true,
    };
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = train_step(&RetryEngine::new(), &card, &mut fw, &[1.0, 2.0][..]);
    }));
    assert!(r.is_err(), "the loss's panic reaches the caller");
}

/// The accumulator counted 4 of the 8 rows of a split step and `train_step` returned `Ok` with
/// `rows == 4` beside a report of 8: an error naming the count now, and nothing updated.
#[test]
fn gradients_that_miss_rows_are_an_error() {
    let card = Device::sim(ByteSize::mib(6));
    let mut fw = Careless {
        card: card.clone(),
        panic_in_loss: false,
        panic_in_discard: false,
    };
    let batch: Vec<f64> = (1..=8).map(f64::from).collect();
    let e = train_step(&RetryEngine::new(), &card, &mut fw, &batch[..])
        .map(|s| s.step.rows)
        .expect_err("4 of 8 rows");
    assert!(e.to_string().contains("rows were backpropagated"), "{e}");
}

/// A backend that hands out the same range again: every `alloc_segment` and `reserve` after the
/// first returns the first one's address (a user's backend with a stale pool, say).
#[derive(Debug)]
struct RepeatsItsFirstRange {
    inner: oomguard_runtime::backend::sim::SimDevice,
    first_segment: std::sync::Mutex<Option<u64>>,
    first_reserve: std::sync::Mutex<Option<u64>>,
}

mod repeats {
    use super::RepeatsItsFirstRange;
    use oomguard_runtime::backend::{Backend, BackendError, DevicePtr, MemInfo, StreamId};

    fn again(first: &std::sync::Mutex<Option<u64>>, p: DevicePtr) -> DevicePtr {
        *first.lock().unwrap().get_or_insert(p)
    }

    impl Backend for RepeatsItsFirstRange {
        fn name(&self) -> String {
            self.inner.name()
        }
        fn mem_info(&self) -> Result<MemInfo, BackendError> {
            self.inner.mem_info()
        }
        fn granularity(&self) -> u64 {
            self.inner.granularity()
        }
        fn supports_growable(&self) -> bool {
            self.inner.supports_growable()
        }
        fn alloc_segment(&self, b: u64, s: StreamId) -> Result<DevicePtr, BackendError> {
            Ok(again(&self.first_segment, self.inner.alloc_segment(b, s)?))
        }
        fn free_segment(&self, p: DevicePtr, b: u64) -> Result<(), BackendError> {
            self.inner.free_segment(p, b)
        }
        fn reserve(&self, b: u64) -> Result<DevicePtr, BackendError> {
            Ok(again(&self.first_reserve, self.inner.reserve(b)?))
        }
        fn release(&self, p: DevicePtr, b: u64) -> Result<(), BackendError> {
            self.inner.release(p, b)
        }
        fn map(&self, a: DevicePtr, b: u64) -> Result<(), BackendError> {
            self.inner.map(a, b)
        }
        fn unmap(&self, a: DevicePtr, b: u64) -> Result<(), BackendError> {
            self.inner.unmap(a, b)
        }
        fn copy_to_device(&self, d: DevicePtr, s: &[u8]) -> Result<(), BackendError> {
            self.inner.copy_to_device(d, s)
        }
        fn copy_to_host(&self, d: &mut [u8], s: DevicePtr) -> Result<(), BackendError> {
            self.inner.copy_to_host(d, s)
        }
        fn memset_zero(&self, d: DevicePtr, b: u64) -> Result<(), BackendError> {
            self.inner.memset_zero(d, b)
        }
    }
}

/// A backend that handed out a range overlapping a live one: the allocator placed blocks in it,
/// and two live buffers shared memory (the second's write showed in the first) with `Ok`. The
/// range is refused now, with an error that says the backend is at fault, in both segment kinds.
#[test]
fn a_backend_range_overlapping_a_live_one_is_refused() {
    use oomguard_runtime::backend::sim::SimDevice;
    use oomguard_runtime::{AllocatorConfig, CachingAllocator};
    for cfg in ["expandable_segments:False", "expandable_segments:True"] {
        let backend = RepeatsItsFirstRange {
            inner: SimDevice::new(ByteSize::mib(256)),
            first_segment: std::sync::Mutex::new(None),
            first_reserve: std::sync::Mutex::new(None),
        };
        let a = CachingAllocator::new(Arc::new(backend), AllocatorConfig::parse(cfg).unwrap());
        let first = a.allocate(30 << 20, 0).unwrap();
        // fixed segments: another 30 MiB needs a second segment; growable: another stream
        // needs a range of its own
        let (bytes, stream) = if cfg.ends_with("False") {
            (30 << 20, 0)
        } else {
            (1 << 20, 1)
        };
        match a.allocate(bytes, stream) {
            Ok(second) => panic!(
                "{cfg}: Ok at {:#x} beside the live block at {:#x}",
                second.ptr, first.ptr
            ),
            Err(e) => {
                let text = e.to_string();
                assert!(!e.is_oom(), "{cfg}: {text}");
                assert!(text.contains("overlaps the live range"), "{cfg}: {text}");
            }
        }
        a.free(first).unwrap();
    }
}
