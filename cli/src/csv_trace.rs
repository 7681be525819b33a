//! The `op,id,bytes,stream` CSV trace format: reader and writer.
//!
//! ```text
//! op,id,bytes,stream
//! a,0,154389504,0
//! f,0,154389504,0
//! ```
//! `a` allocates `bytes` under a new `id`; `f` frees the allocation `id`.

use std::collections::HashMap;
use std::fmt::Write as _;

use crate::error::ReadError;
use crate::event::{Event, Op, Trace, TraceFormat};
use crate::lines::{body_lines, parse_u64};

/// The header line of the format.
pub const HEADER: &str = "op,id,bytes,stream";

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
    // Case-insensitive, as detection is.
    if !header.replace(' ', "").eq_ignore_ascii_case(HEADER) {
        return Err(ReadError::line(
            1,
            format!(
                "expected the header `{HEADER}`, found {}",
                crate::lines::quoted(&header)
            ),
        ));
    }
    let mut events = Vec::new();
    // id -> (bytes, line of its allocation); ids once freed stay reserved.
    let mut live: HashMap<u64, u64> = HashMap::new();
    let mut used: std::collections::HashSet<u64> = std::collections::HashSet::new();
    for item in body_lines(data) {
        let (n, line) = item?;
        let fields: Vec<&str> = line.split(',').collect();
        if fields.len() != 4 {
            return Err(ReadError::line(
                n,
                format!(
                    "expected 4 fields (op,id,bytes,stream), found {}",
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
        match op {
            Op::Alloc => {
                if !used.insert(id) {
                    return Err(ReadError::line(n, format!("duplicate allocation id {id}")));
                }
                live.insert(id, bytes);
                events.push(Event::alloc(id, bytes, stream));
            }
            Op::Free => {
                let Some(size) = live.remove(&id) else {
                    return Err(ReadError::line(
                        n,
                        format!("free of id {id}, which is not live"),
                    ));
                };
                events.push(Event::free(id, size, stream));
            }
        }
    }
    if events.is_empty() {
        return Err(ReadError::NoEvents);
    }
    Ok(Trace::new(TraceFormat::Csv, events))
}

/// Writes `events` in this format (header included).
///
/// ```
/// use oomguard_cli::{csv_trace, Event};
/// let s = csv_trace::write(&[Event::alloc(0, 512, 0), Event::free(0, 512, 0)]);
/// assert_eq!(s, "op,id,bytes,stream\na,0,512,0\nf,0,512,0\n");
/// assert_eq!(csv_trace::parse(s.as_bytes()).unwrap().events.len(), 2);
/// ```
pub fn write(events: &[Event]) -> String {
    let mut s = String::with_capacity(events.len() * 20 + HEADER.len() + 1);
    s.push_str(HEADER);
    s.push('\n');
    for e in events {
        let op = match e.op {
            Op::Alloc => 'a',
            Op::Free => 'f',
        };
        let _ = writeln!(s, "{op},{},{},{}", e.id, e.bytes, e.stream);
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
    fn id_reuse_after_free_is_a_duplicate() {
        assert_eq!(
            err("op,id,bytes,stream\na,1,10,0\nf,1,10,0\na,1,10,0\n"),
            "line 4: duplicate allocation id 1"
        );
    }
}
