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

/// The remembered plans. Kept in memory; with a file, every change is written to it: under a
/// lock file (`<path>.lock`, waited for at most [`LOCK_WAIT`]), merged with what other writers
/// (threads, processes) saved since (their keys are kept, ours win), through a temporary file
/// of a unique name renamed over the old one.
///
/// ```
/// use oomguard_runtime::retry::{Limits, PlanMemory};
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
            error: None,
            generation: next_generation(),
        }
    }
}

/// How long a save waits for another writer's lock on the plan file before it fails (it never
/// hangs). A lock file older than [`STALE_LOCK`] is taken over (its writer died): by exactly
/// one waiting writer, and a writer whose lock was taken over while it stalled writes nothing
/// and returns an error.
pub const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(5);
/// See [`LOCK_WAIT`].
pub const STALE_LOCK: std::time::Duration = std::time::Duration::from_secs(30);

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
            error: None,
            generation: next_generation(),
        })
    }

    /// [`PlanMemory::open`], or when the file cannot be read (corrupt, another version,
    /// unreadable) an in-memory memory that says why in [`PlanMemory::error`] (and so in every
    /// step's [`RetryReport::memory_error`](super::RetryReport::memory_error)), after a warning.
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
        self.save()
    }

    /// Forgets everything (and persists that: the file is emptied, other writers' plans too).
    pub fn clear(&mut self) -> Result<(), MemoryError> {
        self.generation = next_generation();
        self.entries.clear();
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
            }
            Err(e) => self.error = Some(e.to_string()),
        }
        out
    }

    fn save_to(&self, path: &Path) -> Result<(), MemoryError> {
        let io = |source| MemoryError::Io {
            path: path.to_path_buf(),
            source,
        };
        let lock = FileLock::acquire(path).map_err(io)?;
        let mut merged: HashMap<MemoryKey, Limits> = HashMap::default();
        if !self.cleared {
            // Another writer's plans since we read the file: keep them. A file that became
            // unreadable is replaced (and said so).
            match read_file(path) {
                Ok(theirs) => merged.extend(theirs),
                Err(e) => {
                    tracing::warn!(target: "oomguard::retry", error = %e, "replacing the plan file")
                }
            }
        }
        for (k, e) in &self.entries {
            merged.insert(k.clone(), e.limits);
        }
        let mut plans: Vec<FileEntry> = merged
            .into_iter()
            .filter(|(_, l)| *l != Limits::NONE)
            .map(|(key, limits)| FileEntry { key, limits })
            .collect();
        plans.sort_by(|a, b| {
            (
                &a.key.site,
                &a.key.device.name,
                a.key.device.ordinal,
                a.key.mode as u8,
            )
                .cmp(&(
                    &b.key.site,
                    &b.key.device.name,
                    b.key.device.ordinal,
                    b.key.mode as u8,
                ))
        });
        let text = serde_json::to_string_pretty(&FileFormat {
            version: VERSION,
            plans,
        })
        .map_err(|e| MemoryError::Format {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        // A unique temporary name: two writers never write the same temporary file.
        static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = path.with_extension(format!("json.{}.{seq}.tmp", std::process::id()));
        if let Err(e) = std::fs::write(&tmp, text) {
            let _ = std::fs::remove_file(&tmp);
            return Err(io(e));
        }
        if !lock.held() {
            let _ = std::fs::remove_file(&tmp);
            return Err(io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "the lock on {} was taken over by another writer while this one stalled \
                     (more than {STALE_LOCK:?}): not written",
                    path.display()
                ),
            )));
        }
        std::fs::rename(&tmp, path).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            io(e)
        })
    }
}

/// The entries of a plan file (none when it does not exist).
fn read_file(path: &Path) -> Result<Vec<(MemoryKey, Limits)>, MemoryError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(MemoryError::Io {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    let file: FileFormat = serde_json::from_str(&text).map_err(|e| MemoryError::Format {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    if file.version != VERSION {
        return Err(MemoryError::Format {
            path: path.to_path_buf(),
            message: format!(
                "version {} (this oomguard reads version {VERSION})",
                file.version
            ),
        });
    }
    Ok(file.plans.into_iter().map(|e| (e.key, e.limits)).collect())
}

/// `<path>.lock`, held by the writer whose token it contains.
///
/// Every lock instance carries a token unique to its writer and acquisition (process id, a
/// per-process sequence number, the time). It is created with its token in one step (a
/// private file hard-linked to the lock's name, which fails if the name exists), and read back
/// after creation (verify-after-acquire). The right to *delete* an instance is taken by
/// creating its end marker `<lock>.end.<token>` exclusively: its owner does so on release, a
/// waiter does so when the instance is stale ([`STALE_LOCK`]); exactly one of them gets it,
/// and only the one that does deletes the lock, after checking that the lock still holds that
/// token. So a stale lock is taken over by exactly one writer, and a lock is never deleted from
/// under a live owner (an owner that was taken over learns so on release and says so).
struct FileLock {
    lock: PathBuf,
    token: String,
}

/// Hook for tests: runs between a waiter's judging a lock stale and its claim to delete it
/// (the race the end marker closes).
#[cfg(test)]
static STALE_HOOK: std::sync::Mutex<Option<fn()>> = std::sync::Mutex::new(None);

fn lock_token() -> String {
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{}-{seq}-{nanos}", std::process::id())
}

/// A file's name with `suffix` appended (`plans.json.lock` + `.end.T`).
fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut s = path.as_os_str().to_os_string();
    s.push(suffix);
    PathBuf::from(s)
}

fn create_exclusive(path: &Path, contents: &str) -> std::io::Result<()> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)?;
    f.write_all(contents.as_bytes())
}

