//! RMM's allocation log (`rmm::mr::logging_resource_adaptor`, `RMM_LOG_FILE`):
//!
//! ```text
//! Thread,Time,Action,Pointer,Size,Stream
//! 140573312345856,10:31:27:589049,allocate,0x7f8a40000000,1024,0x7f8a38001020
//! 140573312345856,10:31:27:589101,free,0x7f8a40000000,1024,0x7f8a38001020
//! ```
//! Actions: `allocate`, `free` (also `deallocate`), and `allocate failure` / `free failure`, which
//! changed nothing in the original program and are skipped (counted in the trace's notes).
//! Pointers and streams are hexadecimal (`0x…`) or decimal. Events are taken in file order; a
//! pointer names an allocation from its `allocate` to its `free`. Thread ids (any text) are
//! numbered 1, 2, … in order of appearance ([`crate::Event::thread`]).

use std::collections::HashMap;

use crate::error::ReadError;
use crate::event::{Event, Trace, TraceFormat};
use crate::lines::{body_lines, parse_u64};

/// The header line of the format.
pub const HEADER: &str = "Thread,Time,Action,Pointer,Size,Stream";

fn parse_hex_or_dec(line: usize, what: &str, s: &str) -> Result<u64, ReadError> {
    let t = s.trim();
    match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        Some(h) => u64::from_str_radix(h, 16).map_err(|_| {
            ReadError::line(
                line,
                format!(
                    "{what} {}: not a 64-bit hexadecimal number",
                    crate::lines::quoted(t)
                ),
            )
        }),
        None => parse_u64(line, what, t),
    }
}

