//! Why a trace could not be read.

use std::path::PathBuf;

/// A trace file that could not be read: where, and what is wrong.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The file could not be opened or read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is empty.
    #[error("empty file: not a trace")]
    Empty,
    /// The content is none of the known formats.
    #[error(
        "unknown trace format (first line {first_line:?}); expected a CSV with header \
         `op,id,bytes,stream`, an RMM log with header `Thread,Time,Action,Pointer,Size,Stream`, \
         or a PyTorch memory snapshot pickle"
    )]
    UnknownFormat {
        /// The start of the file, for the message.
        first_line: String,
    },
    /// A line of a CSV trace or RMM log is malformed.
    #[error("line {line}: {message}")]
    Line {
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// A pickle is malformed or truncated.
    #[error("pickle byte offset {offset}: {message}")]
    Pickle {
        /// Byte offset of the opcode at fault.
        offset: usize,
        /// What is wrong.
        message: String,
    },
    /// A snapshot decoded but does not have the structure of a PyTorch memory snapshot.
    #[error("not a PyTorch memory snapshot: {0}")]
    Snapshot(String),
    /// The trace has no events.
    #[error("the trace has no allocation events")]
    NoEvents,
    /// More than 2^64 bytes are live at once at some event: no device holds that, and no
    /// figure of bytes could be told (they are 64-bit).
    #[error(
        "event {event}: more than 16 EiB (2^64 bytes) live at once; no device holds that, so \
         this is not a trace of one"
    )]
    TooMuchLive {
        /// The 1-based index of the allocation that passed it.
        event: usize,
    },
    /// The input is larger than the largest trace read ([`crate::detect::MAX_TRACE_BYTES`]).
    #[error("{path}: larger than {limit} bytes, the largest trace this command reads")]
    TooLarge {
        /// The file (`-`: standard input).
        path: PathBuf,
        /// The limit, in bytes.
        limit: u64,
    },
    /// This machine's memory could not hold the trace's events.
    #[error(
        "not enough memory on this machine to read the trace's {events} lines as events (cut \
         the trace into parts)"
    )]
    OutOfMemory {
        /// The lines of the trace.
        events: usize,
    },
}

impl ReadError {
    pub(crate) fn line(line: usize, message: impl Into<String>) -> Self {
        ReadError::Line {
            line,
            message: message.into(),
        }
    }
}
