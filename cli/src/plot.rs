//! A self-contained SVG (or HTML page around it) of a replay: live and reserved bytes over the
//! events, the number of segments as they grow, and a memory map of the segments at the moment
//! live memory peaked (allocated blocks dark, cached free blocks light). No scripts, no
//! network.

use std::fmt::Write as _;

use oomguard_runtime::ByteSize;

use crate::replay::{ReplayReport, Timeline};

const W: f64 = 1000.0;
const LEFT: f64 = 90.0;
const RIGHT: f64 = 20.0;
const PLOT_W: f64 = W - LEFT - RIGHT;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn polyline(out: &mut String, pts: &[(f64, f64)], color: &str) {
    let _ = write!(
        out,
        r#"<polyline fill="none" stroke="{color}" stroke-width="1.5" points=""#
    );
    for (x, y) in pts {
        let _ = write!(out, "{x:.1},{y:.1} ");
    }
    out.push_str("\"/>\n");
}

/// The SVG of a replay of `title`.
///
/// ```
/// use oomguard_cli::{plot::svg, replay::{replay, ReplayOptions}, gen};
/// let t = gen::generate(&gen::GenSpec::tiny(gen::GenKind::Training, 1));
/// let (r, tl) = replay(&t, &ReplayOptions { timeline: true, ..Default::default() }, &mut |_| {});
/// let s = svg("tiny", &r, &tl.unwrap());
/// assert!(s.starts_with("<svg") && s.ends_with("</svg>\n"));
/// ```
pub fn svg(title: &str, report: &ReplayReport, tl: &Timeline) -> String {
    let h = 640.0;
    let mut o = String::new();
    let _ = writeln!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{h}" viewBox="0 0 {W} {h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(o, r#"<rect width="{W}" height="{h}" fill="white"/>"#);
    let _ = writeln!(
        o,
        r#"<text x="{LEFT}" y="20" font-size="15" font-weight="bold">{} — {}</text>"#,
        esc(title),
        esc(&report.config)
    );
    let _ = writeln!(
        o,
        r#"<text x="{LEFT}" y="38">peak live {} · peak reserved {} · ratio {:.4} · {} failures</text>"#,
        ByteSize(report.peak_live_bytes),
        ByteSize(report.peak_reserved_bytes),
        report.ratio,
        report.failures.len()
    );

    // Panel 1: bytes over events.
    let (top, ph) = (60.0, 300.0);
    let max_events = tl.samples.last().map(|s| s.event + 1).unwrap_or(1).max(1) as f64;
    let data_max = tl
        .samples
        .iter()
        .map(|s| s.reserved.max(s.live))
        .max()
        .unwrap_or(1)
        .max(1);
    // The capacity is drawn as a line when it is near the data (within 2x its top: the scale
    // grows to hold it); far above, the curves would be squashed flat, so it is named instead.
    let capacity = report.capacity_bytes;
    let capacity_on_scale = capacity > 0 && capacity <= data_max.saturating_mul(2);
    let max_bytes = if capacity_on_scale {
        data_max.max(capacity)
    } else {
        data_max
    } as f64;
    let x = |e: usize| LEFT + PLOT_W * e as f64 / max_events;
    let y = |b: u64| top + ph - ph * b as f64 / max_bytes;
    let _ = writeln!(
        o,
        r##"<rect x="{LEFT}" y="{top}" width="{PLOT_W}" height="{ph}" fill="none" stroke="#999"/>"##
    );
    for i in 0..=4 {
        let b = (max_bytes * i as f64 / 4.0) as u64;
        let yy = y(b);
        let _ = writeln!(
            o,
            r##"<line x1="{LEFT}" x2="{}" y1="{yy:.1}" y2="{yy:.1}" stroke="#eee"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
            LEFT + PLOT_W,
            LEFT - 6.0,
            yy + 4.0,
            ByteSize(b)
        );
    }
    let live: Vec<(f64, f64)> = tl.samples.iter().map(|s| (x(s.event), y(s.live))).collect();
    let reserved: Vec<(f64, f64)> = tl
        .samples
        .iter()
        .map(|s| (x(s.event), y(s.reserved)))
        .collect();
    polyline(&mut o, &reserved, "#e67e22");
    polyline(&mut o, &live, "#2c7fb8");
    if capacity_on_scale {
        let cy = y(capacity);
        let _ = writeln!(
            o,
            r##"<line class="capacity" x1="{LEFT}" x2="{}" y1="{cy:.1}" y2="{cy:.1}" stroke="#7f1d1d" stroke-width="1.5" stroke-dasharray="8 4"/><text x="{}" y="{:.1}" text-anchor="end" fill="#7f1d1d">capacity {}</text>"##,
            LEFT + PLOT_W,
            LEFT + PLOT_W - 4.0,
            cy - 4.0,
            ByteSize(capacity)
        );
    } else if capacity > 0 {
        let _ = writeln!(
            o,
            r##"<text class="capacity" x="{}" y="{}" text-anchor="end" fill="#7f1d1d">capacity {} (above this scale)</text>"##,
            LEFT + PLOT_W - 4.0,
            top + 16.0,
            ByteSize(capacity)
        );
    }
    let _ = writeln!(
        o,
        r##"<text x="{}" y="{}" fill="#e67e22">reserved</text><text x="{}" y="{}" fill="#2c7fb8">live</text>"##,
        LEFT + 10.0,
        top + 16.0,
        LEFT + 80.0,
        top + 16.0
    );
    let px = x(tl.peak_event);
    let _ = writeln!(
        o,
        r##"<line x1="{px:.1}" x2="{px:.1}" y1="{top}" y2="{}" stroke="#c0392b" stroke-dasharray="4 3"/><text x="{:.1}" y="{}" fill="#c0392b">peak live (event {})</text>"##,
        top + ph,
        px + 4.0,
        top + 30.0,
        tl.peak_event
    );

    // Panel 2: segments held.
    let (top2, ph2) = (380.0, 90.0);
    let max_segs = tl
        .samples
        .iter()
        .map(|s| s.segments)
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    let _ = writeln!(
        o,
        r##"<rect x="{LEFT}" y="{top2}" width="{PLOT_W}" height="{ph2}" fill="none" stroke="#999"/><text x="{}" y="{}" text-anchor="end">{max_segs} segs</text><text x="{}" y="{}" text-anchor="end">0</text>"##,
        LEFT - 6.0,
        top2 + 10.0,
        LEFT - 6.0,
        top2 + ph2
    );
    let segs: Vec<(f64, f64)> = tl
        .samples
        .iter()
        .map(|s| (x(s.event), top2 + ph2 - ph2 * s.segments as f64 / max_segs))
        .collect();
    polyline(&mut o, &segs, "#27ae60");
    let _ = writeln!(
        o,
        r##"<text x="{}" y="{}" fill="#27ae60">segments</text><text x="{}" y="{}" text-anchor="end">event {}</text>"##,
        LEFT + 10.0,
        top2 + 16.0,
        LEFT + PLOT_W,
        top2 + ph2 + 16.0,
        max_events as u64
    );

    // Panel 3: memory map at the peak, segments end to end.
    let (top3, ph3) = (520.0, 50.0);
    let total: u64 = tl
        .peak_segments
        .iter()
        .map(|s| s.mapped.max(1))
        .sum::<u64>()
        .max(1);
    let (alloc, free): (u64, u64) = tl
        .peak_segments
        .iter()
        .fold((0, 0), |(a, f), s| (a + s.allocated, f + s.free));
    let _ = writeln!(
        o,
        r#"<text x="{LEFT}" y="{}">segments at peak live (event {}): {} segments, {} allocated, {} cached free</text>"#,
        top3 - 8.0,
        tl.peak_event,
        tl.peak_segments.len(),
        ByteSize(alloc),
        ByteSize(free)
    );
    let mut off = 0u64;
    for s in &tl.peak_segments {
        let sx = LEFT + PLOT_W * off as f64 / total as f64;
        let sw = PLOT_W * s.mapped.max(1) as f64 / total as f64;
        let _ = writeln!(
            o,
            r##"<rect x="{sx:.2}" y="{top3}" width="{sw:.2}" height="{ph3}" fill="#fdebd0" stroke="#7f8c8d" stroke-width="0.5"/>"##
        );
        // Blocks at their offset in the mapped bytes (a growable segment's unmapped holes are
        // not drawn; placing blocks by address pushed them past the segment's frame).
        let mut mapped_off = 0u64;
        for &(_, bs, allocated) in &s.blocks {
            let at = mapped_off;
            mapped_off += bs;
            if !allocated {
                continue;
            }
            let bx = sx + sw * at as f64 / s.mapped.max(1) as f64;
            let bw = (sw * bs as f64 / s.mapped.max(1) as f64)
                .max(0.3)
                .min(sx + sw - bx);
            let _ = writeln!(
                o,
                r##"<rect x="{bx:.2}" y="{}" width="{bw:.2}" height="{}" fill="#2c7fb8"/>"##,
                top3 + 4.0,
                ph3 - 8.0
            );
        }
        off += s.mapped.max(1);
    }
    let _ = writeln!(
        o,
        r#"<text x="{LEFT}" y="{}">{} reserved; dark: allocated blocks, light: cached free memory inside segments</text>"#,
        top3 + ph3 + 18.0,
        ByteSize(total)
    );
    o.push_str("</svg>\n");
    o
}

/// An HTML page holding the SVG and the replay's figures.
pub fn html(title: &str, report: &ReplayReport, tl: &Timeline) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>oomguard replay: {}</title></head><body style=\"font-family:sans-serif\">",
        esc(title)
    );
    o.push_str(&svg(title, report, tl));
    let json = serde_json::to_string_pretty(report).unwrap_or_default();
    let _ = writeln!(o, "<pre>{}</pre>\n</body></html>", esc(&json));
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::{replay, ReplayOptions};

    /// Every rectangle stays inside the plot's frame, growable segments with holes included.
    #[test]
    fn segment_bar_stays_in_its_frame() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../traces/resnet50.trace.csv");
        let t = crate::detect::read_trace(std::path::Path::new(path)).unwrap();
        let opts = ReplayOptions {
            timeline: true,
            ..Default::default()
        };
        let (r, tl) = replay(&t, &opts, &mut |_| {});
        let tl = tl.unwrap();
        assert!(tl
            .peak_segments
            .iter()
            .any(|s| s.growable && s.mapped < s.size));
        let s = svg("resnet50", &r, &tl);
        let num = |tag: &str, key: &str| -> f64 {
            let at = tag.find(&format!(" {key}=\"")).unwrap() + key.len() + 3;
            tag[at..].split('"').next().unwrap().parse().unwrap()
        };
        let mut n = 0;
        for tag in s.split("<rect").skip(2) {
            let (x, w) = (num(tag, "x"), num(tag, "width"));
            assert!(
                x + w <= LEFT + PLOT_W + 0.01,
                "rect at {x} + {w} past the frame"
            );
            n += 1;
        }
        assert!(n > 10);
        assert!(s.contains("peak live (event"));
    }

    /// `plot --capacity`: the capacity is a line on the bytes panel when it is near the data,
    /// and named when it is far above.
    #[test]
    fn the_capacity_is_drawn() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../traces/resnet50.trace.csv");
        let t = crate::detect::read_trace(std::path::Path::new(path)).unwrap();
        let plot = |capacity: u64| {
            let opts = ReplayOptions {
                timeline: true,
                capacity,
                ..Default::default()
            };
            let (r, tl) = replay(&t, &opts, &mut |_| {});
            let tl = tl.unwrap();
            let top = tl
                .samples
                .iter()
                .map(|s| s.reserved.max(s.live))
                .max()
                .unwrap();
            (svg("resnet50", &r, &tl), top)
        };
        let (_, top) = plot(80 << 30);
        // a card 20% larger than the peak: a horizontal line inside the frame, labelled
        let cap = top + top / 5;
        let (s, _) = plot(cap);
        let line = s
            .split('<')
            .find(|t| t.starts_with("line class=\"capacity\""))
            .expect("a capacity line");
        let attr = |k: &str| -> f64 {
            let at = line.find(&format!(" {k}=\"")).unwrap() + k.len() + 3;
            line[at..].split('"').next().unwrap().parse().unwrap()
        };
        assert_eq!(attr("y1"), attr("y2"));
        // the top of the scale is the capacity: the line is at the frame's top (y = 60)
        assert!((attr("y1") - 60.0).abs() < 0.1, "{line}");
        assert!(s.contains(&format!("capacity {}", ByteSize(cap))));
        // far above the data: named, not drawn
        let (s, _) = plot(80 << 30);
        assert!(!s.contains("line class=\"capacity\""));
        assert!(
            s.contains("capacity 80.00 GiB (above this scale)"),
            "{}",
            &s[..600]
        );
    }
}
