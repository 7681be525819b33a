//! Replaying a trace through oomguard's [`CachingAllocator`] on an address-only simulated device.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use oomguard_runtime::alloc::{BlockStatus, SegmentInfo};
use oomguard_runtime::{Allocation, AllocatorConfig, CachingAllocator};
use serde::Serialize;

use crate::counting::CountingBackend;
use crate::device::DeviceSpec;
use crate::event::{Op, Trace};
use crate::threads::{thread_count, Callers, MAX_THREADS};

pub use crate::counting::BackendCalls;
pub use crate::device::DEFAULT_CAPACITY;

/// How to replay.
#[derive(Clone, Debug)]
pub struct ReplayOptions {
    /// The allocator configuration.
    pub config: AllocatorConfig,
    /// Capacity of the simulated device in bytes.
    pub capacity: u64,
    /// Stop at the first failed allocation (for capacity searches).
    pub stop_at_first_failure: bool,
    /// Record a [`Timeline`] (for plots).
    pub timeline: bool,
    /// The device: simulated (default) or a GPU.
    pub device: DeviceSpec,
    /// Page size of the simulated device's growable segments (`None`: 2 MiB, an H100's);
    /// refused on a GPU, whose page size is its driver's.
    pub page_size: Option<u64>,
    /// The number of training steps the trace holds (`None`, 0 or 1: no per-step figures): the
    /// replay then reports what each step mapped, unmapped and waited for
    /// ([`ReplayReport::per_step`]), and marks each step's start as a training loop's
    /// `train_step` does ([`oomguard_runtime::CachingAllocator::mark_step`]: a step that moved
    /// pages is then served from a fixed layout).
    pub steps: Option<usize>,
    /// Replay each event on a thread of its own recorded thread ([`crate::Event::thread`]), in
    /// trace order (one call at a time), so that the allocator runs in its multi-thread mode
    /// (thread caches) as it did in the recorded program (`false`: every call on the calling
    /// thread). At most [`MAX_THREADS`] recorded threads.
    pub threads: bool,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        Self {
            config: AllocatorConfig::default(),
            capacity: DEFAULT_CAPACITY,
            stop_at_first_failure: false,
            timeline: false,
            device: DeviceSpec::Sim,
            page_size: None,
            steps: None,
            threads: false,
        }
    }
}

/// An allocation of the trace that failed in the replay. Its later free is skipped.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Failure {
    /// Index of the event in the trace (0-based).
    pub index: usize,
    /// The allocation's id.
    pub id: u64,
    /// Bytes requested.
    pub bytes: u64,
    /// Whether the allocator said out-of-memory (otherwise: another error, e.g. too large).
    pub oom: bool,
    /// The allocator's message.
    pub message: String,
}

/// The outcome of a replay.
#[derive(Clone, Debug, Serialize)]
pub struct ReplayReport {
    /// The device it ran on (`sim`, or the GPU's name).
    pub device: String,
    /// The configuration, in `OOMGUARD_ALLOC_CONF` syntax.
    pub config: String,
    /// The simulated device's capacity.
    pub capacity_bytes: u64,
    /// Events replayed (all of them unless stopped at the first failure).
    pub events: usize,
    /// Most bytes live at once (requested sizes of successful allocations).
    pub peak_live_bytes: u64,
    /// Most bytes in allocated blocks (rounded sizes).
    pub peak_allocated_bytes: u64,
    /// Most bytes the allocator held from the device.
    pub peak_reserved_bytes: u64,
    /// `peak_reserved_bytes / peak_live_bytes` (0 when nothing was live).
    pub ratio: f64,
    /// Times the allocator released its cache and retried after out-of-memory.
    pub num_alloc_retries: u64,
    /// Out-of-memory errors.
    pub num_ooms: u64,
    /// Allocations that failed, in order.
    pub failures: Vec<Failure>,
    /// Backend calls.
    pub backend_calls: BackendCalls,
    /// Wall-clock seconds of the replay loop.
    pub seconds: f64,
    /// Whether every event replayed without a failure.
    pub completed: bool,
    /// With [`ReplayOptions::steps`]: what each step made the allocator do, in order.
    pub per_step: Vec<StepMoves>,
    /// Threads that called the allocator (0 when nothing ran): the replaying thread, or with
    /// [`ReplayOptions::threads`] one per recorded thread whose events ran.
    pub threads: usize,
    /// Those of them that were handed memory (an allocation of more than 0 bytes that
    /// succeeded): the allocator switches to its multi-thread mode (thread caches) when a
    /// second thread allocates, so from 2 on it ran in that mode.
    pub allocating_threads: usize,
    /// Why the replay stopped before the trace's end for a reason of its own, not the
    /// allocator's (with [`ReplayOptions::threads`]: a thread for a recorded thread could not
    /// start, or stopped answering): the event and the cause. The figures cover the events
    /// before it ([`ReplayReport::events`]); `completed` is false. Absent from the JSON when
    /// `None`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stopped: Option<String>,
}

