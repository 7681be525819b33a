//! Remembered plans: what worked at each call site, per device and per grad mode, optionally
//! persisted to a JSON file so a restarted run starts from the known-good plan.

use rustc_hash::FxHashMap as HashMap;
use std::fmt;
use std::panic::Location;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::plan::BatchPlan;
use crate::source::MemorySource;

/// Whether a step trains (builds gradients) or evaluates. Train and eval steps at the same call
/// site need different memory, so they are remembered separately.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StepMode {
    /// Gradients are recorded (the default).
    #[default]
    Train,
    /// No gradients (evaluation, inference).
    Eval,
}

impl StepMode {
    /// The mode of the current thread: [`StepMode::Train`] while gradients are recorded
    /// ([`crate::is_grad_enabled`]), [`StepMode::Eval`] under `no_grad` or `inference_mode`.
    ///
    /// ```
    /// use oomguard_runtime::retry::StepMode;
    /// assert_eq!(StepMode::current(), StepMode::Train);
    /// let _g = oomguard_runtime::no_grad();
    /// assert_eq!(StepMode::current(), StepMode::Eval);
    /// ```
    pub fn current() -> StepMode {
        if crate::is_grad_enabled() {
            StepMode::Train
        } else {
            StepMode::Eval
        }
    }
}

/// The device part of a memory key: stable across restarts.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct DeviceKey {
    /// The device's name (e.g. `"NVIDIA H100 80GB HBM3"`, `"sim"`).
    pub name: String,
    /// The device ordinal.
    pub ordinal: usize,
    /// The device's capacity in bytes: a plan learned on a smaller card does not carry over.
    pub total_bytes: u64,
}

impl DeviceKey {
    /// The key of steps that run on any device (see `RetryEngine::begin_any`).
    pub fn any() -> Self {
        Self {
            name: "any".into(),
            ordinal: 0,
            total_bytes: 0,
        }
    }

    /// The key of `device`.
    pub fn of<S: MemorySource + ?Sized>(device: &S) -> Self {
        let info = device.info();
        Self {
            name: info.device_name,
            ordinal: info.ordinal,
            total_bytes: info.total_bytes,
        }
    }
}

/// Where a plan is remembered: call site × device × mode.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MemoryKey {
    /// The call site, `file:line:column` (from `#[track_caller]`).
    pub site: String,
    /// The device.
    pub device: DeviceKey,
    /// Train or eval.
    pub mode: StepMode,
}

impl MemoryKey {
    /// The key for a call at `site` on `device` in `mode`.
    pub fn new<S: MemorySource + ?Sized>(site: &Location<'_>, device: &S, mode: StepMode) -> Self {
        Self::at(
            format!("{}:{}:{}", site.file(), site.line(), site.column()),
            device,
            mode,
        )
    }

    /// The key for a call at the site named `site` on `device` in `mode`.
    pub fn at<S: MemorySource + ?Sized>(site: String, device: &S, mode: StepMode) -> Self {
        Self {
            site,
            device: DeviceKey::of(device),
            mode,
        }
    }
}

/// Caps learned from out-of-memory retries; `None`: no cap.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Limits {
    /// The largest micro-batch (rows) known to work.
    pub micro_batch: Option<usize>,
    /// The largest batch (rows) known to work, when the batch itself had to shrink.
    pub batch: Option<usize>,
}

impl Limits {
    /// No cap.
    pub const NONE: Limits = Limits {
        micro_batch: None,
        batch: None,
    };

    /// The plan these limits give for a request of `batch` rows (`batch >= 1`).
    pub fn plan_for(&self, batch: usize) -> Option<BatchPlan> {
        let b = self.batch.map_or(batch, |cap| cap.min(batch)).max(1);
        let micro = self.micro_batch.map_or(b, |m| m.min(b)).max(1);
        BatchPlan::with_micro_batch(b.min(batch), micro).ok()
    }

