//! Telemetry: every retry emits a `tracing` event with the attempt, the error and the plans.
//!
//! The only test in this binary on purpose: `tracing` caches per call site whether anyone listens,
//! and a thread-local subscriber can miss events while another thread hits the same call sites
//! with none.

use std::sync::{Arc, Mutex};

use oomguard_runtime::retry::{Accumulate, RetryEngine};
use oomguard_runtime::{ByteSize, Device, Error};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

/// One event's fields, `(name, value)`.
type EventFields = Vec<(String, String)>;

/// Collects events as `name=value` lists.
#[derive(Clone, Default)]
struct Collect(Arc<Mutex<Vec<EventFields>>>);

struct Fields(Vec<(String, String)>);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0
            .push((field.name().to_string(), format!("{value:?}")));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.push((field.name().to_string(), value.to_string()));
    }
}

impl Subscriber for Collect {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, e: &Event<'_>) {
        if e.metadata().target() != "oomguard::retry" {
            return;
        }
        let mut f = Fields(vec![("level".into(), e.metadata().level().to_string())]);
        e.record(&mut f);
        self.0.lock().unwrap().push(f.0);
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

fn get<'a>(ev: &'a [(String, String)], k: &str) -> &'a str {
    ev.iter()
        .find(|(n, _)| n == k)
        .map(|(_, v)| v.as_str())
        .unwrap_or_else(|| panic!("no field {k} in {ev:?}"))
}

fn step(dev: &Device, plan: &oomguard_runtime::BatchPlan) -> Result<usize, Error> {
    let mut rows = 0;
    for c in plan.chunks() {
        rows += dev.alloc::<u8>(c.len() << 21)?.len() >> 21;
    }
    Ok(rows)
}

#[test]
fn every_retry_is_an_event() {
    let collect = Collect::default();
    let dev = Device::sim(ByteSize::mib(64));
    let out = tracing::subscriber::with_default(collect.clone(), || {
        RetryEngine::new()
            .with_policy(Accumulate::halving())
            .run(&dev, 100, |p| step(&dev, p), |rows| rows)
            .unwrap()
    });
    let events = collect.0.lock().unwrap().clone();
    assert_eq!(events.len(), 2, "{events:?}");
    for (i, ev) in events.iter().enumerate() {
        assert_eq!(get(ev, "level"), "WARN");
        assert_eq!(get(ev, "attempt"), (i + 1).to_string());
        assert!(get(ev, "error").contains("out of memory"));
        assert_eq!(get(ev, "old_plan"), out.report.attempts[i].plan.to_string());
        assert_eq!(
            get(ev, "new_plan"),
            out.report.attempts[i].next.unwrap().to_string()
        );
        get(ev, "allocated_bytes");
        get(ev, "reserved_bytes");
    }
    assert_eq!(
        get(&events[1], "new_plan"),
        "batch 100 in 4 micro-batches of ≤25"
    );
    let shown = out.report.to_string();
    assert!(shown.contains("after 2 retries"), "{shown}");
}
