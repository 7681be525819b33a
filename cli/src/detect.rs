//! Telling trace formats apart, from content first and extension second.

use std::io::Read;
use std::path::Path;

use crate::error::ReadError;
use crate::event::{Trace, TraceFormat};

/// The format of `data` (named `path`, whose extension is a hint for pickles without a
/// protocol header). `None`: none of the known formats.
///
/// ```
/// use oomguard_cli::{detect::detect, TraceFormat};
/// assert_eq!(detect(b"op,id,bytes,stream\n", None), Some(TraceFormat::Csv));
/// assert_eq!(detect(b"op,id,bytes,stream,thread\n", None), Some(TraceFormat::Csv));
/// assert_eq!(detect(b"\x80\x04}\x94.", None), Some(TraceFormat::PytorchSnapshot));
/// assert_eq!(detect(b"hello", None), None);
/// ```
pub fn detect(data: &[u8], path: Option<&Path>) -> Option<TraceFormat> {
    if data.first() == Some(&0x80) {
        return Some(TraceFormat::PytorchSnapshot);
    }
    let first = crate::lines::first_line(data).replace(' ', "");
    if crate::csv_trace::is_header(&first) {
        return Some(TraceFormat::Csv);
    }
    if first.eq_ignore_ascii_case(crate::rmm::HEADER) {
        return Some(TraceFormat::RmmLog);
    }
    let ext = path
        .and_then(|p| p.extension())
        .and_then(|e| e.to_str())
        .map(|e| e.to_ascii_lowercase());
    match ext.as_deref() {
        Some("pickle" | "pkl") => Some(TraceFormat::PytorchSnapshot),
        _ => None,
    }
}

/// Parses `data` in the format detected from it.
pub fn parse(data: &[u8], path: Option<&Path>) -> Result<Trace, ReadError> {
    if data.is_empty() {
        return Err(ReadError::Empty);
    }
    let mut t = match detect(data, path) {
        Some(TraceFormat::Csv) => crate::csv_trace::parse(data),
        Some(TraceFormat::RmmLog) => crate::rmm::parse(data),
        Some(TraceFormat::PytorchSnapshot) => crate::snapshot::parse(data),
        None => Err(ReadError::UnknownFormat {
            first_line: crate::lines::first_line(data).chars().take(60).collect(),
        }),
    }?;
    if t.format != TraceFormat::PytorchSnapshot && data.last() != Some(&b'\n') {
        t.notes.push(
            "the last line has no newline at its end: the file may have been cut there".into(),
        );
    }
    check_live_bytes(&t)?;
    t.note_live_at_end();
    Ok(t)
}

/// Refuses a trace with more than 2^64 bytes live at once (the figures of bytes, 64-bit, would
/// stop there and be wrong).
fn check_live_bytes(t: &Trace) -> Result<(), ReadError> {
    t.checked_peak_live()
        .map(drop)
        .map_err(|event| ReadError::TooMuchLive { event })
}

/// The largest trace read (16 GiB): a bound on the memory an endless input (`/dev/zero`, a
/// pipe that never closes) can take; PyTorch snapshots of real runs are far smaller.
pub const MAX_TRACE_BYTES: u64 = 16 << 30;

/// What is read before the format is known: an input that is none of the formats is refused
/// after this much, not read to its end.
const HEAD_BYTES: u64 = 64 << 10;

/// Reads and parses the trace file at `path`; `-` reads standard input. The format is told from
/// the first 64 KiB; the rest is read only for a known format, up to [`MAX_TRACE_BYTES`].
pub fn read_trace(path: &Path) -> Result<Trace, ReadError> {
    if path == Path::new("-") {
        return read_from(std::io::stdin().lock(), path, None);
    }
    let io = |source| ReadError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = open_without_waiting(path).map_err(io)?;
    if file.metadata().map_err(io)?.file_type().is_file() {
        read_from(file, path, Some(path))
    } else {
        read_from(
            PolledRead {
                file,
                started: false,
                waiting_since: None,
            },
            path,
            Some(path),
        )
    }
}

/// Opens `path` for reading without waiting for a writer: a FIFO's `open` blocks until one
/// comes (so `cat` hangs on a FIFO nobody writes); opened non-blocking, a FIFO with no writer
/// reads as empty, and one with a writer is read through [`PolledRead`].
fn open_without_waiting(path: &Path) -> std::io::Result<std::fs::File> {
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::custom_flags(&mut options, libc::O_NONBLOCK);
    options.open(path)
}

/// How long a FIFO is given to find a writer before its input counts as empty.
const WRITER_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// A non-blocking reader (a FIFO, a device) read as a blocking one: a read that would block
/// waits a moment and tries again. Until the first byte, an end of input may be a writer that
/// has not opened the FIFO yet: it is waited for up to [`WRITER_WAIT`], then the input is
/// empty; after it, end of input is the writer closing.
struct PolledRead {
    file: std::fs::File,
    /// Whether a byte has come (then an end of input is the writer closing).
    started: bool,
    /// Since when an end of input before the first byte has been seen.
    waiting_since: Option<std::time::Instant>,
}

impl PolledRead {
    /// Whether [`WRITER_WAIT`] has passed since the first end of input.
    fn writer_wait_over(&mut self) -> bool {
        let since = *self
            .waiting_since
            .get_or_insert_with(std::time::Instant::now);
        since.elapsed() >= WRITER_WAIT
    }
}

impl Read for PolledRead {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            match self.file.read(buf) {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Ok(0) if !self.started && !buf.is_empty() && !self.writer_wait_over() => {}
                r => {
                    self.started |= matches!(r, Ok(n) if n > 0);
                    return r;
                }
            }
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
    }
}

fn read_from(mut r: impl Read, path: &Path, hint: Option<&Path>) -> Result<Trace, ReadError> {
    let io = |source| ReadError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut data = Vec::new();
    (&mut r)
        .take(HEAD_BYTES)
        .read_to_end(&mut data)
        .map_err(io)?;
    if !data.is_empty() && detect(&data, hint).is_none() {
        return parse(&data, hint);
    }
    let limit = MAX_TRACE_BYTES;
    r.take(limit + 1 - data.len() as u64)
        .read_to_end(&mut data)
        .map_err(io)?;
    if data.len() as u64 > limit {
        return Err(ReadError::TooLarge {
            path: path.to_path_buf(),
            limit,
        });
    }
    parse(&data, hint)
}
