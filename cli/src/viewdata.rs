//! What the HTML viewer shows, recorded from one replay: live and reserved bytes over the events,
//! the life of every block (address, size, from which event to which), and the segment layout
//! (address ranges and the parts mapped) each time it changes. From these the memory map at any
//! event follows: the blocks alive then, laid over the segments of then; the rest of each mapped
//! range is free (cached), the rest of each range unmapped. [`ViewData::map_at`] computes it here
//! (for the OOM summaries and the tests); the page's script computes the same on a click.

use std::collections::HashMap;
use std::sync::Arc;

use oomguard_runtime::alloc::{BlockStatus, SegmentInfo};
use oomguard_runtime::backend::sim::SimDevice;
use oomguard_runtime::{Allocation, ByteSize, CachingAllocator};
use serde::Serialize;

use crate::event::{Op, Trace};
use crate::replay::ReplayOptions;

/// One block's life: allocated after event `t0`, freed after event `t1` (`u32::MAX`: never).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockLife {
    /// Device address.
    pub addr: u64,
    /// Bytes of the block (the request rounded up).
    pub size: u64,
    /// Bytes asked for.
    pub requested: u64,
    /// Stream.
    pub stream: u64,
    /// The event that allocated it.
    pub t0: u32,
    /// The event that freed it (`u32::MAX`: live at the end).
    pub t1: u32,
    /// The allocation's id in the trace.
    pub id: u64,
}

/// A segment as the map draws it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SegmentLayout {
    /// Base address.
    pub base: u64,
    /// Bytes drawn: a fixed segment's size; a growable range up to its last mapped byte.
    pub extent: u64,
    /// Stream it serves.
    pub stream: u64,
    /// Whether it is growable (pages mapped into a reserved range).
    pub growable: bool,
    /// Mapped (backed) address ranges, `[start, end)`, in order.
    pub mapped: Vec<(u64, u64)>,
}

/// The segments from event `event` on (until the next layout).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Layout {
    /// The event after which the segments looked like this.
    pub event: u32,
    /// Segments in address order (growable ones with nothing mapped left out).
    pub segments: Vec<SegmentLayout>,
}

/// A failed allocation, with where it happened.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ViewFailure {
    /// The event.
    pub event: u32,
    /// Bytes requested.
    pub bytes: u64,
    /// Stream.
    pub stream: u64,
    /// Whether the allocator said out-of-memory.
    pub oom: bool,
    /// The allocator's message.
    pub message: String,
}

/// The memory map at one event, as the viewer draws it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MapSummary {
    /// Bytes in allocated blocks.
    pub allocated: u64,
    /// Bytes mapped but in no allocated block (cached).
    pub free: u64,
    /// The largest contiguous free (mapped, unallocated) range: (address, bytes).
    pub largest_free: Option<(u64, u64)>,
    /// Segments.
    pub segments: usize,
    /// Allocated blocks.
    pub blocks: usize,
}

/// Everything the viewer shows of one replay.
#[derive(Clone, Debug, Default)]
pub struct ViewData {
    /// Events in the trace.
    pub events: u32,
    /// Windows of events: (last event, most live bytes, most reserved bytes) in each.
    pub samples: Vec<(u32, u64, u64)>,
    /// Every block, in allocation order.
    pub blocks: Vec<BlockLife>,
    /// The segment layouts, in event order.
    pub layouts: Vec<Layout>,
    /// Failed allocations.
    pub failures: Vec<ViewFailure>,
    /// Whether layouts stopped being recorded (too many to keep).
    pub layouts_truncated: bool,
}

