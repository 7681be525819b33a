//! `oomguard layout`: can a loop of a trace's step settle? The lowest static layout found for
//! one step (every block at one offset for good, no two blocks live at once overlapping) is the
//! memory a loop needs when no page ever moves; the step's peak live bytes are the floor.

use std::collections::HashMap;

use oomguard_runtime::alloc::{peak_live, plan_static_layout_within, LifeSpan, StaticLayout};
use oomguard_runtime::backend::sim::SIM_GRANULARITY;
use serde::Serialize;

use crate::replay::step_starts;
use crate::{Op, Trace};

/// Most blocks in the step laid out: each order placed costs up to the square of it.
pub const MAX_BLOCKS: usize = 20_000;

/// The work after which no new block order is tried (`plan_static_layout_within`): about 2 s
/// of a release build. The recorded traces' steps get their 300 orders within it (or reach
/// peak live bytes first), except gpt2's (about 34 orders; its first is its best, as over 177).
const WORK: u64 = 1_000_000_000;

/// Bytes a block takes at least (the allocator's smallest block and rounding).
const ROUND: u64 = 512;

/// What `oomguard layout` found.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LayoutReport {
    /// The first event of the step laid out (the last of `steps`).
    pub first_event: usize,
    /// One past its last event.
    pub end_event: usize,
    /// Blocks live at some point of the step (those made before it and still live included).
    pub blocks: usize,
    /// The most bytes live at once in the step (sizes rounded up to 512 bytes).
    pub peak_live_bytes: u64,
    /// The height of the lowest static layout found.
    pub layout_bytes: u64,
    /// That height in whole pages of the simulated device (`SIM_GRANULARITY`, 2 MiB, a CUDA
    /// card's granularity too): the memory the layout maps, which a capacity must hold.
    pub layout_pages_bytes: u64,
    /// Block orders tried.
    pub tries: u32,
}

/// Why a trace cannot be laid out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayoutError(pub String);

impl std::fmt::Display for LayoutError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for LayoutError {}

/// The blocks of the last of `steps` steps of `trace` (cut as `replay --steps` cuts them), as
/// life spans relative to the step's first event: a block made before the step starts at 0, one
/// still live at its end ends after its last event. Returns the step's event range too.
pub fn step_spans(trace: &Trace, steps: usize) -> (Vec<LifeSpan>, usize, usize) {
    let starts = step_starts(trace, steps);
    let first = starts.last().copied().unwrap_or(0);
    let end = trace.events.len();
    let mut open: HashMap<u64, (usize, u64)> = HashMap::new();
    let mut spans = Vec::new();
    for (i, e) in trace.events.iter().enumerate() {
        match e.op {
            Op::Alloc => {
                let bytes = e.bytes.checked_next_multiple_of(ROUND).unwrap_or(u64::MAX);
                // an id reused while live: the first block ends here (a trace's own defect)
                if let Some((at, b)) = open.insert(e.id, (i, bytes)) {
                    if i > first {
                        spans.push(span(at, i, b, first));
                    }
                }
            }
            Op::Free => {
                if let Some((at, b)) = open.remove(&e.id) {
                    if i > first {
                        spans.push(span(at, i, b, first));
                    }
                }
            }
        }
    }
    for (_, (at, b)) in open {
        spans.push(span(at, end, b, first));
    }
    // a stable order: by start, then size
    spans.sort_by_key(|s| (s.start, s.end, s.bytes));
    (spans, first, end)
}

fn span(at: usize, until: usize, bytes: u64, first: usize) -> LifeSpan {
    LifeSpan {
        start: at.saturating_sub(first),
        end: until - first,
        bytes,
    }
}

/// Lays out the last of `steps` steps of `trace`, trying up to `tries` block orders (fewer on a
/// large step: the orders stop after about 2 s of work in a release build, the same on every run).
pub fn layout(trace: &Trace, steps: usize, tries: u32) -> Result<LayoutReport, LayoutError> {
    let (spans, first, end) = step_spans(trace, steps);
    if spans.len() > MAX_BLOCKS {
        return Err(LayoutError(format!(
            "the step has {} blocks; layout handles at most {MAX_BLOCKS} (cut the trace into more steps with --steps)",
            spans.len()
        )));
    }
    // rounded sizes are multiples of 512: a peak of u64::MAX is a sum that did not fit
    let peak = peak_live(&spans);
    if peak == u64::MAX {
        return Err(LayoutError(format!(
            "the step's blocks, each rounded up to {ROUND} bytes, are more than 2^64 bytes live at once"
        )));
    }
    let l: StaticLayout = plan_static_layout_within(&spans, tries, 0x5eed, WORK);
    Ok(LayoutReport {
        first_event: first,
        end_event: end,
        blocks: spans.len(),
        peak_live_bytes: peak,
        layout_bytes: l.height,
        layout_pages_bytes: l
            .height
            .checked_next_multiple_of(SIM_GRANULARITY)
            .unwrap_or(u64::MAX),
        tries: l.tries,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Event, TraceFormat};

    #[test]
    fn a_step_of_blocks_apart_in_time_lays_out_in_its_largest() {
        let events = vec![
            Event::alloc(1, 1000, 0),
            Event::free(1, 1000, 0),
            Event::alloc(2, 2000, 0),
            Event::free(2, 2000, 0),
        ];
        let t = Trace::new(TraceFormat::Csv, events);
        let r = layout(&t, 1, 10).unwrap();
        assert_eq!(
            (r.blocks, r.peak_live_bytes, r.layout_bytes),
            (2, 2048, 2048)
        );
    }

    /// Blocks whose sizes fit in 64 bits but whose 512-byte rounding makes them more than
    /// 2^64 bytes live at once: refused (the peak printed was 2^64 − 1, a saturated sum).
    #[test]
    fn a_step_over_2_pow_64_bytes_once_rounded_is_refused() {
        let events = vec![
            Event::alloc(1, u64::MAX - 615, 0),
            Event::alloc(2, 512, 0),
            Event::free(1, u64::MAX - 615, 0),
        ];
        let t = Trace::new(TraceFormat::Csv, events);
        let e = layout(&t, 1, 10).unwrap_err();
        assert!(e.to_string().contains("more than 2^64 bytes"), "{e}");
        // a block that rounds past 2^64 alone, likewise
        let t = Trace::new(TraceFormat::Csv, vec![Event::alloc(1, u64::MAX - 10, 0)]);
        assert!(layout(&t, 1, 10).is_err());
    }

    #[test]
    fn blocks_live_across_the_step_count_in_it() {
        // a weight made before the step (step 2 of 2) and never freed, and one per step
        let mut events = vec![Event::alloc(100, 4096, 0)];
        for k in 0..2 {
            events.push(Event::alloc(k, 1024, 0));
            events.push(Event::free(k, 1024, 0));
        }
        let t = Trace::new(TraceFormat::Csv, events);
        let (spans, first, end) = step_spans(&t, 2);
        assert!(first > 0 && end == 5, "{first}..{end}");
        assert!(spans.iter().any(|s| s.bytes == 4096 && s.start == 0));
        let r = layout(&t, 2, 10).unwrap();
        assert_eq!(r.peak_live_bytes, 4096 + 1024);
        assert_eq!(r.layout_bytes, 4096 + 1024);
    }
}