/// Parses an RMM log. Errors name the line.
///
/// ```
/// let log = "Thread,Time,Action,Pointer,Size,Stream\n\
///            1,0.1,allocate,0x1000,256,0x0\n\
///            1,0.2,free,0x1000,256,0x0\n";
/// let t = oomguard_cli::rmm::parse(log.as_bytes()).unwrap();
/// assert_eq!(t.events.len(), 2);
/// ```
pub fn parse(data: &[u8]) -> Result<Trace, ReadError> {
    if data.is_empty() {
        return Err(ReadError::Empty);
    }
    let header = crate::lines::first_line(data);
    // Case-insensitive, as detection is: some RMM versions write `thread,time,action,...`.
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
    let mut live: HashMap<u64, (u64, u64)> = HashMap::new(); // ptr -> (id, bytes)
    let mut next_id = 0u64;
    let mut threads: HashMap<&str, u64> = HashMap::new();
    let (mut failed_allocs, mut failed_frees) = (0u64, 0u64);
    for item in body_lines(data) {
        let (n, line) = item?;
        let fields: Vec<&str> = line.split(',').collect();
        if fields.len() != 6 {
            return Err(ReadError::line(
                n,
                format!(
                    "expected 6 fields (Thread,Time,Action,Pointer,Size,Stream), found {}",
                    fields.len()
                ),
            ));
        }
        let thread_field = fields[0].trim();
        if thread_field.is_empty() {
            return Err(ReadError::line(n, "thread \"\": missing"));
        }
        // numbered among the events kept (a thread seen only in failures takes no number)
        let mut thread = || {
            let next = threads.len() as u64 + 1;
            *threads.entry(thread_field).or_insert(next)
        };
        let action = fields[2].trim().to_ascii_lowercase();
        let ptr = parse_hex_or_dec(n, "pointer", fields[3])?;
        let bytes = parse_u64(n, "size", fields[4])?;
        let stream = parse_hex_or_dec(n, "stream", fields[5])?;
        match action.as_str() {
            "allocate" => {
                if live.contains_key(&ptr) {
                    return Err(ReadError::line(
                        n,
                        format!("allocation at {ptr:#x}, which is already live"),
                    ));
                }
                live.insert(ptr, (next_id, bytes));
                events.push(Event::alloc(next_id, bytes, stream).on_thread(thread()));
                next_id += 1;
            }
            "free" | "deallocate" => {
                let Some((id, size)) = live.remove(&ptr) else {
                    return Err(ReadError::line(
                        n,
                        format!("free of {ptr:#x}, which is not live"),
                    ));
                };
                events.push(Event::free(id, size, stream).on_thread(thread()));
            }
            "allocate failure" => failed_allocs += 1,
            "free failure" => failed_frees += 1,
            other => {
                return Err(ReadError::line(
                    n,
                    format!(
                    "unknown action {} (expected allocate, free, allocate failure or free failure)",
                    crate::lines::quoted(other)
                ),
                ))
            }
        }
    }
    if events.is_empty() {
        return Err(ReadError::NoEvents);
    }
    let mut t = Trace::new(TraceFormat::RmmLog, events);
    if failed_allocs + failed_frees > 0 {
        t.notes.push(format!(
            "skipped {failed_allocs} failed allocations and {failed_frees} failed frees of the original run"
        ));
    }
    Ok(t)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::Op;

    const H: &str = "Thread,Time,Action,Pointer,Size,Stream\n";

    #[test]
    fn reads_actions_pointer_reuse_and_failures() {
        let log = format!(
            "{H}7,1.0,allocate,0x7f0000000000,1024,0x0\n\
             7,1.1,allocate,0x7f0000000400,2048,0x55\n\
             7,1.2,allocate failure,0x0,99999999999,0x0\n\
             7,1.3,free,0x7f0000000000,1024,0x0\n\
             7,1.4,allocate,0x7f0000000000,512,0x0\n\
             7,1.5,deallocate,0x7f0000000000,512,0x0\n\
             7,1.6,free failure,0x1234,8,0x0\n"
        );
        let t = parse(log.as_bytes()).unwrap();
        let ops: Vec<(Op, u64, u64, u64)> = t
            .events
            .iter()
            .map(|e| (e.op, e.id, e.bytes, e.stream))
            .collect();
        assert_eq!(
            ops,
            vec![
                (Op::Alloc, 0, 1024, 0),
                (Op::Alloc, 1, 2048, 0x55),
                (Op::Free, 0, 1024, 0),
                (Op::Alloc, 2, 512, 0),
                (Op::Free, 2, 512, 0),
            ]
        );
        assert_eq!(t.notes.len(), 1);
        assert!(t.notes[0].contains("1 failed allocations and 1 failed frees"));
    }

    #[test]
    fn malformed_lines_are_named() {
        let e = |body: &str| {
            parse(format!("{H}{body}").as_bytes())
                .unwrap_err()
                .to_string()
        };
        assert_eq!(
            e("1,1,free,0x10,4,0\n"),
            "line 2: free of 0x10, which is not live"
        );
        assert_eq!(
            e("1,1,allocate,0x10,4,0\n1,1,allocate,0x10,4,0\n"),
            "line 3: allocation at 0x10, which is already live"
        );
        assert_eq!(
            e("1,1,allocate,0xZZ,4,0\n"),
            "line 2: pointer \"0xZZ\": not a 64-bit hexadecimal number"
        );
        assert!(e("1,1,resize,0x10,4,0\n").starts_with("line 2: unknown action \"resize\""));
        assert!(e("1,1,allocate\n").starts_with("line 2: expected 6 fields"));
        assert_eq!(e(""), "the trace has no allocation events");
        assert_eq!(e(" ,1,allocate,0x10,4,0\n"), "line 2: thread \"\": missing");
    }

    #[test]
    fn threads_are_numbered_in_order_of_appearance() {
        let log = format!(
            "{H}140573312345856,1.0,allocate,0x10,4,0x0\n\
             99,1.1,allocate failure,0x0,8,0x0\n\
             140573312349999,1.2,free,0x10,4,0x0\n\
             140573312345856,1.3,allocate,0x20,4,0x0\n\
             99,1.4,allocate,0x30,4,0x0\n"
        );
        let t = parse(log.as_bytes()).unwrap();
        let threads: Vec<u64> = t.events.iter().map(|e| e.thread).collect();
        assert_eq!(threads, vec![1, 2, 1, 3]);
    }
}