    /// These limits tightened so that `plan` (which worked for a request of `requested` rows)
    /// is what they give.
    pub fn learned(self, plan: &BatchPlan, requested: usize) -> Limits {
        let mut out = self;
        if plan.micro_batch() < plan.batch() || plan.batch() < requested {
            out.micro_batch = Some(
                self.micro_batch
                    .map_or(plan.micro_batch(), |m| m.min(plan.micro_batch())),
            );
        }
        if plan.batch() < requested {
            out.batch = Some(self.batch.map_or(plan.batch(), |b| b.min(plan.batch())));
        }
        out
    }

    /// One size up for a request of `requested` rows: the batch cap doubled if it binds, else the
    /// micro-batch cap doubled; `None` when no cap binds.
    pub fn one_up(&self, requested: usize) -> Option<Limits> {
        let grow = |cap: usize| {
            let up = cap.saturating_mul(2);
            (up < requested).then_some(up)
        };
        if let Some(b) = self.batch.filter(|&b| b < requested) {
            return Some(Limits {
                batch: grow(b),
                ..*self
            });
        }
        let effective = self.batch.map_or(requested, |b| b.min(requested));
        if let Some(m) = self.micro_batch.filter(|&m| m < effective) {
            return Some(Limits {
                micro_batch: grow(m),
                ..*self
            });
        }
        None
    }
}

impl fmt::Display for Limits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let show = |o: Option<usize>| o.map_or("none".to_string(), |v| v.to_string());
        write!(
            f,
            "micro-batch cap {}, batch cap {}",
            show(self.micro_batch),
            show(self.batch)
        )
    }
}

/// Reading or writing the plan file failed.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    /// The file could not be read or written.
    #[error("plan memory file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not a plan memory file of this version.
    #[error("plan memory file {path} is not valid: {message}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
}

/// Per-site bookkeeping: the limits plus counters the engine keeps (not persisted).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Entry {
    pub(crate) limits: Limits,
    /// Successful steps since the limits last changed or a regrow was tried.
    pub(crate) clean_steps: u32,
    /// Consecutive successful steps in which the allocator had to free its cache and retry.
    pub(crate) thrash_streak: u32,
    /// Failed regrows in a row (the wait before the next one doubles with each).
    pub(crate) failed_regrows: u32,
}

const VERSION: u32 = 1;

#[derive(Serialize, Deserialize)]
struct FileFormat {
    version: u32,
    plans: Vec<FileEntry>,
}

#[derive(Serialize, Deserialize)]
struct FileEntry {
    #[serde(flatten)]
    key: MemoryKey,
    limits: Limits,
}

/// The remembered plans. Kept in memory; with a file, every change is written to it (atomically:
/// a temporary file renamed over the old one).
///
/// ```
/// use oomguard_runtime::retry::{Limits, PlanMemory};
/// let path = std::env::temp_dir().join(format!("oomguard-doc-{}.json", std::process::id()));
/// let mem = PlanMemory::open(&path).unwrap(); // a missing file is an empty memory
/// assert!(mem.is_empty());
/// # let _ = std::fs::remove_file(&path);
/// ```
#[derive(Debug, Default)]
pub struct PlanMemory {
    entries: HashMap<MemoryKey, Entry>,
    path: Option<PathBuf>,
}

impl PlanMemory {
    /// An empty memory that is not persisted.
    pub fn in_memory() -> Self {
        Self::default()
    }

