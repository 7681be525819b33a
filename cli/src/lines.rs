//! Splitting a text trace into numbered lines, with UTF-8 checked per line.

use crate::error::ReadError;

/// The non-empty lines of `data` after the first (the header), with 1-based line numbers;
/// `\r\n` endings accepted. A line that is not UTF-8 is an error naming it.
pub(crate) fn body_lines(data: &[u8]) -> impl Iterator<Item = Result<(usize, &str), ReadError>> {
    data.split(|&b| b == b'\n')
        .enumerate()
        .skip(1)
        .filter_map(|(i, raw)| {
            let raw = raw.strip_suffix(b"\r").unwrap_or(raw);
            match std::str::from_utf8(raw) {
                Ok(s) if s.trim().is_empty() => None,
                Ok(s) => Some(Ok((i + 1, s))),
                Err(_) => Some(Err(ReadError::line(i + 1, "not valid UTF-8 text"))),
            }
        })
}

/// The first line, trimmed, lossily decoded (for detection and messages).
pub(crate) fn first_line(data: &[u8]) -> String {
    let end = data
        .iter()
        .position(|&b| b == b'\n')
        .unwrap_or(data.len())
        .min(200);
    // A UTF-8 byte-order mark (spreadsheet exports write one) is not part of the header.
    String::from_utf8_lossy(&data[..end])
        .trim_start_matches('\u{feff}')
        .trim()
        .to_string()
}

/// A field as an error message quotes it: at most 60 characters, the length said beyond (a
/// hostile field of megabytes must not become a megabyte-long message line).
pub(crate) fn quoted(field: &str) -> String {
    const MAX: usize = 60;
    if field.chars().count() <= MAX {
        return format!("{field:?}");
    }
    let head: String = field.chars().take(MAX).collect();
    format!("{head:?}… ({} bytes)", field.len())
}

/// Parses a decimal unsigned integer field, naming `what` on error.
pub(crate) fn parse_u64(line: usize, what: &str, s: &str) -> Result<u64, ReadError> {
    let t = s.trim();
    t.parse::<u64>().map_err(|e| {
        let why = match e.kind() {
            std::num::IntErrorKind::PosOverflow => "too large for 64 bits",
            std::num::IntErrorKind::Empty => "missing",
            _ => "not a non-negative integer",
        };
        ReadError::line(line, format!("{what} {}: {why}", quoted(t)))
    })
}
