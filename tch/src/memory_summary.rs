//! A text table of libtorch's allocator statistics, laid out as PyTorch's
//! `torch.cuda.memory_summary()` (same rows, columns, unit rules and 75-column frame), so that
//! one reads the same in a tch program as in Python.

use crate::device_stats::{DeviceStats, Stat, StatArray};

/// PyTorch's `_format_size`: the value in the largest unit (B, KiB, ... PiB) in which the row's
/// reference value (`pref`) stays at least 768 of them, integer-divided.
fn format_size(mut sz: i64, pref: i64) -> String {
    const PREFIXES: [&str; 6] = ["B  ", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut prefix = PREFIXES[0];
    let mut pref = pref as f64;
    for p in &PREFIXES[1..] {
        if pref < 768.0 * 1024.0 {
            break;
        }
        prefix = p;
        sz /= 1024;
        pref /= 1024.0;
    }
    format!("{sz:6} {prefix}")
}

/// PyTorch's `_format_count`: as [`format_size`] with K and M (thousands, 750 000 threshold).
fn format_count(mut cnt: i64, pref: i64) -> String {
    const PREFIXES: [&str; 3] = [" ", "K", "M"];
    let mut prefix = PREFIXES[0];
    let mut pref = pref as f64;
    for p in &PREFIXES[1..] {
        if pref < 750.0 * 1000.0 {
            break;
        }
        prefix = p;
        cnt /= 1000;
        pref /= 1000.0;
    }
    format!("{cnt:7} {prefix} ")
}

fn rule(c: char) -> String {
    std::iter::repeat_n(c, 75).collect()
}

/// Pads or cuts `s` to 75 columns.
fn fit(s: &str) -> String {
    let mut s: String = s.chars().take(75).collect();
    let n = s.chars().count();
    s.extend(std::iter::repeat_n(' ', 75 - n));
    s
}

fn row(name: &str, s: Stat, pref: Stat, f: fn(i64, i64) -> String) -> String {
    format!(
        " {name:<21} | {} | {} | {} | {} ",
        f(s.current, pref.current),
        f(s.peak, pref.peak),
        f(s.allocated, pref.allocated),
        f(s.freed, pref.freed)
    )
}

/// PyTorch's `torch.cuda.memory_summary(device, abbreviated)` over `stats`, titled for `device`,
/// with `extra` lines (e.g. the allocator's name and configuration) before the closing rule.
/// `abbreviated` leaves out the per-pool rows, as PyTorch's does.
pub fn format_memory_summary(
    stats: &DeviceStats,
    device: usize,
    abbreviated: bool,
    extra: &[String],
) -> String {
    let size_metrics: [(&StatArray, &str); 5] = [
        (&stats.allocated_bytes, "Allocated memory"),
        (&stats.active_bytes, "Active memory"),
        (&stats.requested_bytes, "Requested memory"),
        (&stats.reserved_bytes, "GPU reserved memory"),
        (&stats.inactive_split_bytes, "Non-releasable memory"),
    ];
    let count_metrics: [(&StatArray, &str); 4] = [
        (&stats.allocation, "Allocations"),
        (&stats.active, "Active allocs"),
        (&stats.segment, "GPU reserved segments"),
        (&stats.inactive_split, "Non-releasable allocs"),
    ];
    let mut lines = vec![
        rule('='),
        fit(&format!(
            "       libtorch CUDA memory summary (oomguard-tch), device ID {device}"
        )),
        rule('-'),
        fit(&format!(
            "{:11}CUDA OOMs: {:<12} | {:7}cudaMalloc retries: {:<8}",
            "", stats.num_ooms, "", stats.num_alloc_retries
        )),
        rule('='),
        "        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  ".to_string(),
    ];
    let mut block = |a: &StatArray, name: &str, f: fn(i64, i64) -> String| {
        lines.push(rule('-'));
        let pref = a.all();
        lines.push(row(name, a.all(), pref, f));
        if !abbreviated {
            lines.push(row("      from large pool", a.large_pool(), pref, f));
            lines.push(row("      from small pool", a.small_pool(), pref, f));
        }
    };
    for (a, name) in size_metrics {
        block(a, name, format_size);
    }
    for (a, name) in count_metrics {
        block(a, name, format_count);
    }
    lines.push(rule('-'));
    for (s, name) in [
        (stats.oversize_allocations, "Oversize allocations"),
        (stats.oversize_segments, "Oversize GPU segments"),
    ] {
        lines.push(row(name, s, s, format_count));
    }
    if !extra.is_empty() {
        lines.push(rule('-'));
        lines.extend(extra.iter().map(|l| fit(&format!(" {l}"))));
    }
    lines.push(rule('='));
    let mut out = String::new();
    for l in lines {
        out.push('|');
        out.push_str(&l);
        out.push_str("|\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_follow_pytorch() {
        // below 768 KiB of reference: bytes
        assert_eq!(format_size(1000, 1000), "  1000 B  ");
        // 800 KiB: KiB; 3 GiB stays in MiB (GiB from 768 GiB on), and a smaller value on the
        // same row follows the row's unit
        assert_eq!(format_size(800 << 10, 800 << 10), "   800 KiB");
        assert_eq!(format_size(3 << 30, 3 << 30), "  3072 MiB");
        assert_eq!(format_size(5 << 20, 3 << 30), "     5 MiB");
        assert_eq!(format_size(1 << 40, 1 << 40), "  1024 GiB");
        assert_eq!(format_count(12, 12), "     12   ");
        assert_eq!(format_count(2_000_000, 2_000_000), "   2000 K ");
        assert_eq!(format_count(800_000_000, 800_000_000), "    800 M ");
    }
}