/// What one step of a replayed training loop made growable segments do: a settled loop maps
/// and unmaps nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct StepMoves {
    /// Index of the step's first event.
    pub first_event: usize,
    /// Bytes of pages mapped during the step.
    pub mapped_bytes: u64,
    /// Bytes of pages unmapped during the step (moved, or given back).
    pub unmapped_bytes: u64,
    /// `map` calls.
    pub maps: u64,
    /// `unmap` calls.
    pub unmaps: u64,
    /// Synchronisations (device-wide and per stream).
    pub synchronizations: u64,
    /// Times the allocator released its cache and retried after out-of-memory.
    pub retries: u64,
}

/// Where `steps` steps of `trace` begin: near each `k / steps` of the events, the event after
/// which the fewest bytes are live (a step's end: its activations freed), searched within a
/// quarter step either side. The first step begins at event 0; every step has an event (fewer
/// starts than `steps` when the trace is too short).
pub fn step_starts(trace: &Trace, steps: usize) -> Vec<usize> {
    let n = trace.events.len();
    if steps <= 1 || n == 0 {
        return vec![0];
    }
    let mut live = Vec::with_capacity(n);
    let mut sizes: HashMap<u64, u64> = HashMap::new();
    let mut cur = 0u64;
    for e in &trace.events {
        match e.op {
            Op::Alloc => {
                sizes.insert(e.id, e.bytes);
                cur = cur.saturating_add(e.bytes);
            }
            Op::Free => {
                if let Some(b) = sizes.remove(&e.id) {
                    cur = cur.saturating_sub(b);
                }
            }
        }
        live.push(cur);
    }
    let per = n / steps;
    let mut starts = vec![0];
    for k in 1..steps {
        let mid = k * n / steps;
        // a step has at least one event: it ends at its start or later
        let lo = mid.saturating_sub(per / 4).max(starts[starts.len() - 1]);
        // the window slides on when the step before ended past it (steps of one or two
        // events: cutting 1,000 events into 666 steps stopped at 3), and a step ends before
        // the last event
        let hi = (mid + per / 4).max(lo).min(n.saturating_sub(2));
        if lo > hi {
            break;
        }
        let end = (lo..=hi).min_by_key(|&i| (live[i], i)).unwrap_or(mid);
        starts.push(end + 1);
    }
    starts
}

/// One point of a [`Timeline`]: figures after event `event` (maxima over the window since the
/// previous point when the timeline is thinned).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Sample {
    /// Index of the event.
    pub event: usize,
    /// Bytes live (requested).
    pub live: u64,
    /// Bytes reserved from the device.
    pub reserved: u64,
    /// Segments held.
    pub segments: u64,
}

/// A segment at the moment of peak live memory, for plots.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SegmentView {
    /// Reserved address range (fixed: its size).
    pub size: u64,
    /// Bytes backed by memory.
    pub mapped: u64,
    /// Bytes in allocated blocks.
    pub allocated: u64,
    /// Bytes in free, mapped blocks (cached but unused).
    pub free: u64,
    /// Whether it is a growable segment.
    pub growable: bool,
    /// (offset, size, allocated) of each mapped block, in address order.
    pub blocks: Vec<(u64, u64, bool)>,
}

impl SegmentView {
    fn from_info(s: &SegmentInfo) -> Self {
        let mut allocated = 0;
        let mut free = 0;
        let mut blocks = Vec::new();
        for b in &s.blocks {
            match b.status {
                BlockStatus::Allocated | BlockStatus::PendingFree => allocated += b.size,
                BlockStatus::Free => free += b.size,
                BlockStatus::Unmapped => continue,
            }
            blocks.push((
                b.addr - s.base,
                b.size,
                !matches!(b.status, BlockStatus::Free),
            ));
        }
        Self {
            size: s.size,
            mapped: s.mapped,
            allocated,
            free,
            growable: s.growable,
            blocks,
        }
    }
}

/// Live and reserved bytes over a replay, and the segments at the peak of live bytes.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Timeline {
    /// Points, at most [`Timeline::MAX_POINTS`].
    pub samples: Vec<Sample>,
    /// Index of the event after which live memory peaked (first time): the moment of most
    /// pressure, where fragmentation shows.
    pub peak_event: usize,
    /// The segments right after that event.
    pub peak_segments: Vec<SegmentView>,
}

