//! The plan file: its JSON format, read and written (merged with other writers') under its lock.

use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::key::MemoryKey;
use super::limits::Limits;
use super::lock::{FileLock, STALE_LOCK};

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

/// Writes the plan file at `path` under its lock. With `keep_theirs`, the file as it is now
/// (other writers' saves since it was read) with `ours`' entries whose keys are in `changed`
/// written over it: an entry this writer only read never overwrites a newer one. Without
/// (after a clear), `ours` alone. A file that became one this oomguard cannot read (another
/// version's) is not replaced: an error. A symbolic link is written through (its target is
/// replaced, not the link); a file this process may not write is refused, not replaced.
pub(super) fn write_file<'a>(
    path: &Path,
    ours: impl Iterator<Item = (&'a MemoryKey, Limits)>,
    changed: &HashSet<MemoryKey>,
    keep_theirs: bool,
) -> Result<(), MemoryError> {
    let path = &written_path(path)?;
    let io = |source| MemoryError::Io {
        path: path.to_path_buf(),
        source,
    };
    let lock = FileLock::acquire(path).map_err(io)?;
    let mut merged: HashMap<MemoryKey, Limits> = HashMap::default();
    if keep_theirs {
        let theirs = read_file(path).map_err(|e| MemoryError::Format {
            path: path.to_path_buf(),
            message: format!(
                "it changed since it was read and cannot be read now ({}): not replaced",
                match &e {
                    MemoryError::Io { source, .. } => source.to_string(),
                    MemoryError::Format { message, .. } => message.clone(),
                }
            ),
        })?;
        merged.extend(theirs);
    }
    for (k, limits) in ours {
        if !keep_theirs || changed.contains(k) {
            merged.insert(k.clone(), limits);
        }
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

/// The path a write replaces: `path`, or the file a symbolic link at `path` points to; an
/// existing file must be one this process may write.
fn written_path(path: &Path) -> Result<PathBuf, MemoryError> {
    let io = |source| MemoryError::Io {
        path: path.to_path_buf(),
        source,
    };
    let is_link = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink());
    let real = if is_link {
        std::fs::canonicalize(path).map_err(io)?
    } else {
        path.to_path_buf()
    };
    // (not opened for writing below unless regular: a FIFO would block until a reader came;
    // its mode: a file marked read-only is kept as it is even by a process allowed to write
    // it, root's)
    if regular_file(&real)?.is_some_and(|m| m.permissions().readonly()) {
        return Err(MemoryError::Io {
            path: real,
            source: std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                "the file is read-only: not replaced",
            ),
        });
    }
    match std::fs::OpenOptions::new().write(true).open(&real) {
        // (opening for writing changes nothing: the temporary file is renamed over it)
        Ok(_) => Ok(real),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(real),
        Err(e) => Err(MemoryError::Io {
            path: real,
            source: std::io::Error::new(e.kind(), format!("{e}: not replaced")),
        }),
    }
}

/// The metadata of the regular file at `path` (`None`: nothing there, or it cannot be read,
/// which the caller's open then says); anything but a regular file (a directory, a FIFO that
/// would block its reader or writer) is an error.
fn regular_file(path: &Path) -> Result<Option<std::fs::Metadata>, MemoryError> {
    match std::fs::metadata(path) {
        Ok(m) if !m.is_file() => Err(MemoryError::Io {
            path: path.to_path_buf(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a regular file"),
        }),
        Ok(m) => Ok(Some(m)),
        Err(_) => Ok(None),
    }
}

/// The entries of a plan file (none when it does not exist). Anything but a regular file is an
/// error ([`regular_file`]).
pub(super) fn read_file(path: &Path) -> Result<Vec<(MemoryKey, Limits)>, MemoryError> {
    regular_file(path)?;
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
    let format = |e: serde_json::Error| MemoryError::Format {
        path: path.to_path_buf(),
        message: e.to_string(),
    };
    // the version first: another version's entries need not parse as this one's
    #[derive(Deserialize)]
    struct Header {
        version: u32,
    }
    let header: Header = serde_json::from_str(&text).map_err(format)?;
    if header.version != VERSION {
        return Err(MemoryError::Format {
            path: path.to_path_buf(),
            message: format!(
                "version {} (this oomguard reads version {VERSION})",
                header.version
            ),
        });
    }
    let file: FileFormat = serde_json::from_str(&text).map_err(format)?;
    // the engine never learns a cap of 0 rows: one in the file is a corrupted entry (it ran
    // every step at that call site as micro-batches of 1 row)
    if let Some(e) = file
        .plans
        .iter()
        .find(|e| e.limits.micro_batch == Some(0) || e.limits.batch == Some(0))
    {
        return Err(MemoryError::Format {
            path: path.to_path_buf(),
            message: format!(
                "the plan of {} caps a batch or micro-batch at 0 rows",
                e.key.site
            ),
        });
    }
    Ok(file.plans.into_iter().map(|e| (e.key, e.limits)).collect())
}
