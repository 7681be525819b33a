//! The engines of the `#[oom_retry]` functions: one per persistence file, shared by every
//! function that remembers plans, so that `oomguard::remembered_plans` and
//! `oomguard::forget_remembered_plans` see them all.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use crate::retry::{Limits, MemoryError, MemoryKey, PlanMemory, RetryEngine};

/// One engine per persistence file (`None`: in memory), shared by every `#[oom_retry]` function.
type EngineMap = HashMap<Option<&'static str>, RetryEngine>;

fn static_engines() -> &'static Mutex<EngineMap> {
    static ENGINES: OnceLock<Mutex<EngineMap>> = OnceLock::new();
    ENGINES.get_or_init(Default::default)
}

pub(super) fn engine_for(persist: Option<&'static str>) -> RetryEngine {
    let mut map = static_engines().lock().unwrap_or_else(|e| e.into_inner());
    map.entry(persist)
        .or_insert_with(|| match persist {
            None => RetryEngine::new(),
            // A file that cannot be read is reported (a warning, and in every step's report),
            // never silently ignored.
            Some(path) => RetryEngine::new().with_memory(std::sync::Arc::new(Mutex::new(
                PlanMemory::open_or_in_memory(path),
            ))),
        })
        .clone()
}

/// Every engine of the `#[oom_retry]` functions, with its persistence file.
fn engines() -> Vec<(Option<&'static str>, RetryEngine)> {
    static_engines()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .map(|(k, v)| (*k, v.clone()))
        .collect()
}

/// `oomguard::remembered_plans`.
pub fn remembered() -> Vec<(Option<&'static str>, MemoryKey, Limits)> {
    let mut out = Vec::new();
    for (file, engine) in engines() {
        let mem = engine.memory();
        // saved in the file only while it is the memory's and its last write succeeded
        let file = file.filter(|_| mem.path().is_some() && mem.error().is_none());
        for (k, l) in mem.iter() {
            if l != Limits::NONE {
                out.push((file, k.clone(), l));
            }
        }
    }
    out.sort_by(|a, b| (a.0, &a.1.site).cmp(&(b.0, &b.1.site)));
    out
}

/// `oomguard::forget_remembered_plans`.
pub fn forget() -> Result<(), MemoryError> {
    let mut first_err = None;
    for (_, engine) in engines() {
        if let Err(e) = engine.memory().clear() {
            first_err.get_or_insert(e);
        }
    }
    first_err.map_or(Ok(()), Err)
}
