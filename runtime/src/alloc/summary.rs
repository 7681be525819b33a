//! `memory_summary()`: a readable table like PyTorch's `torch.cuda.memory_summary()`.

use std::fmt::Write;

use super::stats::{MemoryStats, PoolStats};
use super::CachingAllocator;
use crate::ByteSize;

impl CachingAllocator {
    /// A table of the statistics, in the layout of `torch.cuda.memory_summary()`.
    pub fn memory_summary(&self) -> String {
        self.memory_summary_with(None)
    }

    /// [`CachingAllocator::memory_summary`] with a line for the allocations memory budgets
    /// refused (a `Device`'s table): those never reach the allocator, so its `OOMs` (PyTorch's
    /// `num_ooms`) does not count them, while a retry report does.
    pub(crate) fn memory_summary_with(&self, budget_refusals: Option<u64>) -> String {
        let s = self.stats();
        let cfg = self.config();
        format_summary(
            &s,
            &self.backend().name(),
            self.backend().ordinal(),
            &cfg.to_string(),
            budget_refusals,
        )
    }
}

/// The width of the table's text column (the table is this plus four wide).
const TEXT: usize = 89;

/// `text` as rows of the table's text column: wrapped after a space or a comma (inside a word
/// longer than the column, anywhere), the rows after the first indented by two.
fn text_row(o: &mut String, text: &str) {
    let mut rest = text;
    let mut first = true;
    while first || !rest.is_empty() {
        let (indent, width) = if first { ("", TEXT) } else { ("  ", TEXT - 2) };
        let (row, next) = match rest.char_indices().nth(width) {
            None => (rest, ""),
            Some((cut, _)) => match rest[..cut].rfind([' ', ',']) {
                Some(i) if i > 0 && rest.as_bytes()[i] == b' ' => (&rest[..i], &rest[i + 1..]),
                Some(i) if i > 0 => (&rest[..=i], &rest[i + 1..]),
                _ => (&rest[..cut], &rest[cut..]),
            },
        };
        let _ = writeln!(o, "| {:<TEXT$} |", format!("{indent}{row}"));
        rest = next.trim_start();
        first = false;
    }
}

pub(crate) fn format_summary(
    s: &MemoryStats,
    name: &str,
    ordinal: usize,
    cfg: &str,
    budget_refusals: Option<u64>,
) -> String {
    let line = "|".to_string() + &"=".repeat(TEXT + 2) + "|\n";
    let thin = "|".to_string() + &"-".repeat(TEXT + 2) + "|\n";
    let mut o = String::new();
    o += &line;
    let mut texts = vec![
        format!("oomguard memory summary, device {ordinal} ({name})"),
        format!("config: {cfg}"),
        format!(
            "alloc retries: {:<6} OOMs: {:<6} device allocs: {:<6} device frees: {:<6}",
            s.num_alloc_retries, s.num_ooms, s.num_device_alloc, s.num_device_free
        ),
    ];
    if s.num_releases_skipped > 0 {
        texts.push(format!(
            "releases skipped: {:<6} (retries that kept the cache: releasing it could not have \
             served them)",
            s.num_releases_skipped
        ));
    }
    if s.num_plans_installed + s.num_plans_refused > 0 {
        texts.push(format!(
            "step plans: {} installed ({} shared), {} refused, {} dropped; {} requests at their \
             offset, {} missed",
            s.num_plans_installed,
            s.num_plans_shared,
            s.num_plans_refused,
            s.num_plans_dropped,
            s.num_plan_hits,
            s.num_plan_misses
        ));
    }
    if let Some(n) = budget_refusals {
        texts.push(format!(
            "budget refusals: {n:<6} (by memory budgets, before the allocator; not counted in \
             OOMs)"
        ));
    }
    for t in &texts {
        text_row(&mut o, t);
    }
    o += &line;
    let _ = writeln!(
        o,
        "| {:<25} | {:>13} | {:>13} | {:>13} | {:>13} |",
        "Metric", "Cur Usage", "Peak Usage", "Tot Alloc", "Tot Freed"
    );
    o += &thin;
    let bytes = |v: u64| ByteSize(v).to_string();
    let count = |v: u64| v.to_string();
    type Row<'a> = (&'a str, &'a PoolStats, &'a dyn Fn(u64) -> String);
    // PyTorch's rows, in its order (`torch.cuda.memory_summary`)
    let rows: [Row<'_>; 9] = [
        ("Allocated memory", &s.allocated_bytes, &bytes),
        ("Active memory", &s.active_bytes, &bytes),
        ("Requested memory", &s.requested_bytes, &bytes),
        ("Reserved memory", &s.reserved_bytes, &bytes),
        ("Non-releasable memory", &s.inactive_split_bytes, &bytes),
        ("Allocations", &s.allocation, &count),
        ("Active allocs", &s.active, &count),
        ("Segments", &s.segment, &count),
        ("Non-releasable allocs", &s.inactive_split, &count),
    ];
    for (title, p, f) in rows {
        for (label, st) in [
            ("", &p.all),
            ("  from large pool", &p.large),
            ("  from small pool", &p.small),
        ] {
            let name = if label.is_empty() {
                title.to_string()
            } else {
                label.to_string()
            };
            let _ = writeln!(
                o,
                "| {:<25} | {:>13} | {:>13} | {:>13} | {:>13} |",
                name,
                f(st.current),
                f(st.peak),
                f(st.allocated),
                f(st.freed)
            );
        }
        o += &thin;
    }
    for (name, st) in [
        ("Oversize allocations", &s.oversize_allocations),
        ("Oversize segments", &s.oversize_segments),
    ] {
        let _ = writeln!(
            o,
            "| {:<25} | {:>13} | {:>13} | {:>13} | {:>13} |",
            name,
            count(st.current),
            count(st.peak),
            count(st.allocated),
            count(st.freed)
        );
    }
    o += &thin;
    let _ = writeln!(
        o,
        "| {:<89} |",
        format!("largest free block: {}", ByteSize(s.largest_free_block))
    );
    o += &line;
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every row of a text that does not fit is as wide as the table, and the text is all there.
    #[test]
    fn long_texts_wrap_inside_the_table() {
        let cfg = "config: roundup_power2_divisions:[1:4,>:8],max_split_size_mb:64,\
                   garbage_collection_threshold:0.6,expandable_segments:True,step_plans:False";
        let skipped = "releases skipped: 1      (retries that kept the cache: releasing it could \
                       not have served them)";
        let word = "x".repeat(200);
        for text in [cfg, skipped, word.as_str(), "short", ""] {
            let mut o = String::new();
            text_row(&mut o, text);
            let rows: Vec<&str> = o.lines().collect();
            for r in &rows {
                assert_eq!(r.chars().count(), TEXT + 4, "{o}");
            }
            let cells = rows.iter().map(|r| r[2..r.len() - 2].trim());
            let joined: String = cells.collect::<Vec<_>>().concat();
            let want: String = text.chars().filter(|c| *c != ' ').collect();
            assert_eq!(joined.replace(' ', ""), want, "{o}");
            assert_eq!(rows.len() > 1, text.chars().count() > TEXT, "{o}");
        }
    }
}
