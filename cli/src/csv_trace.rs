//! The `op,id,bytes,stream` CSV trace format: reader and writer.
//!
//! ```text
//! op,id,bytes,stream
//! a,0,154389504,0
//! f,0,154389504,0
//! ```
//! `a` allocates `bytes` under a new `id`; `f` frees the allocation `id`.
//!
//! An optional fifth column, `thread` (header `op,id,bytes,stream,thread`), names the recording
//! process's thread that made the call (a number; 0: unknown). Without it, every event has
//! thread 0: one thread.

use std::collections::HashMap;
use std::fmt::Write as _;

use crate::error::ReadError;
use crate::event::{Event, Op, Trace, TraceFormat};
use crate::lines::{body_lines, parse_u64};

/// The header line of the format.
pub const HEADER: &str = "op,id,bytes,stream";

/// The header line of the format with its `thread` column.
pub const HEADER_THREADS: &str = "op,id,bytes,stream,thread";

/// Whether `line` (a first line, trimmed) is one of the format's headers.
pub(crate) fn is_header(line: &str) -> bool {
    // Case-insensitive, as detection is.
    let h = line.replace(' ', "");
    h.eq_ignore_ascii_case(HEADER) || h.eq_ignore_ascii_case(HEADER_THREADS)
}

/// Parses a CSV trace. Errors name the line: a bad op, a bad number, a duplicate id, a free of an
/// id that is not live.
///
/// ```
/// let t = oomguard_cli::csv_trace::parse(b"op,id,bytes,stream\na,7,100,0\nf,7,100,0\n").unwrap();
/// assert_eq!(t.events.len(), 2);
/// let e = oomguard_cli::csv_trace::parse(b"op,id,bytes,stream\nf,7,100,0\n").unwrap_err();
/// assert_eq!(e.to_string(), "line 2: free of id 7, which is not live");
/// ```
pub fn parse(data: &[u8]) -> Result<Trace, ReadError> {
    if data.is_empty() {
        return Err(ReadError::Empty);
    }
    let header = crate::lines::first_line(data);
    if !is_header(&header) {
        return Err(ReadError::line(
            1,
            format!(
                "expected the header `{HEADER}` or `{HEADER_THREADS}`, found {}",
                crate::lines::quoted(&header)
            ),
        ));
    }
    let threads = header.replace(' ', "").eq_ignore_ascii_case(HEADER_THREADS);
    let (columns, names) = if threads {
        (5, HEADER_THREADS)
    } else {
        (4, HEADER)
    };
    // What the events and their ids take is reserved first, so that a trace too large for this
    // machine's memory is an error, not an abort on a failed allocation.
    let lines = data.iter().filter(|&&b| b == b'\n').count() + 1;
    let mut events = Vec::new();
    // id -> (bytes, line of its allocation); ids once freed stay reserved.
    let mut live: HashMap<u64, u64> = HashMap::new();
    let mut used: std::collections::HashSet<u64> = std::collections::HashSet::new();
    crate::host_memory::fallible(|| {
        events
            .try_reserve_exact(lines)
            .and_then(|()| used.try_reserve(lines / 2))
    })
    .map_err(|_| ReadError::OutOfMemory { events: lines })?;
    for item in body_lines(data) {
        let (n, line) = item?;
        let fields: Vec<&str> = line.split(',').collect();
        if fields.len() != columns {
            return Err(ReadError::line(
                n,
                format!(
                    "expected {columns} fields ({names}), found {}",
                    fields.len()
                ),
            ));
        }
        let op = match fields[0].trim() {
            "a" | "alloc" => Op::Alloc,
            "f" | "free" => Op::Free,
            other => {
                return Err(ReadError::line(
                    n,
                    format!(
                        "unknown op {} (expected `a` or `f`)",
                        crate::lines::quoted(other)
                    ),
                ))
            }
        };
        let id = parse_u64(n, "id", fields[1])?;
        let bytes = parse_u64(n, "bytes", fields[2])?;
        let stream = parse_u64(n, "stream", fields[3])?;
        let thread = if threads {
            parse_u64(n, "thread", fields[4])?
        } else {
            0
        };
        match op {
            Op::Alloc => {
                if !used.insert(id) {
                    return Err(ReadError::line(n, format!("duplicate allocation id {id}")));
                }
                live.insert(id, bytes);
                events.push(Event::alloc(id, bytes, stream).on_thread(thread));
            }
            Op::Free => {
                let Some(size) = live.remove(&id) else {
                    return Err(ReadError::line(
                        n,
                        format!("free of id {id}, which is not live"),
                    ));
                };
                events.push(Event::free(id, size, stream).on_thread(thread));
            }
        }
    }
    if events.is_empty() {
        return Err(ReadError::NoEvents);
    }
    Ok(Trace::new(TraceFormat::Csv, events))
}