impl Timeline {
    /// Most points kept; longer replays are thinned (keeping each window's maxima).
    pub const MAX_POINTS: usize = 4000;
}

/// Replays `trace` with `opts`; `progress` is called with the number of events done every
/// 4096 events.
///
/// ```
/// use oomguard_cli::{replay::{replay, ReplayOptions}, Event, Trace, TraceFormat};
/// let t = Trace::new(TraceFormat::Csv, vec![Event::alloc(0, 3 << 20, 0), Event::free(0, 3 << 20, 0)]);
/// let (r, _) = replay(&t, &ReplayOptions::default(), &mut |_| {});
/// assert!(r.completed);
/// assert_eq!(r.peak_live_bytes, 3 << 20);
/// assert!(r.peak_reserved_bytes >= 3 << 20);
/// ```
pub fn replay(
    trace: &Trace,
    opts: &ReplayOptions,
    progress: &mut dyn FnMut(usize),
) -> (ReplayReport, Option<Timeline>) {
    let (report, samples, peak_event, _) = run(trace, opts, None, progress);
    let timeline = if opts.timeline {
        // Deterministic: a second run stops at the peak to look at the segments there.
        let (_, _, _, segs) = run(trace, opts, Some(peak_event), &mut |_| {});
        Some(Timeline {
            samples,
            peak_event,
            peak_segments: segs,
        })
    } else {
        None
    };
    (report, timeline)
}

type RunOutput = (ReplayReport, Vec<Sample>, usize, Vec<SegmentView>);

