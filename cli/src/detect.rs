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
    let file = std::fs::File::open(path).map_err(|source| ReadError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    read_from(file, path, Some(path))
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