/// Writes `events` in this format (header included), with the `thread` column when any event
/// names a thread.
///
/// ```
/// use oomguard_cli::{csv_trace, Event};
/// let s = csv_trace::write(&[Event::alloc(0, 512, 0), Event::free(0, 512, 0)]);
/// assert_eq!(s, "op,id,bytes,stream\na,0,512,0\nf,0,512,0\n");
/// assert_eq!(csv_trace::parse(s.as_bytes()).unwrap().events.len(), 2);
/// let s = csv_trace::write(&[Event::alloc(0, 512, 0).on_thread(1), Event::free(0, 512, 0).on_thread(2)]);
/// assert_eq!(s, "op,id,bytes,stream,thread\na,0,512,0,1\nf,0,512,0,2\n");
/// ```
pub fn write(events: &[Event]) -> String {
    let threads = events.iter().any(|e| e.thread != 0);
    let header = if threads { HEADER_THREADS } else { HEADER };
    let mut s = String::with_capacity(events.len() * 24 + header.len() + 1);
    s.push_str(header);
    s.push('\n');
    for e in events {
        let op = match e.op {
            Op::Alloc => 'a',
            Op::Free => 'f',
        };
        let _ = write!(s, "{op},{},{},{}", e.id, e.bytes, e.stream);
        if threads {
            let _ = write!(s, ",{}", e.thread);
        }
        s.push('\n');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(s: &str) -> String {
        parse(s.as_bytes()).unwrap_err().to_string()
    }

    #[test]
    fn reads_events_and_crlf() {
        let t = parse(b"op,id,bytes,stream\r\na,1,10,0\r\na,2,20,5\r\n\r\nf,1,10,0\r\n").unwrap();
        assert_eq!(
            t.events,
            vec![
                Event::alloc(1, 10, 0),
                Event::alloc(2, 20, 5),
                Event::free(1, 10, 0)
            ]
        );
        assert_eq!(t.peak_live_bytes(), 30);
    }

    #[test]
    fn malformed_lines_are_named() {
        assert_eq!(err(""), "empty file: not a trace");
        assert_eq!(
            err("op,id,bytes,stream\n"),
            "the trace has no allocation events"
        );
        assert!(err("x,y\n").starts_with("line 1: expected the header"));
        assert_eq!(
            err("op,id,bytes,stream\na,1,10,0\nq,2,3,0\n"),
            "line 3: unknown op \"q\" (expected `a` or `f`)"
        );
        assert_eq!(
            err("op,id,bytes,stream\na,1,10,0\na,1,10,0\n"),
            "line 3: duplicate allocation id 1"
        );
        assert_eq!(
            err("op,id,bytes,stream\na,1,10,0\nf,1,10,0\nf,1,10,0\n"),
            "line 4: free of id 1, which is not live"
        );
        assert_eq!(
            err("op,id,bytes,stream\na,1,99999999999999999999999,0\n"),
            "line 2: bytes \"99999999999999999999999\": too large for 64 bits"
        );
        assert_eq!(
            err("op,id,bytes,stream\na,1,-4,0\n"),
            "line 2: bytes \"-4\": not a non-negative integer"
        );
        assert_eq!(
            err("op,id,bytes,stream\na,1,4\n"),
            "line 2: expected 4 fields (op,id,bytes,stream), found 3"
        );
        assert_eq!(
            parse(b"op,id,bytes,stream\na,1,4,0\n\xff\xfe\n")
                .unwrap_err()
                .to_string(),
            "line 3: not valid UTF-8 text"
        );
    }

    #[test]
    fn thread_column_is_read_and_checked() {
        let t = parse(b"op,id,bytes,stream,thread\na,1,10,0,7\nf,1,10,0,9\n").unwrap();
        assert_eq!(
            t.events,
            vec![
                Event::alloc(1, 10, 0).on_thread(7),
                Event::free(1, 10, 0).on_thread(9)
            ]
        );
        // without the column: thread 0
        let t = parse(b"op,id,bytes,stream\na,1,10,0\n").unwrap();
        assert_eq!(t.events[0].thread, 0);
        assert_eq!(
            err("op,id,bytes,stream,thread\na,1,10,0,x\n"),
            "line 2: thread \"x\": not a non-negative integer"
        );
        assert_eq!(
            err("op,id,bytes,stream,thread\na,1,10,0,1\na,2,10,0,-1\n"),
            "line 3: thread \"-1\": not a non-negative integer"
        );
        assert_eq!(
            err("op,id,bytes,stream,thread\na,1,10,0,\n"),
            "line 2: thread \"\": missing"
        );
        assert_eq!(
            err("op,id,bytes,stream,thread\na,1,10,0\n"),
            "line 2: expected 5 fields (op,id,bytes,stream,thread), found 4"
        );
        // a thread column under the four-column header is a fifth field too many
        assert_eq!(
            err("op,id,bytes,stream\na,1,10,0,1\n"),
            "line 2: expected 4 fields (op,id,bytes,stream), found 5"
        );
    }

    #[test]
    fn threads_survive_a_round_trip() {
        let events = vec![
            Event::alloc(0, 512, 0).on_thread(1),
            Event::alloc(1, 1024, 3).on_thread(2),
            Event::free(0, 512, 0).on_thread(2),
            Event::free(1, 1024, 3).on_thread(u64::MAX),
        ];
        assert_eq!(parse(write(&events).as_bytes()).unwrap().events, events);
        // one thread: the four-column format, as before
        let one = vec![Event::alloc(0, 512, 0), Event::free(0, 512, 0)];
        let text = write(&one);
        assert!(text.starts_with("op,id,bytes,stream\n"), "{text}");
        assert_eq!(parse(text.as_bytes()).unwrap().events, one);
    }

    #[test]
    fn id_reuse_after_free_is_a_duplicate() {
        assert_eq!(
            err("op,id,bytes,stream\na,1,10,0\nf,1,10,0\na,1,10,0\n"),
            "line 4: duplicate allocation id 1"
        );
    }
}