    /// The memory persisted in `path`: read now (a missing file is an empty memory), written on
    /// every change.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, MemoryError> {
        let path = path.as_ref().to_path_buf();
        let mut entries = HashMap::default();
        match std::fs::read_to_string(&path) {
            Ok(text) => {
                let file: FileFormat =
                    serde_json::from_str(&text).map_err(|e| MemoryError::Format {
                        path: path.clone(),
                        message: e.to_string(),
                    })?;
                if file.version != VERSION {
                    return Err(MemoryError::Format {
                        path,
                        message: format!(
                            "version {} (this oomguard reads version {VERSION})",
                            file.version
                        ),
                    });
                }
                for e in file.plans {
                    entries.insert(
                        e.key,
                        Entry {
                            limits: e.limits,
                            ..Entry::default()
                        },
                    );
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(MemoryError::Io { path, source }),
        }
        Ok(Self {
            entries,
            path: Some(path),
        })
    }

    /// The file this memory is persisted to.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// The limits remembered for `key` ([`Limits::NONE`] if none).
    pub fn limits(&self, key: &MemoryKey) -> Limits {
        self.entries.get(key).map_or(Limits::NONE, |e| e.limits)
    }

    /// Sets the limits for `key` and persists them.
    pub fn set_limits(&mut self, key: &MemoryKey, limits: Limits) -> Result<(), MemoryError> {
        let e = self.entry(key);
        if e.limits == limits {
            return Ok(());
        }
        e.limits = limits;
        self.save()
    }

    /// Forgets everything (and persists that).
    pub fn clear(&mut self) -> Result<(), MemoryError> {
        self.entries.clear();
        self.save()
    }

    /// Number of remembered keys.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Every remembered key with its limits.
    pub fn iter(&self) -> impl Iterator<Item = (&MemoryKey, Limits)> {
        self.entries.iter().map(|(k, e)| (k, e.limits))
    }

    pub(crate) fn entry(&mut self, key: &MemoryKey) -> &mut Entry {
        // Look up first: cloning the key (strings) on every hit was most of a step's overhead.
        if !self.entries.contains_key(key) {
            return self.entries.entry(key.clone()).or_default();
        }
        self.entries
            .get_mut(key)
            .unwrap_or_else(|| unreachable!("the key was just found"))
    }

    /// Writes the file (no-op without one).
    pub fn save(&self) -> Result<(), MemoryError> {
        let Some(path) = &self.path else {
            return Ok(());
        };
        let mut plans: Vec<FileEntry> = self
            .entries
            .iter()
            .filter(|(_, e)| e.limits != Limits::NONE)
            .map(|(k, e)| FileEntry {
                key: k.clone(),
                limits: e.limits,
            })
            .collect();
        plans.sort_by(|a, b| {
            (&a.key.site, &a.key.device.name, a.key.device.ordinal).cmp(&(
                &b.key.site,
                &b.key.device.name,
                b.key.device.ordinal,
            ))
        });
        let text = serde_json::to_string_pretty(&FileFormat {
            version: VERSION,
            plans,
        })
        .map_err(|e| MemoryError::Format {
            path: path.clone(),
            message: e.to_string(),
        })?;
        let tmp = path.with_extension("json.tmp");
        let io = |source| MemoryError::Io {
            path: path.clone(),
            source,
        };
        std::fs::write(&tmp, text).map_err(io)?;
        std::fs::rename(&tmp, path).map_err(io)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_give_plans_and_grow_back() {
        let l = Limits::NONE;
        assert_eq!(l.plan_for(100), BatchPlan::whole(100).ok());
        let p = BatchPlan::new(100, 4).unwrap();
        let l = l.learned(&p, 100);
        assert_eq!(l.micro_batch, Some(25));
        assert_eq!(l.batch, None);
        assert_eq!(l.plan_for(100), Some(p));
        assert_eq!(l.plan_for(10), BatchPlan::whole(10).ok());
        let up = l.one_up(100).unwrap();
        assert_eq!(up.micro_batch, Some(50));
        assert_eq!(up.one_up(100).unwrap().micro_batch, None);
        assert_eq!(Limits::NONE.one_up(100), None);
        // a shrunk batch grows back first
        let shrunk = Limits::NONE.learned(&BatchPlan::with_micro_batch(20, 10).unwrap(), 100);
        assert_eq!(shrunk.batch, Some(20));
        assert_eq!(shrunk.micro_batch, Some(10));
        let up = shrunk.one_up(100).unwrap();
        assert_eq!((up.batch, up.micro_batch), (Some(40), Some(10)));
    }

    #[test]
    fn bad_files_are_clear_errors() {
        let dir = std::env::temp_dir();
        let p = dir.join(format!("oomguard-memory-bad-{}.json", std::process::id()));
        std::fs::write(&p, "{not json").unwrap();
        let e = PlanMemory::open(&p).unwrap_err();
        assert!(e.to_string().contains("is not valid"), "{e}");
        std::fs::write(&p, r#"{"version": 99, "plans": []}"#).unwrap();
        let e = PlanMemory::open(&p).unwrap_err();
        assert!(e.to_string().contains("version 99"), "{e}");
        std::fs::remove_file(&p).unwrap();
    }
}