impl ViewData {
    /// Most timeline windows kept.
    pub const MAX_SAMPLES: usize = 8000;
    /// Most segment-layout entries (segments summed over layouts) kept; past it the map at later
    /// events shows the last layout kept, and the page says so.
    pub const MAX_LAYOUT_SEGMENTS: usize = 2_000_000;
    /// Most blocks read over all layouts (each layout reads every block of the allocator): past
    /// it, layouts stop as past [`ViewData::MAX_LAYOUT_SEGMENTS`]. Without it a trace that maps
    /// pages at every event of one growable segment took quadratic time (38,000 events: 38 s);
    /// the real traces of the repository's anchors read at most 150,000.
    pub const MAX_LAYOUT_BLOCKS: usize = 20_000_000;
    /// Most segment-layout entries kept per event of the trace (with at least
    /// [`ViewData::MIN_LAYOUT_SEGMENTS`]), so that the page stays proportional to the trace: 2,100
    /// allocations on as many streams (27 KB) made a page of 133 MB, each allocation a new
    /// segment and a layout of every segment so far.
    pub const LAYOUT_SEGMENTS_PER_EVENT: usize = 64;
    /// The layout entries kept whatever the trace's length.
    pub const MIN_LAYOUT_SEGMENTS: usize = 100_000;

    /// Replays `trace` with `opts` (timeline and stopping options are ignored) and records what
    /// the viewer shows.
    ///
    /// ```
    /// use oomguard_cli::{gen, replay::ReplayOptions, viewdata::ViewData};
    /// let t = gen::generate(&gen::GenSpec::tiny(gen::GenKind::Training, 1));
    /// let v = ViewData::record(&t, &ReplayOptions::default());
    /// assert_eq!(v.blocks.len(), t.allocs());
    /// assert!(!v.layouts.is_empty());
    /// ```
    pub fn record(trace: &Trace, opts: &ReplayOptions) -> ViewData {
        let sim = SimDevice::address_only(ByteSize(opts.capacity));
        let alloc = CachingAllocator::new(Arc::new(sim.clone()), opts.config.clone());
        let n = trace.events.len().min(u32::MAX as usize - 1);
        let mut v = ViewData {
            events: n as u32,
            ..Default::default()
        };
        let mut live: HashMap<u64, (Allocation, usize)> = HashMap::new();
        let mut live_bytes = 0u64;
        let stride = n.div_ceil(Self::MAX_SAMPLES).max(1);
        let mut window = (0u32, 0u64, 0u64);
        let mut calls = u64::MAX;
        let mut layout_segments = 0usize;
        let mut layout_blocks = 0usize;
        let max_segments = n
            .saturating_mul(Self::LAYOUT_SEGMENTS_PER_EVENT)
            .clamp(Self::MIN_LAYOUT_SEGMENTS, Self::MAX_LAYOUT_SEGMENTS);
        for (i, e) in trace.events.iter().take(n).enumerate() {
            match e.op {
                Op::Alloc => match alloc.allocate(e.bytes, e.stream) {
                    Ok(a) => {
                        live_bytes = live_bytes.saturating_add(e.bytes);
                        v.blocks.push(BlockLife {
                            addr: a.ptr,
                            size: a.size,
                            requested: a.requested,
                            stream: e.stream,
                            t0: i as u32,
                            t1: u32::MAX,
                            id: e.id,
                        });
                        live.insert(e.id, (a, v.blocks.len() - 1));
                    }
                    Err(err) => v.failures.push(ViewFailure {
                        event: i as u32,
                        bytes: e.bytes,
                        stream: e.stream,
                        oom: err.is_oom(),
                        message: err.to_string(),
                    }),
                },
                Op::Free => {
                    if let Some((a, b)) = live.remove(&e.id) {
                        live_bytes = live_bytes.saturating_sub(a.requested);
                        v.blocks[b].t1 = i as u32;
                        // A free that fails is reported by `replay`; the map shows it freed.
                        let _ = alloc.free(a);
                    }
                }
            }
            let c = sim.calls();
            let total = c.alloc_segment + c.free_segment + c.map + c.unmap + c.reserve + c.release;
            if total != calls && !v.layouts_truncated {
                calls = total;
                let snapshot = alloc.snapshot();
                layout_blocks += snapshot
                    .iter()
                    .map(|s| s.blocks.len().max(1))
                    .sum::<usize>();
                let segments = layout(&snapshot);
                layout_segments += segments.len().max(1);
                if layout_segments > max_segments || layout_blocks > Self::MAX_LAYOUT_BLOCKS {
                    v.layouts_truncated = true;
                } else {
                    v.layouts.push(Layout {
                        event: i as u32,
                        segments,
                    });
                }
            }
            let reserved = alloc.allocated_and_reserved().1;
            window.0 = i as u32;
            window.1 = window.1.max(live_bytes);
            window.2 = window.2.max(reserved);
            if (i + 1) % stride == 0 || i + 1 == n {
                v.samples.push(window);
                window = (i as u32, 0, 0);
            }
        }
        v
    }

