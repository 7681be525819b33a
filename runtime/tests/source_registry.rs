//! A registered memory source that is not a `Device` (the driver pool candle allocates from,
//! here a stand-in over a simulated device): steps that hold no device (the attribute macros'
//! `begin_any`) empty its cache before a retry and remember plans under its device's key.

use std::ops::ControlFlow;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use oomguard_runtime::retry::{BatchPlan, RetryEngine};
use oomguard_runtime::source::{self, MemorySource, MemoryUsage, SourceBudget, SourceInfo};
use oomguard_runtime::{ByteSize, Device, Error, Result};

#[derive(Debug)]
struct Pool {
    dev: Device,
    empties: AtomicUsize,
}

impl MemorySource for Pool {
    fn info(&self) -> SourceInfo {
        SourceInfo {
            device_name: "stand-in pool".into(),
            ordinal: 7,
            total_bytes: 64 << 20,
            kind: "driver pool",
        }
    }
    fn usage(&self) -> Result<MemoryUsage> {
        self.dev.usage()
    }
    fn available(&self) -> Result<u64> {
        self.dev.available()
    }
    fn reset_peak(&self) -> Result<()> {
        MemorySource::reset_peak(&self.dev)
    }
    fn empty_cache(&self) -> Result<()> {
        self.empties.fetch_add(1, Ordering::SeqCst);
        self.dev.empty_cache()
    }
    fn memory_summary(&self) -> String {
        self.dev.memory_summary()
    }
    fn budget(&self, limit: u64) -> Result<SourceBudget> {
        MemorySource::budget(&self.dev, limit)
    }
    fn source_id(&self) -> usize {
        0xdead_beef
    }
}

#[test]
fn a_step_without_a_device_uses_the_registered_source() {
    let pool = Arc::new(Pool {
        dev: Device::sim(ByteSize::mib(64)),
        empties: AtomicUsize::new(0),
    });
    let as_source: Arc<dyn MemorySource> = pool.clone();
    source::register(&as_source);
    assert!(source::all().iter().any(|s| s.source_id() == 0xdead_beef));

    // A step that fails once with an OOM of "the pool", on a thread that never allocated
    // through an oomguard Device.
    let engine = RetryEngine::new();
    let mut lp = engine
        .begin_any::<Error>("src/train.rs:1 step", BatchPlan::new(8, 1).unwrap())
        .unwrap();
    let mut first = true;
    let report = loop {
        let attempt = if std::mem::take(&mut first) {
            Err(Device::sim(ByteSize::mib(1))
                .alloc::<u8>(2 << 20)
                .unwrap_err())
        } else {
            Ok(())
        };
        match lp.next(attempt) {
            ControlFlow::Break(done) => break done.unwrap().1,
            ControlFlow::Continue(()) => {}
        }
    };
    assert!(report.retries() >= 1);
    assert!(
        pool.empties.load(Ordering::SeqCst) >= 1,
        "the registered source's cache was emptied before the retry"
    );
    let keys: Vec<_> = engine
        .memory()
        .iter()
        .map(|(k, _)| k.device.clone())
        .collect();
    assert!(
        keys.iter()
            .any(|k| k.name == "stand-in pool" && k.ordinal == 7 && k.total_bytes == 64 << 20),
        "the plan is remembered under the source's device, not \"any\": {keys:?}"
    );
}