impl FileLock {
    fn acquire(path: &Path) -> std::io::Result<FileLock> {
        let lock = path.with_extension("json.lock");
        let token = lock_token();
        let started = std::time::Instant::now();
        loop {
            match Self::create(&lock, &token) {
                Ok(()) => {
                    // Verify after acquiring: the lock holds our token.
                    if std::fs::read_to_string(&lock).is_ok_and(|t| t == token) {
                        return Ok(FileLock { lock, token });
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    let theirs = std::fs::read_to_string(&lock).ok();
                    let stale = std::fs::metadata(&lock)
                        .and_then(|m| m.modified())
                        .ok()
                        .and_then(|t| t.elapsed().ok())
                        .is_some_and(|age| age > STALE_LOCK);
                    if let (true, Some(theirs)) = (stale, theirs) {
                        #[cfg(test)]
                        if let Some(hook) = *STALE_HOOK.lock().unwrap_or_else(|e| e.into_inner()) {
                            hook();
                        }
                        if Self::end(&lock, &theirs) {
                            tracing::warn!(
                                target: "oomguard::retry",
                                lock = %lock.display(),
                                "took over a stale plan-file lock (its writer stopped more than {STALE_LOCK:?} ago)"
                            );
                        }
                        continue;
                    }
                    if started.elapsed() > LOCK_WAIT {
                        return Err(std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            format!(
                                "{} is held by another writer (waited {LOCK_WAIT:?}; a lock \
                                 older than {STALE_LOCK:?} is taken over)",
                                lock.display()
                            ),
                        ));
                    }
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Creates `lock` holding `token`, in one step where the file system can link files.
    fn create(lock: &Path, token: &str) -> std::io::Result<()> {
        let private = with_suffix(lock, &format!(".{token}.tmp"));
        create_exclusive(&private, token)?;
        let linked = std::fs::hard_link(&private, lock);
        let _ = std::fs::remove_file(&private);
        match linked {
            Err(e)
                if e.kind() != std::io::ErrorKind::AlreadyExists
                    && e.kind() != std::io::ErrorKind::NotFound =>
            {
                // No hard links here (some network or FAT file systems): an exclusive create,
                // whose token is read back by the verification.
                create_exclusive(lock, token)
            }
            other => other,
        }
    }

    /// Deletes the lock instance holding `token` if this caller wins the right to (creating
    /// its end marker exclusively) and the lock still holds it. Returns whether it deleted it.
    fn end(lock: &Path, token: &str) -> bool {
        let marker = with_suffix(lock, &format!(".end.{token}"));
        if create_exclusive(&marker, "").is_err() {
            return false; // another waiter, or the owner, has it
        }
        // Only the holder of the marker deletes this instance: if the lock holds `token` now,
        // it still does when removed.
        let deleted = std::fs::read_to_string(lock).is_ok_and(|t| t == token)
            && std::fs::remove_file(lock).is_ok();
        let _ = std::fs::remove_file(&marker);
        deleted
    }

    /// Whether the lock still holds this writer's token (not taken over).
    fn held(&self) -> bool {
        std::fs::read_to_string(&self.lock).is_ok_and(|t| t == self.token)
    }
}

impl Drop for FileLock {
    fn drop(&mut self) {
        if !Self::end(&self.lock, &self.token) {
            tracing::warn!(
                target: "oomguard::retry",
                lock = %self.lock.display(),
                "the plan-file lock was taken over while held (this writer stalled for more than {STALE_LOCK:?})"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

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

    /// Writers wait at a stale lock, all judge it stale before any of them acts (the hook), and
    /// still exactly one holds the lock at any time; the lock of a live owner is never deleted.
    #[test]
    fn a_stale_lock_is_taken_over_by_exactly_one_writer() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let path = std::env::temp_dir().join(format!(
            "oomguard-memory-takeover-{}.json",
            std::process::id()
        ));
        let lock = path.with_extension("json.lock");
        // Every waiter judges the lock stale, then acts at a different time: some act after
        // another has already taken it over and made a fresh lock.
        *STALE_HOOK.lock().unwrap() = Some(|| {
            static N: AtomicUsize = AtomicUsize::new(0);
            let n = N.fetch_add(1, Ordering::Relaxed) as u64;
            std::thread::sleep(Duration::from_millis(5 + (n % 4) * 2));
        });
        let inside = AtomicUsize::new(0);
        let most = AtomicUsize::new(0);
        for _round in 0..5 {
            let f = std::fs::File::create(&lock).unwrap();
            std::io::Write::write_all(&mut &f, b"dead writer").unwrap();
            f.set_modified(std::time::SystemTime::now() - STALE_LOCK * 2)
                .unwrap();
            drop(f);
            let start = std::sync::Barrier::new(12);
            std::thread::scope(|s| {
                for _ in 0..12 {
                    s.spawn(|| {
                        start.wait();
                        let held = FileLock::acquire(&path).unwrap();
                        let n = inside.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(n, Ordering::SeqCst);
                        std::thread::sleep(Duration::from_millis(10));
                        assert!(held.held(), "the lock was deleted from under its owner");
                        inside.fetch_sub(1, Ordering::SeqCst);
                    });
                }
            });
            assert!(!lock.exists());
        }
        *STALE_HOOK.lock().unwrap() = None;
        assert_eq!(
            most.load(Ordering::SeqCst),
            1,
            "two writers held the lock at once"
        );
    }
}