    /// The memory map after event `t`: allocated and free (cached) bytes and the largest free
    /// range, from the blocks alive then and the layout of then.
    pub fn map_at(&self, t: u32) -> MapSummary {
        let Some(layout) = self.layouts.iter().rev().find(|l| l.event <= t) else {
            return MapSummary::default();
        };
        let mut blocks: Vec<(u64, u64)> = self
            .blocks
            .iter()
            .filter(|b| b.t0 <= t && t < b.t1)
            .map(|b| (b.addr, b.size))
            .collect();
        blocks.sort_unstable();
        let mut m = MapSummary {
            segments: layout.segments.len(),
            blocks: blocks.len(),
            ..Default::default()
        };
        for s in &layout.segments {
            for &(start, end) in &s.mapped {
                // Blocks inside this mapped range, in address order; the gaps are free.
                let from = blocks.partition_point(|b| b.0 < start);
                let mut cur = start;
                for &(a, size) in &blocks[from..] {
                    if a >= end {
                        break;
                    }
                    m.allocated += size;
                    note_free(&mut m, cur, a);
                    cur = cur.max(a + size);
                }
                note_free(&mut m, cur, end);
            }
        }
        m
    }
}

fn note_free(m: &mut MapSummary, start: u64, end: u64) {
    if end > start {
        let len = end - start;
        m.free += len;
        if m.largest_free.is_none_or(|(_, l)| len > l) {
            m.largest_free = Some((start, len));
        }
    }
}

