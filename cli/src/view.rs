//! `oomguard view`: one self-contained HTML page (inline script and style, no network) that
//! answers "why did I run out of memory with memory free?": a zoomable timeline of live and
//! reserved bytes with each OOM marked, and the memory map at any clicked moment — blocks
//! coloured by size, free (cached) holes, unmapped pages, the largest free range named, and on
//! hover a block's size, address, stream and allocation site.
//!
//! The page's data is [`ViewData`]: block lives go in as base64 typed arrays (28 bytes a block;
//! JSON numbers took twice that), segment layouts and figures as JSON. The script
//! (`view/page.js`) computes the map at a moment from them exactly as [`ViewData::map_at`] does,
//! and draws on canvases, merging blocks narrower than a pixel into runs, so a trace of 300,000
//! blocks stays responsive.

use std::collections::HashMap;

use serde_json::json;

use crate::event::Trace;
use crate::replay::ReplayReport;
use crate::viewdata::ViewData;

/// Failed allocations marked on the timeline (all are counted in the header).
const MAX_FAILURES: usize = 2000;

const PAGE: &str = include_str!("view/page.html");
const STYLE: &str = include_str!("view/page.css");
const SCRIPT: &str = include_str!("view/page.js");

/// Standard base64 (RFC 4648, with padding).
fn base64(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for c in bytes.chunks(3) {
        let n = (c[0] as u32) << 16
            | (*c.get(1).unwrap_or(&0) as u32) << 8
            | *c.get(2).unwrap_or(&0) as u32;
        out.push(A[(n >> 18) as usize & 63] as char);
        out.push(A[(n >> 12) as usize & 63] as char);
        out.push(if c.len() > 1 {
            A[(n >> 6) as usize & 63] as char
        } else {
            '='
        });
        out.push(if c.len() > 2 {
            A[n as usize & 63] as char
        } else {
            '='
        });
    }
    out
}

fn f64s(v: impl Iterator<Item = f64>) -> String {
    base64(&v.flat_map(f64::to_le_bytes).collect::<Vec<u8>>())
}

fn u32s(v: impl Iterator<Item = u32>) -> String {
    base64(&v.flat_map(u32::to_le_bytes).collect::<Vec<u8>>())
}

/// The page for a replay of `trace` (named `title`): `report` for the figures, `data` for the
/// timeline and the maps.
///
/// ```
/// use oomguard_cli::{gen, replay::{replay, ReplayOptions}, view::html, viewdata::ViewData};
/// let t = gen::generate(&gen::GenSpec::tiny(gen::GenKind::Training, 1));
/// let opts = ReplayOptions::default();
/// let (r, _) = replay(&t, &opts, &mut |_| {});
/// let page = html("tiny", &t, &r, &ViewData::record(&t, &opts));
/// assert!(page.starts_with("<!DOCTYPE html>"));
/// assert!(!page.contains("http://") && !page.contains("https://"));
/// ```
pub fn html(title: &str, trace: &Trace, report: &ReplayReport, data: &ViewData) -> String {
    // Streams by index (stream handles are pointers: kept as text).
    let mut streams: Vec<u64> = Vec::new();
    let mut stream_ix: HashMap<u64, u32> = HashMap::new();
    let mut ix = |s: u64| {
        *stream_ix.entry(s).or_insert_with(|| {
            streams.push(s);
            (streams.len() - 1) as u32
        })
    };
    let meta: Vec<u32> = data
        .blocks
        .iter()
        .map(|b| {
            let site = trace
                .alloc_site
                .get(&b.id)
                .map_or(0, |s| (s + 1).min(0xff_ffff));
            ix(b.stream).min(255) | site << 8
        })
        .collect();
    let layouts: Vec<serde_json::Value> = data
        .layouts
        .iter()
        .map(|l| {
            let segs: Vec<serde_json::Value> = l
                .segments
                .iter()
                .map(|s| {
                    let mapped: Vec<u64> = s.mapped.iter().flat_map(|m| [m.0, m.1]).collect();
                    json!([s.base, s.extent, ix(s.stream), s.growable, mapped])
                })
                .collect();
            json!({"e": l.event, "s": segs})
        })
        .collect();
    // Markers for the first failures (a replay far below its need fails thousands of times).
    let failures: Vec<serde_json::Value> = data
        .failures
        .iter()
        .take(MAX_FAILURES)
        .map(|f| {
            json!({
                "event": f.event, "bytes": f.bytes, "stream": format!("{:#x}", f.stream),
                "oom": f.oom, "message": f.message,
            })
        })
        .collect();
    let peak_event = {
        let mut live = 0u64;
        let mut peak = (0u64, 0usize);
        for (i, e) in trace.events.iter().enumerate() {
            match e.op {
                crate::Op::Alloc => live = live.saturating_add(e.bytes),
                crate::Op::Free => live = live.saturating_sub(e.bytes),
            }
            if live > peak.0 {
                peak = (live, i);
            }
        }
        peak.1
    };
    let b = &data.blocks;
    let doc = json!({
        "title": title,
        "format": trace.format.to_string(),
        "config": report.config,
        "capacity": report.capacity_bytes,
        "events": data.events,
        "peak_live": report.peak_live_bytes,
        "peak_reserved": report.peak_reserved_bytes,
        "ratio": report.ratio,
        "peak_event": peak_event,
        "notes": trace.notes,
        "failures": failures,
        "failures_total": report.failures.len(),
        "layouts_truncated": data.layouts_truncated,
        "streams": streams.iter().map(|s| format!("{s:#x}")).collect::<Vec<_>>(),
        "sites": trace.sites,
        "layouts": layouts,
        "samples": {
            "n": data.samples.len(),
            "t": u32s(data.samples.iter().map(|s| s.0)),
            "live": f64s(data.samples.iter().map(|s| s.1 as f64)),
            "reserved": f64s(data.samples.iter().map(|s| s.2 as f64)),
        },
        "blocks": {
            "n": b.len(),
            "addr": f64s(b.iter().map(|b| b.addr as f64)),
            "size": f64s(b.iter().map(|b| b.size as f64)),
            "slack": u32s(b.iter().map(|b| (b.size - b.requested.min(b.size)).min(u32::MAX as u64) as u32)),
            "t0": u32s(b.iter().map(|b| b.t0)),
            "t1": u32s(b.iter().map(|b| b.t1)),
            "meta": u32s(meta.into_iter()),
        },
    });
    // Inside <script type="application/json">, "</script" ends the element and "<!--" can
    // start the parser's double-escaped mode (which swallows the page's own script): no "<"
    // reaches the page as such (JSON reads "\u003c" as "<").
    let json = doc.to_string().replace('<', "\\u003c");
    fill(
        PAGE,
        &[
            ("__TITLE__", &esc(title)),
            ("/*STYLE*/", STYLE),
            ("__DATA__", &json),
            ("/*SCRIPT*/", SCRIPT),
        ],
    )
}

/// The template with each marker, in this order, replaced by its value; markers are looked for
/// in the template only, never in what was put in.
fn fill(template: &str, parts: &[(&str, &str)]) -> String {
    let mut out = String::new();
    let mut rest = template;
    for (marker, value) in parts {
        let Some(at) = rest.find(marker) else {
            continue;
        };
        out.push_str(&rest[..at]);
        out.push_str(value);
        rest = &rest[at + marker.len()..];
    }
    out.push_str(rest);
    out
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::base64;

    #[test]
    fn base64_matches_rfc_4648_vectors() {
        for (i, o) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64(i.as_bytes()), o);
        }
    }
}
