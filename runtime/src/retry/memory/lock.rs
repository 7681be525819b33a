//! The plan file's lock (`<path>.lock`): one writer at a time, a stale lock taken over by
//! exactly one waiter.

use std::path::{Path, PathBuf};

/// How long a save waits for another writer's lock on the plan file before it fails (it never
/// hangs). A lock file older than [`STALE_LOCK`] is taken over (its writer died), at once when
/// its writer was a process of this machine that no longer exists (Linux): by exactly one
/// waiting writer, and a writer whose lock was taken over while it stalled writes nothing
/// and returns an error.
pub const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(5);
/// See [`LOCK_WAIT`].
pub const STALE_LOCK: std::time::Duration = std::time::Duration::from_secs(30);

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
pub(super) struct FileLock {
    lock: PathBuf,
    token: String,
}

/// Hook for tests: runs between a waiter's judging a lock stale and its claim to delete it
/// (the race the end marker closes).
#[cfg(test)]
pub(super) static STALE_HOOK: std::sync::Mutex<Option<fn()>> = std::sync::Mutex::new(None);

fn lock_token() -> String {
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let host = host_id().unwrap_or_default();
    format!("{}-{seq}-{nanos}@{host}", std::process::id())
}

/// This machine's name where the system tells it (Linux: `/proc/sys/kernel/hostname`), read
/// once (a waiting writer asks at every poll).
pub(super) fn host_id() -> Option<&'static str> {
    static HOST: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    HOST.get_or_init(|| {
        let h = std::fs::read_to_string("/proc/sys/kernel/hostname").ok()?;
        let h = h.trim();
        // (it goes into file names: only a plain name)
        let plain = h
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'));
        (!h.is_empty() && plain).then(|| h.to_string())
    })
    .as_deref()
}

/// Whether the writer of `token` is known to be gone: a process of this machine (the token
/// names its host) that no longer exists (its `/proc` entry is gone: killed, `SIGKILL` by the
/// out-of-memory killer included). Unknown (another machine, an older token, no `/proc`):
/// `false`, and only the lock's age makes it stale.
fn writer_is_gone(token: &str) -> bool {
    let Some((head, host)) = token.rsplit_once('@') else {
        return false;
    };
    let Some(pid) = head.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
        return false;
    };
    host_id() == Some(host)
        && pid != std::process::id()
        && std::path::Path::new("/proc/self").exists()
        && !std::path::Path::new(&format!("/proc/{pid}")).exists()
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
    pub(super) fn acquire(path: &Path) -> std::io::Result<FileLock> {
        // `<path>.lock`, as documented: `with_extension` replaced the file's own extension, so
        // `plans.v1` and `plans.v2` shared `plans.json.lock` (and tests' `x.json-<pid>` files
        // of two processes one lock)
        let lock = with_suffix(path, ".lock");
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
                    let stale = theirs.as_deref().is_some_and(writer_is_gone)
                        || std::fs::metadata(&lock)
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
                                "took over a stale plan-file lock (its writer's process is gone, or it stopped more than {STALE_LOCK:?} ago)"
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
                Err(e) => {
                    return Err(std::io::Error::new(
                        e.kind(),
                        format!("cannot create the lock file {}: {e}", lock.display()),
                    ))
                }
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
    pub(super) fn held(&self) -> bool {
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