/// The allocator's segments as the map draws them: mapped ranges merged from the blocks.
fn layout(segs: &[SegmentInfo]) -> Vec<SegmentLayout> {
    let mut out = Vec::with_capacity(segs.len());
    for s in segs {
        let mut mapped: Vec<(u64, u64)> = Vec::new();
        for b in &s.blocks {
            if b.status == BlockStatus::Unmapped {
                continue;
            }
            match mapped.last_mut() {
                Some(last) if last.1 == b.addr => last.1 = b.addr + b.size,
                _ => mapped.push((b.addr, b.addr + b.size)),
            }
        }
        let extent = if s.growable {
            mapped.last().map_or(0, |m| m.1 - s.base)
        } else {
            s.size
        };
        if extent == 0 {
            continue;
        }
        out.push(SegmentLayout {
            base: s.base,
            extent,
            stream: s.stream,
            growable: s.growable,
            mapped,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Event, TraceFormat};
    use oomguard_runtime::AllocatorConfig;

    /// The map derived from block lives and layouts equals the allocator's own snapshot at
    /// every event (both modes), on a trace that splits, frees, grows and runs out of memory.
    #[test]
    fn map_at_matches_the_allocator_at_every_event() {
        let mb = 1u64 << 20;
        let t = Trace::new(
            TraceFormat::Csv,
            vec![
                Event::alloc(0, 3 * mb, 0),
                Event::alloc(1, 5 * mb, 0),
                Event::alloc(2, 700_000, 0),
                Event::free(1, 5 * mb, 0),
                Event::alloc(3, 30 * mb, 0),
                Event::alloc(4, 2 * mb, 1),
                Event::free(0, 3 * mb, 0),
                Event::alloc(5, 100 * mb, 0), // too much for 128 MiB with 33 MiB live
                Event::alloc(6, mb, 0),
                Event::free(3, 30 * mb, 0),
                Event::alloc(7, 12 * mb, 0),
            ],
        );
        for config in [AllocatorConfig::native(), AllocatorConfig::default()] {
            let opts = ReplayOptions {
                config: config.clone(),
                capacity: 128 * mb,
                ..Default::default()
            };
            let v = ViewData::record(&t, &opts);
            assert_eq!(v.failures.len(), 1, "{config}");
            assert_eq!(v.failures[0].event, 7);
            for stop in 0..t.events.len() {
                let sim = SimDevice::address_only(ByteSize(opts.capacity));
                let alloc = CachingAllocator::new(Arc::new(sim), config.clone());
                let mut live = HashMap::new();
                for e in &t.events[..=stop] {
                    match e.op {
                        Op::Alloc => {
                            if let Ok(a) = alloc.allocate(e.bytes, e.stream) {
                                live.insert(e.id, a);
                            }
                        }
                        Op::Free => {
                            if let Some(a) = live.remove(&e.id) {
                                alloc.free(a).unwrap();
                            }
                        }
                    }
                }
                let (mut allocated, mut free, mut largest) = (0, 0, 0);
                for s in alloc.snapshot() {
                    for b in &s.blocks {
                        match b.status {
                            BlockStatus::Allocated | BlockStatus::PendingFree => {
                                allocated += b.size
                            }
                            BlockStatus::Free => {
                                free += b.size;
                                largest = largest.max(b.size);
                            }
                            BlockStatus::Unmapped => {}
                        }
                    }
                }
                let m = v.map_at(stop as u32);
                assert_eq!(m.allocated, allocated, "{config} after event {stop}");
                assert_eq!(m.free, free, "{config} after event {stop}");
                assert_eq!(
                    m.largest_free.map_or(0, |l| l.1),
                    largest,
                    "{config} after event {stop}"
                );
            }
        }
    }

    /// The same on a real trace at a few moments, the peak of live bytes among them.
    #[test]
    fn map_at_matches_the_allocator_on_a_real_trace() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../traces/resnet50.trace.csv");
        let t = crate::detect::read_trace(std::path::Path::new(path)).unwrap();
        let n = t.events.len();
        let mut live = 0u64;
        let mut peak = (0u64, 0usize);
        for (i, e) in t.events.iter().enumerate() {
            match e.op {
                Op::Alloc => live += e.bytes,
                Op::Free => live -= e.bytes,
            }
            if live > peak.0 {
                peak = (live, i);
            }
        }
        for config in [AllocatorConfig::native(), AllocatorConfig::default()] {
            let opts = ReplayOptions {
                config: config.clone(),
                ..Default::default()
            };
            let v = ViewData::record(&t, &opts);
            for stop in [0, n / 7, n / 3, peak.1, 2 * n / 3, n - 1] {
                let sim = SimDevice::address_only(ByteSize(opts.capacity));
                let alloc = CachingAllocator::new(Arc::new(sim), config.clone());
                let mut held = HashMap::new();
                for e in &t.events[..=stop] {
                    match e.op {
                        Op::Alloc => {
                            held.insert(e.id, alloc.allocate(e.bytes, e.stream).unwrap());
                        }
                        Op::Free => alloc.free(held.remove(&e.id).unwrap()).unwrap(),
                    }
                }
                let st = alloc.stats();
                let m = v.map_at(stop as u32);
                assert_eq!(
                    m.allocated, st.allocated_bytes.all.current,
                    "{config} {stop}"
                );
                let free: u64 = alloc
                    .snapshot()
                    .iter()
                    .flat_map(|s| s.blocks.iter())
                    .filter(|b| b.status == BlockStatus::Free)
                    .map(|b| b.size)
                    .sum();
                assert_eq!(m.free, free, "{config} {stop}");
                assert_eq!(m.blocks, held.len(), "{config} {stop}");
            }
        }
    }
}