fn run(
    trace: &Trace,
    opts: &ReplayOptions,
    snapshot_at: Option<usize>,
    progress: &mut dyn FnMut(usize),
) -> RunOutput {
    let mut device =
        match crate::device::open(&opts.device, opts.capacity, &opts.config, opts.page_size) {
            Ok(d) => d,
            // The CLI opens the device first and reports this itself; a library caller gets a
            // replay that failed at its first event.
            Err(message) => return unavailable(trace, opts, message),
        };
    let counting = Arc::new(CountingBackend::new(Arc::clone(&device.backend)));
    if opts.threads {
        let n = thread_count(&trace.events);
        if n > MAX_THREADS {
            return unavailable(
                trace,
                opts,
                format!(
                    "the trace names {n} threads; a replay with threads starts at most {MAX_THREADS}"
                ),
            );
        }
    }
    let alloc = Arc::new(CachingAllocator::new(counting.clone(), opts.config.clone()));
    let mut callers = Callers::new(Arc::clone(&alloc), opts.threads);
    if device.limit {
        alloc.set_memory_limit(Some(opts.capacity));
    }
    let mut live: HashMap<u64, Allocation> = HashMap::with_capacity(1024);
    let mut live_bytes = 0u64;
    let mut peak_live = 0u64;
    let mut failures = Vec::new();
    let mut failed_ids: std::collections::HashSet<u64> = std::collections::HashSet::new();
    let n = trace.events.len();
    let stride = if opts.timeline {
        n.div_ceil(Timeline::MAX_POINTS).max(1)
    } else {
        usize::MAX
    };
    let mut samples = Vec::new();
    let mut window = Sample {
        event: 0,
        live: 0,
        reserved: 0,
        segments: 0,
    };
    let mut peak_event = 0usize;
    let mut done = 0usize;
    let mut segments = Vec::new();
    let starts = step_starts(trace, opts.steps.unwrap_or(0));
    let mut per_step: Vec<StepMoves> = Vec::new();
    let moves = |a: &CachingAllocator, first_event: usize| {
        let st = a.stats();
        StepMoves {
            first_event,
            mapped_bytes: st.mapped_bytes_total,
            unmapped_bytes: st.unmapped_bytes_total,
            maps: st.num_map,
            unmaps: st.num_unmap,
            synchronizations: st.num_sync_all_streams + st.num_stream_syncs,
            retries: st.num_alloc_retries,
        }
    };
    if starts.len() > 1 {
        alloc.mark_step();
    }
    let mut at_step_start = moves(&alloc, 0);
    // the next step's first event (`starts` rises): one comparison an event, not a search
    let mut next_start = 1;
    let start = Instant::now();
    let mut stopped = None;
    for (i, e) in trace.events.iter().enumerate() {
        if starts.get(next_start) == Some(&i) {
            next_start += 1;
            let now = moves(&alloc, i);
            per_step.push(step_delta(at_step_start, now));
            at_step_start = now;
            // as a training loop's `train_step` marks its steps; what the mark moves (a step
            // plan's range) counts in the step it starts
            alloc.mark_step();
        }
        match e.op {
            Op::Alloc => match device
                .stream(e.stream)
                .map_err(|m| oomguard_runtime::Error::InvalidArgument(m).into())
                .and_then(|s| callers.allocate(e.thread, e.bytes, s))
            {
                Ok(a) => {
                    live.insert(e.id, a);
                    live_bytes = live_bytes.saturating_add(e.bytes);
                    if live_bytes > peak_live {
                        peak_live = live_bytes;
                        peak_event = i;
                    }
                }
                Err(err) if err.replay => {
                    stopped = Some(format!("event {i}: {}", err.message));
                    break;
                }
                Err(err) => {
                    failures.push(Failure {
                        index: i,
                        id: e.id,
                        bytes: e.bytes,
                        oom: err.oom,
                        message: err.message,
                    });
                    failed_ids.insert(e.id);
                }
            },
            Op::Free => {
                if let Some(a) = live.remove(&e.id) {
                    live_bytes = live_bytes.saturating_sub(a.requested);
                    if let Err(err) = callers.free(e.thread, a) {
                        if err.replay {
                            stopped = Some(format!("event {i}: {}", err.message));
                            break;
                        }
                        failures.push(Failure {
                            index: i,
                            id: e.id,
                            bytes: e.bytes,
                            oom: false,
                            message: err.message,
                        });
                    }
                }
            }
        }
        done = i + 1;
        if opts.timeline {
            let st = alloc.stats();
            let reserved = st.reserved_bytes.all.current;
            window.event = i;
            window.live = window.live.max(live_bytes);
            window.reserved = window.reserved.max(reserved);
            window.segments = window.segments.max(st.segment.all.current);
            if (i + 1) % stride == 0 || i + 1 == n {
                samples.push(window);
                window = Sample {
                    event: i,
                    live: 0,
                    reserved: 0,
                    segments: 0,
                };
            }
        }
        if snapshot_at == Some(i) {
            segments = alloc
                .snapshot()
                .iter()
                .map(SegmentView::from_info)
                .collect();
            break;
        }
        if (i + 1) % 4096 == 0 {
            progress(i + 1);
        }
        if opts.stop_at_first_failure && !failures.is_empty() {
            break;
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    progress(done);
    if starts.len() > 1 && done == n {
        per_step.push(step_delta(at_step_start, moves(&alloc, n)));
    }
    let st = alloc.stats();
    let (threads, allocating_threads) = callers.threads();
    // the workers end here, their work done and read
    drop(callers);
    // Bytes moved and synchronisations: the allocator's own counters (the same calls).
    let calls = BackendCalls {
        mapped_bytes: st.mapped_bytes_total,
        unmapped_bytes: st.unmapped_bytes_total,
        synchronize: st.num_sync_all_streams,
        stream_synchronize: st.num_stream_syncs,
        ..counting.calls()
    };
    if device.limit {
        // A real device: give everything back before the next replay (a capacity search runs
        // many), rather than leaving it to the backend's drop.
        for (_, a) in live.drain() {
            let _ = alloc.free(a);
        }
        let _ = alloc.empty_cache();
    }
    let peak_reserved = st.reserved_bytes.all.peak;
    let report = ReplayReport {
        device: device.backend.name(),
        config: opts.config.to_string(),
        capacity_bytes: opts.capacity,
        events: done,
        peak_live_bytes: peak_live,
        peak_allocated_bytes: st.allocated_bytes.all.peak,
        peak_reserved_bytes: peak_reserved,
        ratio: if peak_live == 0 {
            0.0
        } else {
            peak_reserved as f64 / peak_live as f64
        },
        num_alloc_retries: st.num_alloc_retries,
        num_ooms: st.num_ooms,
        completed: failures.is_empty() && done == n && stopped.is_none(),
        failures,
        backend_calls: calls,
        seconds,
        per_step,
        threads,
        allocating_threads,
        stopped,
    };
    (report, samples, peak_event, segments)
}

/// What happened between two readings of the allocator's counters.
fn step_delta(from: StepMoves, to: StepMoves) -> StepMoves {
    StepMoves {
        first_event: from.first_event,
        mapped_bytes: to.mapped_bytes - from.mapped_bytes,
        unmapped_bytes: to.unmapped_bytes - from.unmapped_bytes,
        maps: to.maps - from.maps,
        unmaps: to.unmaps - from.unmaps,
        synchronizations: to.synchronizations - from.synchronizations,
        retries: to.retries - from.retries,
    }
}

/// The report of a replay whose device could not be opened.
fn unavailable(trace: &Trace, opts: &ReplayOptions, message: String) -> RunOutput {
    let first = trace.events.first();
    let report = ReplayReport {
        device: opts.device.to_string(),
        config: opts.config.to_string(),
        capacity_bytes: opts.capacity,
        events: 0,
        peak_live_bytes: 0,
        peak_allocated_bytes: 0,
        peak_reserved_bytes: 0,
        ratio: 0.0,
        num_alloc_retries: 0,
        num_ooms: 0,
        failures: vec![Failure {
            index: 0,
            id: first.map_or(0, |e| e.id),
            bytes: first.map_or(0, |e| e.bytes),
            oom: false,
            message,
        }],
        backend_calls: BackendCalls::default(),
        seconds: 0.0,
        completed: false,
        per_step: Vec::new(),
        threads: 0,
        allocating_threads: 0,
        stopped: None,
    };
    (report, Vec::new(), 0, Vec::new())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Event, TraceFormat};

    fn trace(events: Vec<Event>) -> Trace {
        Trace::new(TraceFormat::Csv, events)
    }

    #[test]
    fn oom_is_recorded_and_its_free_skipped() {
        let t = trace(vec![
            Event::alloc(0, 40 << 20, 0),
            Event::alloc(1, 100 << 20, 0),
            Event::free(1, 100 << 20, 0),
            Event::free(0, 40 << 20, 0),
            Event::alloc(2, 10 << 20, 0),
        ]);
        let opts = ReplayOptions {
            capacity: 64 << 20,
            ..Default::default()
        };
        let (r, _) = replay(&t, &opts, &mut |_| {});
        assert!(!r.completed);
        assert_eq!(r.events, 5);
        assert_eq!(r.failures.len(), 1);
        let f = &r.failures[0];
        assert_eq!((f.index, f.id, f.bytes, f.oom), (1, 1, 100 << 20, true));
        assert!(f.message.contains("out of memory"), "{}", f.message);
        assert_eq!(r.num_ooms, 1);
        assert!(r.num_alloc_retries >= 1);
        assert_eq!(r.peak_live_bytes, 40 << 20);
    }

    #[test]
    fn streams_are_honoured_and_calls_counted() {
        // Two streams: a block freed on stream 1 is not reused by stream 2, so two segments.
        let t = trace(vec![
            Event::alloc(0, 4 << 20, 1),
            Event::free(0, 4 << 20, 1),
            Event::alloc(1, 4 << 20, 2),
            Event::free(1, 4 << 20, 2),
        ]);
        let opts = ReplayOptions {
            config: AllocatorConfig::native(),
            ..Default::default()
        };
        let (r, _) = replay(&t, &opts, &mut |_| {});
        assert!(r.completed);
        assert_eq!(r.backend_calls.alloc_segment, 2);
        let same = trace(vec![
            Event::alloc(0, 4 << 20, 1),
            Event::free(0, 4 << 20, 1),
            Event::alloc(1, 4 << 20, 1),
            Event::free(1, 4 << 20, 1),
        ]);
        let (r, _) = replay(&same, &opts, &mut |_| {});
        assert_eq!(r.backend_calls.alloc_segment, 1);
        assert_eq!(
            r.peak_reserved_bytes,
            r.backend_calls.alloc_segment * (20 << 20)
        );
    }

    #[test]
    fn huge_request_is_a_failure_not_a_panic() {
        let t = trace(vec![
            Event::alloc(0, u64::MAX, 0),
            Event::free(0, u64::MAX, 0),
        ]);
        let (r, _) = replay(&t, &ReplayOptions::default(), &mut |_| {});
        assert_eq!(r.failures.len(), 1);
        assert!(!r.completed);
    }

    #[test]
    fn timeline_tracks_peak_and_segments() {
        let t = trace(vec![
            Event::alloc(0, 30 << 20, 0),
            Event::alloc(1, 30 << 20, 0),
            Event::free(0, 30 << 20, 0),
            Event::free(1, 30 << 20, 0),
        ]);
        let opts = ReplayOptions {
            timeline: true,
            config: AllocatorConfig::native(),
            ..Default::default()
        };
        let (r, tl) = replay(&t, &opts, &mut |_| {});
        let tl = tl.unwrap();
        assert_eq!(tl.samples.len(), 4);
        assert_eq!(tl.peak_event, 1);
        assert_eq!(tl.samples[1].live, 60 << 20);
        assert_eq!(tl.samples[1].reserved, r.peak_reserved_bytes);
        assert_eq!(tl.peak_segments.len(), 2);
        assert!(tl.peak_segments.iter().all(|s| s.allocated == 30 << 20));
    }
}
