//! [`PlanMemory`]: the remembered plans, kept in memory and, with a file, saved on every change.

use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use std::path::{Path, PathBuf};

use super::file::{read_file, write_file, MemoryError};
use super::key::MemoryKey;
use super::limits::Limits;

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
    /// A regrow or a speed decision has spoken for this key: the engine's seed no longer
    /// stands for what is not remembered (a regrow that reached the whole batch leaves no cap,
    /// which must not read as "nothing learned yet").
    pub(crate) seed_outgrown: bool,
}

/// The remembered plans. Kept in memory; with a file, every change is written to it: under a
/// lock file (`<path>.lock`, waited for at most [`LOCK_WAIT`](crate::retry::advanced::LOCK_WAIT)), merged with what other writers
/// (threads, processes) saved since (the file's entries are kept; those this memory changed
/// are written over them), through a temporary file of a unique name renamed over the old
/// one. A symbolic link is written through to its target; a file this process may not write,
/// or one that became unreadable (another version's), is not replaced: the save fails and
/// [`PlanMemory::error`] says why.
///
/// ```
/// use oomguard_runtime::retry::advanced::{Limits, PlanMemory};
/// let path = std::env::temp_dir().join(format!("oomguard-doc-{}.json", std::process::id()));
/// let mem = PlanMemory::open(&path).unwrap(); // a missing file is an empty memory
/// assert!(mem.is_empty());
/// # let _ = std::fs::remove_file(&path);
/// ```
#[derive(Debug)]
pub struct PlanMemory {
    entries: HashMap<MemoryKey, Entry>,
    path: Option<PathBuf>,
    /// `clear` was called: the next save drops what other writers saved too.
    cleared: bool,
    /// Keys whose limits this memory set since its last successful save: only these are
    /// written over the file's (an entry only read from it never overwrites a newer one).
    changed: HashSet<MemoryKey>,
    /// The last error reading or writing the file, reported with every step.
    error: Option<String>,
    /// See [`PlanMemory::generation`].
    generation: u64,
}

/// Generations of every plan memory: no two memories, nor two states of one, share one.
static GENERATIONS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

fn next_generation() -> u64 {
    GENERATIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

impl Default for PlanMemory {
    fn default() -> Self {
        Self {
            entries: HashMap::default(),
            path: None,
            cleared: false,
            changed: HashSet::default(),
            error: None,
            generation: next_generation(),
        }
    }
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
        for (key, limits) in read_file(&path)? {
            entries.insert(
                key,
                Entry {
                    limits,
                    ..Entry::default()
                },
            );
        }
        Ok(Self {
            entries,
            path: Some(path),
            cleared: false,
            changed: HashSet::default(),
            error: None,
            generation: next_generation(),
        })
    }

    /// [`PlanMemory::open`], or when the file cannot be read (corrupt, another version,
    /// unreadable) an in-memory memory that says why in [`PlanMemory::error`] (and so in every
    /// step's [`RetryReport::memory_error`](crate::retry::RetryReport::memory_error)), after a warning.
    pub fn open_or_in_memory(path: impl AsRef<Path>) -> Self {
        match Self::open(path.as_ref()) {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(target: "oomguard::retry", error = %e, "plans are not persisted");
                Self {
                    error: Some(format!("{e}; plans are remembered in memory only")),
                    ..Self::default()
                }
            }
        }
    }

    /// The file this memory is persisted to.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// The last error reading or writing the file (`None`: none, or no file).
    pub fn error(&self) -> Option<&str> {
        self.error.as_deref()
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
        self.changed.insert(key.clone());
        self.save()
    }

    /// Forgets everything (and persists that: the file is emptied, other writers' plans too).
    pub fn clear(&mut self) -> Result<(), MemoryError> {
        self.generation = next_generation();
        self.entries.clear();
        self.changed.clear();
        self.cleared = true;
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

    /// A number that changes whenever anything in this memory may have changed (an entry
    /// looked up for writing, limits set, cleared, saved), to a value that no other memory had:
    /// a caller that saw nothing remembered for a key at one generation knows it is still so
    /// while the generation is the same.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Nothing remembered for `key` changes how its next step starts or ends (no limits, no
    /// thrash streak in progress) and the file has no error to report.
    pub(crate) fn is_pristine(&self, key: &MemoryKey) -> bool {
        self.error.is_none()
            && self
                .entries
                .get(key)
                .is_none_or(|e| e.limits == Limits::NONE && e.thrash_streak == 0)
    }

    pub(crate) fn entry(&mut self, key: &MemoryKey) -> &mut Entry {
        self.generation = next_generation();
        // Look up first: cloning the key (strings) on every hit was most of a step's overhead.
        if !self.entries.contains_key(key) {
            return self.entries.entry(key.clone()).or_default();
        }
        self.entries
            .get_mut(key)
            .unwrap_or_else(|| unreachable!("the key was just found"))
    }

    /// Writes the file (no-op without one), merged with what other writers saved: their keys
    /// are kept, ours win. A failure is returned and kept in [`PlanMemory::error`].
    pub fn save(&mut self) -> Result<(), MemoryError> {
        self.generation = next_generation();
        let Some(path) = self.path.clone() else {
            return Ok(());
        };
        let out = self.save_to(&path);
        match &out {
            Ok(()) => {
                self.error = None;
                self.cleared = false;
                self.changed.clear();
            }
            Err(e) => self.error = Some(e.to_string()),
        }
        out
    }

    fn save_to(&self, path: &Path) -> Result<(), MemoryError> {
        write_file(path, self.iter(), &self.changed, !self.cleared)
    }
}
