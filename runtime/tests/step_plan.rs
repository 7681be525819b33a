//! Step plans (issue 37): a training step at the edge of memory, marked once per step, stops
//! moving pages, whether one thread frees its blocks or libtorch's autograd thread does.
//!
//! The step is a real one: VGG-16 from tch::vision at 1,118 rows on the H100, as recorded in
//! `traces/tch_vgg16_b1118.trace.csv` (three identical steps of 462 events, 77.18 GiB live at
//! the peak; thread 2 is libtorch's autograd engine). On an 80 GiB card best fit moves 10-24
//! GiB of pages in every step of it.

use std::collections::HashMap;
use std::sync::{mpsc, Arc};

use oomguard_runtime::alloc::{Allocation, CachingAllocator};
use oomguard_runtime::backend::sim::SimDevice;
use oomguard_runtime::{AllocatorConfig, ByteSize, MemoryStats};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

#[derive(Clone, Copy, Debug)]
struct Event {
    alloc: bool,
    id: u64,
    bytes: u64,
    thread: u32,
}

/// The trace's second step (events 462..924), checked to hold every block it allocates.
fn vgg_step() -> Vec<Event> {
    trace_step("tch_vgg16_b1118.trace.csv", 462)
}

/// The second of the three steps of `traces/NAME` (each `per_step` events), checked to hold
/// every block it allocates and to free some on libtorch's autograd thread.
fn trace_step(name: &str, per_step: usize) -> Vec<Event> {
    let path = format!("{}/../traces/{name}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(path).expect("the repository's VGG-16 trace");
    let events: Vec<Event> = text
        .lines()
        .skip(1)
        .map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            Event {
                alloc: f[0] == "a",
                id: f[1].parse().unwrap(),
                bytes: f[2].parse().unwrap(),
                thread: f[4].parse().unwrap(),
            }
        })
        .collect();
    assert_eq!(
        events.len(),
        3 * per_step,
        "three steps of {per_step} events"
    );
    let step = events[per_step..2 * per_step].to_vec();
    let mut live = HashMap::new();
    for e in &step {
        if e.alloc {
            live.insert(e.id, ());
        } else {
            assert!(
                live.remove(&e.id).is_some(),
                "a free of a block of this step"
            );
        }
    }
    assert!(live.is_empty(), "the step frees what it allocates");
    assert!(
        step.iter().any(|e| e.thread == 2),
        "frees from the autograd thread"
    );
    step
}

fn allocator(card: u64) -> CachingAllocator {
    CachingAllocator::new(
        Arc::new(SimDevice::new(ByteSize(card))),
        AllocatorConfig::parse("expandable_segments:True").unwrap(),
    )
}

/// What one step made the allocator do.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Moves {
    mapped: u64,
    unmapped: u64,
    syncs: u64,
    retries: u64,
}

fn moves_between(a: &MemoryStats, b: &MemoryStats) -> Moves {
    Moves {
        mapped: b.mapped_bytes_total - a.mapped_bytes_total,
        unmapped: b.unmapped_bytes_total - a.unmapped_bytes_total,
        syncs: (b.num_sync_all_streams + b.num_stream_syncs)
            - (a.num_sync_all_streams + a.num_stream_syncs),
        retries: b.num_alloc_retries - a.num_alloc_retries,
    }
}

/// Runs `step` `n` times on `a` (marking each step's start when `mark`); with `threads`, the
/// events of the trace's thread 2 run on a second thread, one event at a time in trace order.
/// Returns each step's moves.
fn run(
    a: &Arc<CachingAllocator>,
    step: &[Event],
    n: usize,
    mark: bool,
    threads: bool,
) -> Vec<Moves> {
    run_probing(a, step, n, mark, threads, None)
}

/// [`run`], with a request of `probe.1` bytes before event `probe.0` of every step that must
/// fail (a cuDNN workspace probe larger than what is left).
fn run_probing(
    a: &Arc<CachingAllocator>,
    step: &[Event],
    n: usize,
    mark: bool,
    threads: bool,
    probe: Option<(usize, u64)>,
) -> Vec<Moves> {
    type Job = Box<dyn FnOnce() + Send>;
    let (tx, rx) = mpsc::channel::<(Job, mpsc::Sender<()>)>();
    let worker = threads.then(|| {
        std::thread::spawn(move || {
            for (job, done) in rx {
                job();
                done.send(()).unwrap();
            }
        })
    });
    let mut live: HashMap<u64, Allocation> = HashMap::new();
    let mut out = Vec::new();
    for _ in 0..n {
        if mark {
            a.mark_step();
        }
        let before = a.stats();
        for (i, e) in step.iter().enumerate() {
            if let Some((_, bytes)) = probe.filter(|&(at, _)| at == i) {
                let err = a.allocate(bytes, 0).expect_err("the probe does not fit");
                assert!(err.is_oom(), "{err}");
            }
            let on_worker = threads && e.thread == 2;
            if e.alloc {
                let r = if on_worker {
                    let (a2, bytes) = (Arc::clone(a), e.bytes);
                    let (rtx, rrx) = mpsc::channel();
                    let (dtx, drx) = mpsc::channel();
                    tx.send((
                        Box::new(move || rtx.send(a2.allocate(bytes, 0)).unwrap()),
                        dtx,
                    ))
                    .unwrap();
                    drx.recv().unwrap();
                    rrx.recv().unwrap()
                } else {
                    a.allocate(e.bytes, 0)
                };
                live.insert(
                    e.id,
                    r.unwrap_or_else(|err| panic!("{} bytes: {err}", e.bytes)),
                );
            } else {
                let h = live.remove(&e.id).unwrap();
                if on_worker {
                    let a2 = Arc::clone(a);
                    let (dtx, drx) = mpsc::channel();
                    tx.send((Box::new(move || a2.free(h).unwrap()), dtx))
                        .unwrap();
                    drx.recv().unwrap();
                } else {
                    a.free(h).unwrap();
                }
            }
        }
        out.push(moves_between(&before, &a.stats()));
        a.check_invariants().unwrap();
    }
    drop(tx);
    if let Some(w) = worker {
        w.join().unwrap();
    }
    out
}

const STEPS: usize = 8;

#[test]
fn without_marks_the_vgg_step_moves_pages_every_step() {
    let step = vgg_step();
    for threads in [false, true] {
        let a = Arc::new(allocator(80 * GIB));
        let moves = run(&a, &step, STEPS, false, threads);
        let moving = moves[2..].iter().filter(|m| m.unmapped > 0).count();
        assert!(
            moving >= STEPS - 3,
            "threads {threads}: best fit alone settled: {moves:?}"
        );
        assert_eq!(a.stats().num_plans_installed, 0);
    }
}

#[test]
fn with_marks_the_vgg_step_settles_on_one_thread_and_with_the_autograd_thread() {
    let step = vgg_step();
    let large = step.iter().filter(|e| e.alloc && e.bytes > MIB).count() as u64;
    for threads in [false, true] {
        let a = Arc::new(allocator(80 * GIB));
        let moves = run(&a, &step, STEPS, true, threads);
        // steps 0 and 1 lay the blocks out by best fit and move pages; step 1 repeats step 0,
        // so the plan is installed at the mark that starts step 2 (its one move, outside the
        // steps' figures here); from then on nothing moves
        assert!(moves[0].unmapped > 0, "threads {threads}: {moves:?}");
        for (i, m) in moves.iter().enumerate().skip(2) {
            assert_eq!(
                *m,
                Moves::default(),
                "threads {threads}: step {i} moved: {moves:?}"
            );
        }
        let s = a.stats();
        assert_eq!(s.num_plans_installed, 1, "threads {threads}");
        assert_eq!(s.num_plan_misses, 0, "threads {threads}");
        assert_eq!(s.num_plans_dropped, 0, "threads {threads}");
        assert_eq!(
            s.num_plan_hits,
            large * (STEPS as u64 - 2),
            "threads {threads}"
        );
        assert_eq!(s.num_ooms, 0);
        // the plan's range, the largest segment: within 0.5 % of the step's peak live bytes
        // (77.18 GiB; `oomguard layout` finds 1.0016 x over 300 block orders)
        let peak_live = 82_872_953_496u64;
        let range = a.snapshot().iter().map(|g| g.mapped).max().unwrap();
        assert!(
            range as f64 <= 1.005 * peak_live as f64 && range >= peak_live,
            "threads {threads}: the plan's range maps {range} bytes"
        );
        assert!(s.reserved_bytes.all.peak <= 80 * GIB);
        assert_eq!(s.allocated_bytes.all.current, 0);
    }
}

/// The plan's range, installed at the edge of memory, maps the segment's 20 MiB handles as
/// growth does (all but a tail shorter than one handle): the memory a move frees there is
/// handles, which the CUDA backend keeps as spares and maps again. Before, the range at the edge
/// was mapped in 2 MiB pages, so the card released every spare and created the range page by
/// page: GPT-2 small's install step took 7.8 s against 3.6 s settled on the H200 (docs/GPU.md
/// run 97).
#[test]
fn a_plan_at_the_edge_maps_its_range_in_handles() {
    let sim = Arc::new(SimDevice::new(ByteSize(80 * GIB)));
    let a = Arc::new(CachingAllocator::new(
        sim.clone(),
        AllocatorConfig::parse("expandable_segments:True").unwrap(),
    ));
    let moves = run(&a, &vgg_step(), 3, true, false);
    assert!(moves[0].unmapped > 0, "not at the edge: {moves:?}");
    assert_eq!(a.stats().num_plans_installed, 1);
    let range = a
        .snapshot()
        .into_iter()
        .max_by_key(|g| g.mapped)
        .expect("segments");
    let (lo, hi) = (range.base, range.base + range.mapped);
    let in_handles: u64 = sim
        .handle_runs()
        .iter()
        .map(|&(start, end, _)| end.min(hi).saturating_sub(start.max(lo)))
        .sum();
    let handle = sim
        .handle_runs()
        .iter()
        .find(|&&(start, end, _)| start < hi && lo < end)
        .map(|&(.., h)| h)
        .expect("the plan's range maps no handle");
    assert!(handle >= 20 * MIB, "handles of {handle} bytes");
    assert!(
        in_handles + handle > range.mapped,
        "{in_handles} of the range's {} bytes in handles",
        range.mapped
    );
}

/// A card between the step's peak live bytes and its laid-out range (77.3 GiB: the layout needs
/// 77.31 GiB): the contiguous plan cannot be mapped, so the step is planned at page granularity
/// (`shared_plan`: each request its own address range, backed by pages only requests never live
/// together share), whose memory is the step's peak live pages. It is mapped once the step has
/// repeated twice (at the mark that starts step 3); from then on nothing moves, on one thread and
/// with the autograd thread's frees. Before shared plans the
/// loop ran by best fit here, moving up to 0.56 of the card in every step.
#[test]
fn a_plan_too_tall_for_the_card_is_shared_at_page_granularity_and_the_loop_settles() {
    let step = vgg_step();
    let card = 77 * GIB + 300 * MIB;
    for threads in [false, true] {
        let a = Arc::new(allocator(card));
        let moves = run(&a, &step, STEPS, true, threads);
        let s = a.stats();
        assert_eq!(s.num_plans_installed, 1, "threads {threads}: {moves:?}");
        assert_eq!(s.num_plans_shared, 1, "threads {threads}: {moves:?}");
        assert_eq!(s.num_plans_refused, 0, "threads {threads}: {moves:?}");
        assert_eq!(s.num_ooms, 0, "threads {threads}");
        assert_eq!(s.num_plan_misses, 0, "threads {threads}");
        for (i, m) in moves.iter().enumerate().skip(3) {
            assert_eq!(
                *m,
                Moves::default(),
                "threads {threads}: step {i} moved: {moves:?}"
            );
        }
        assert!(s.reserved_bytes.all.peak <= card);
        // empty_cache gives the plan's pool back once its blocks are free
        a.empty_cache().unwrap();
        a.check_invariants().unwrap();
        assert_eq!(a.stats().reserved_bytes.all.current, 0, "threads {threads}");
    }
}

/// VGG-16 at 1,951 rows, recorded on the H200 with libtorch's autograd thread (run 87): its
/// contiguous layout (1.0103 x the step's peak live bytes) is taller than the 137.8 GiB the
/// card left the step, so the card refused the plan and pages moved in every step (148 GB in 6).
/// Shared at page granularity it fits: nothing moves from step 3 on (the plan is mapped once the
/// step has repeated twice), on both threads.
#[test]
fn the_largest_vgg_step_on_the_h200_settles_with_a_shared_plan() {
    let step = trace_step("tch_vgg16_b1951.trace.csv", 604);
    let card = 147_961_623_347; // 137.8 GiB
    for threads in [false, true] {
        let a = Arc::new(allocator(card));
        let moves = run(&a, &step, STEPS, true, threads);
        let s = a.stats();
        assert_eq!(
            (s.num_plans_installed, s.num_plans_shared, s.num_ooms),
            (1, 1, 0),
            "threads {threads}: {moves:?}"
        );
        assert!(moves[0].unmapped > 0 || moves[1].unmapped > 0, "{moves:?}");
        for (i, m) in moves.iter().enumerate().skip(3) {
            assert_eq!(
                *m,
                Moves::default(),
                "threads {threads}: step {i} moved: {moves:?}"
            );
        }
        assert!(s.reserved_bytes.all.peak <= card);
    }
}

#[test]
fn a_step_that_changes_drops_its_plan_and_is_still_served() {
    let step = vgg_step();
    let a = Arc::new(allocator(80 * GIB));
    run(&a, &step, 3, true, false);
    assert_eq!(a.stats().num_plans_installed, 1);
    // another step: every request 1 MiB and a half larger, at a smaller batch's scale
    let large: std::collections::HashSet<u64> = step
        .iter()
        .filter(|e| e.alloc && e.bytes > MIB)
        .map(|e| e.id)
        .collect();
    let other: Vec<Event> = step
        .iter()
        .filter(|e| large.contains(&e.id))
        .map(|e| Event {
            bytes: e.bytes / 2 + 3 * MIB / 2,
            ..*e
        })
        .collect();
    let moves = run(&a, &other, 3, true, false);
    let s = a.stats();
    assert!(s.num_plan_misses > 0);
    assert_eq!(s.num_plans_dropped, 1, "{s:?}");
    // dropped at its first request that needed the plan's pages: they then serve best fit
    // where they are, with no wait and no retry
    assert_eq!((moves[0].syncs, moves[0].retries), (0, 0), "{moves:?}");
    assert_eq!(s.num_ooms, 0);
    assert_eq!(s.allocated_bytes.all.current, 0);
}

#[test]
fn empty_cache_drops_the_plan_and_gives_its_pages_back() {
    let step = vgg_step();
    let a = Arc::new(allocator(80 * GIB));
    run(&a, &step, 3, true, false);
    assert!(a.stats().reserved_bytes.all.current > 70 * GIB);
    a.empty_cache().unwrap();
    let s = a.stats();
    assert_eq!(s.num_plans_dropped, 1);
    assert_eq!(s.reserved_bytes.all.current, 0, "{s:?}");
}

#[test]
fn a_request_that_needs_the_plans_free_pages_is_served() {
    let step = vgg_step();
    let a = Arc::new(allocator(80 * GIB));
    run(&a, &step, 3, true, false);
    // between steps the plan's range is free; a request larger than what is left beside it is
    // served in the range's free space, with no page moved and no release
    let before = a.stats();
    let big = a
        .allocate(60 * GIB, 0)
        .expect("served in the plan's free space");
    let s = a.stats();
    assert_eq!(s.num_ooms, 0);
    assert_eq!(s.unmapped_bytes_total, before.unmapped_bytes_total);
    assert_eq!(s.num_plan_misses, before.num_plan_misses + 1);
    a.free(big).unwrap();
    // and a request no free space holds, outside or in the range, still is, after a release
    let huge = a
        .allocate(79 * GIB, 0)
        .expect("served once the plan's pages are released");
    assert_eq!(a.stats().num_plans_dropped, 1);
    a.free(huge).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn a_loop_with_room_to_spare_gets_a_plan_that_gives_its_extra_pages_back() {
    let step = vgg_step();
    let peak_live = 82_872_953_496u64;
    // on a card with room to spare, best fit settles after its first step, at 1.0826 x the
    // step's peak live bytes; the plan lays the step out in 1.0016 x
    for threads in [false, true] {
        let a = Arc::new(allocator(160 * GIB));
        let moves = run(&a, &step, 2, true, threads);
        assert_eq!(moves[1], Moves::default(), "threads {threads}: {moves:?}");
        let before = a.stats();
        assert_eq!(before.num_plans_installed, 0);
        assert!(
            before.reserved_bytes.all.current as f64 >= 1.05 * peak_live as f64,
            "threads {threads}: best fit alone reserved {}",
            before.reserved_bytes.all.current
        );
        // the third mark: the second step repeated the first, with room: the plan
        let moves = run(&a, &step, 4, true, threads);
        let s = a.stats();
        assert_eq!(s.num_plans_installed, 1, "threads {threads}");
        for (i, m) in moves.iter().enumerate() {
            assert_eq!(
                *m,
                Moves::default(),
                "threads {threads}: step {i}: {moves:?}"
            );
        }
        let reserved = s.reserved_bytes.all.current;
        assert!(
            reserved >= peak_live && reserved as f64 <= 1.005 * peak_live as f64,
            "threads {threads}: reserved {reserved} after the plan"
        );
        // the free pages went back before the range was mapped: reserved never rose for it
        assert_eq!(
            s.reserved_bytes.all.peak, before.reserved_bytes.all.peak,
            "threads {threads}"
        );
        assert_eq!(s.num_plan_misses, 0);
        assert_eq!(s.num_ooms, 0);
    }
}

/// A step of `n` blocks of 64 MiB, all live at once, then all freed.
fn uniform_step(n: u64) -> Vec<Event> {
    let alloc = (0..n).map(|id| Event {
        alloc: true,
        id,
        bytes: 64 * MIB,
        thread: 1,
    });
    let free = (0..n).map(|id| Event {
        alloc: false,
        id,
        bytes: 64 * MIB,
        thread: 1,
    });
    alloc.chain(free).collect()
}

#[test]
fn a_loop_that_best_fit_lays_out_as_tightly_gets_no_plan() {
    let step = uniform_step(16);
    let a = Arc::new(allocator(160 * GIB));
    let moves = run(&a, &step, 6, true, false);
    for (i, m) in moves.iter().enumerate().skip(1) {
        assert_eq!(*m, Moves::default(), "step {i}: {moves:?}");
    }
    let s = a.stats();
    assert_eq!(s.num_step_marks, 6);
    // laid out once (a plan would save nothing), never installed
    assert_eq!(s.num_plans_installed, 0);
    assert_eq!(s.num_plan_hits + s.num_plan_misses, 0);
}

#[test]
fn after_a_plan_is_dropped_for_its_misses_room_alone_installs_no_other() {
    let step = vgg_step();
    let a = Arc::new(allocator(160 * GIB));
    run(&a, &step, 3, true, false);
    assert_eq!(a.stats().num_plans_installed, 1);
    // steps of other sizes: the plan misses, and is dropped after two such steps
    let other: Vec<Event> = step
        .iter()
        .map(|e| Event {
            bytes: if e.bytes > MIB {
                e.bytes / 2 + 3 * MIB / 2
            } else {
                e.bytes
            },
            ..*e
        })
        .collect();
    run(&a, &other, 3, true, false);
    let s = a.stats();
    assert_eq!(s.num_plans_dropped, 1, "{s:?}");
    // the first steps again, with room: the loop varies, so no new plan moves its pages
    let moves = run(&a, &step, 4, true, false);
    let s = a.stats();
    assert_eq!(s.num_plans_installed, 1, "{s:?}");
    assert_eq!(s.num_ooms, 0);
    for (i, m) in moves.iter().enumerate().skip(1) {
        assert_eq!(m.unmapped, 0, "step {i}: {moves:?}");
    }
}

#[test]
fn a_hopeless_probe_inside_a_planned_step_keeps_the_plan() {
    let step = vgg_step();
    // the step's peak: where the most bytes are live
    let (mut live, mut peak, mut at) = (HashMap::new(), 0u64, 0);
    for (i, e) in step.iter().enumerate() {
        if e.alloc {
            live.insert(e.id, e.bytes);
        } else {
            live.remove(&e.id);
        }
        let now: u64 = live.values().sum();
        if now > peak {
            (peak, at) = (now, i + 1);
        }
    }
    let a = Arc::new(allocator(80 * GIB));
    let moves = run_probing(&a, &step, 5, true, false, Some((at, 20 * GIB)));
    for (i, m) in moves.iter().enumerate().skip(2) {
        assert_eq!(m.mapped + m.unmapped + m.syncs, 0, "step {i}: {moves:?}");
    }
    let s = a.stats();
    assert_eq!(s.num_plans_installed, 1);
    assert_eq!(s.num_plans_dropped, 0);
    assert_eq!(s.num_plan_misses, 0);
    assert_eq!(s.num_ooms, 5, "the five probes, and nothing else");
}

#[test]
fn empty_cache_between_steps_is_not_a_move_that_plans() {
    let step = vgg_step();
    // room to spare: best fit settles; emptying the cache after each step (a finder's trials)
    // unmaps every page, which is not the step moving pages
    let a = Arc::new(allocator(160 * GIB));
    for _ in 0..4 {
        run(&a, &step, 1, true, false);
        a.empty_cache().unwrap();
    }
    let s = a.stats();
    assert_eq!(s.num_step_marks, 4);
    assert_eq!(s.num_plans_installed, 0, "{s:?}");
}

#[test]
fn the_retry_engine_marks_each_step_it_runs() {
    use oomguard_runtime::retry::RetryEngine;
    use oomguard_runtime::Device;
    let dev = Device::sim(ByteSize::gib(1));
    let engine = RetryEngine::new();
    for _ in 0..3 {
        engine
            .run(
                &dev,
                8,
                |plan| {
                    dev.alloc::<u8>(plan.batch() * 2 * MIB as usize)
                        .map(|b| b.len())
                },
                |n| n,
            )
            .unwrap();
    }
    assert_eq!(dev.stats().num_step_marks, 3);
}

#[test]
fn with_step_plans_off_marks_are_only_counted() {
    let step = vgg_step();
    let a = Arc::new(CachingAllocator::new(
        Arc::new(SimDevice::new(ByteSize(80 * GIB))),
        AllocatorConfig::parse("expandable_segments:True,step_plans:False").unwrap(),
    ));
    let moves = run(&a, &step, 5, true, false);
    assert!(moves[2..].iter().any(|m| m.unmapped > 0), "{moves:?}");
    let s = a.stats();
    assert_eq!(s.num_step_marks, 5);
    assert_eq!(s.num_plans_installed + s.num_plans_refused, 0);
    assert_eq!(s.num_plan_hits + s.num_plan_misses, 0);
}

/// A random step (seeded): 24-60 blocks of 1-96 MiB (a fifth of them small, under 516 KiB),
/// each freed a few blocks later.
fn random_step(seed: u64) -> Vec<Event> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let n = 24 + (next() % 37) as usize;
    let mut step = Vec::new();
    let mut open: Vec<u64> = Vec::new();
    for id in 0..n as u64 {
        let bytes = if next() % 5 == 0 {
            4096 + next() % (512 << 10)
        } else {
            MIB + next() % (95 * MIB)
        };
        step.push(Event {
            alloc: true,
            id,
            bytes,
            thread: 1,
        });
        open.push(id);
        while open.len() > 1 + (next() % 8) as usize {
            let k = (next() as usize) % open.len();
            step.push(Event {
                alloc: false,
                id: open.swap_remove(k),
                bytes: 0,
                thread: 1,
            });
        }
    }
    for id in open {
        step.push(Event {
            alloc: false,
            id,
            bytes: 0,
            thread: 1,
        });
    }
    step
}

/// The most bytes a step holds at once.
fn peak_live(step: &[Event]) -> u64 {
    let (mut live, mut peak) = (HashMap::new(), 0u64);
    for e in step {
        if e.alloc {
            live.insert(e.id, e.bytes);
        } else {
            live.remove(&e.id);
        }
        peak = peak.max(live.values().sum());
    }
    peak
}

/// Shared plans give no page to two blocks live at once: each random step above repeated, marked,
/// on a host-backed simulated device, on every card from 1.02 x its peak live bytes to 1.06 x
/// (by 1 %) on which it runs unmarked; after five steps, two in which every free comes three
/// events late (a block of the plan then outlives the recorded one, and the slots sharing its
/// pages must wait), then two as before. Every large block gets its id written into each of its
/// pages when allocated, checked when it is freed: a page another live block also held would
/// show the other's id. The five repeating steps must run; from the first late one on, a step may
/// run out of memory (misses are served outside the plan, and a step that differs from the
/// laid-out one may fail at the edge of memory, see the test below): this test is about what a
/// step that runs writes. Shared plans happen in these loops (at least 5 in the 20), and `empty_cache`
/// gives all their memory back.
#[test]
fn a_shared_plan_never_gives_two_live_blocks_one_page() {
    use oomguard_runtime::backend::Backend;
    let mut shared = 0;
    for seed in 1..=20u64 {
        let step = random_step(seed);
        let mut late = step.clone();
        for i in (0..late.len()).rev() {
            if !late[i].alloc {
                let to = (i + 3).min(late.len() - 1);
                let e = late.remove(i);
                late.insert(to, e);
            }
        }
        let peak = peak_live(&step);
        let steps: Vec<(&Vec<Event>, bool)> = [(&step, false); 5]
            .into_iter()
            .chain([(&late, true); 2])
            .chain([(&step, true); 2])
            .collect();
        let run_loop = |card: u64, mark: bool| -> Option<MemoryStats> {
            let sim = SimDevice::new(ByteSize(card));
            let a = CachingAllocator::new(
                Arc::new(sim.clone()),
                AllocatorConfig::parse("expandable_segments:True").unwrap(),
            );
            for &(st, may_fail) in &steps {
                if mark {
                    a.mark_step();
                }
                let mut held: HashMap<u64, (Allocation, u64)> = HashMap::new();
                for e in st.iter() {
                    if e.alloc {
                        let h = match a.allocate(e.bytes, 0) {
                            Ok(h) => h,
                            Err(_) if may_fail => break,
                            Err(_) => return None,
                        };
                        if e.bytes > MIB {
                            for off in (0..e.bytes - 8).step_by(MIB as usize).chain([e.bytes - 8]) {
                                sim.copy_to_device(h.ptr + off, &e.id.to_le_bytes())
                                    .unwrap();
                            }
                        }
                        held.insert(e.id, (h, e.bytes));
                    } else if let Some((h, bytes)) = held.remove(&e.id) {
                        if bytes > MIB {
                            for off in (0..bytes - 8).step_by(MIB as usize).chain([bytes - 8]) {
                                let mut got = [0u8; 8];
                                sim.copy_to_host(&mut got, h.ptr + off).unwrap();
                                assert_eq!(
                                    u64::from_le_bytes(got),
                                    e.id,
                                    "seed {seed}, card {card}: block {} at +{off} was overwritten",
                                    e.id
                                );
                            }
                        }
                        a.free(h).unwrap();
                    }
                }
                for (_, (h, _)) in held {
                    a.free(h).unwrap();
                }
                a.check_invariants()
                    .unwrap_or_else(|err| panic!("seed {seed}: {err}"));
            }
            let stats = a.stats();
            a.empty_cache().unwrap();
            a.check_invariants().unwrap();
            assert_eq!(a.stats().reserved_bytes.all.current, 0, "seed {seed}");
            Some(stats)
        };
        for k in 0..5 {
            let card = (peak as f64 * (1.02 + 0.01 * k as f64)) as u64;
            if run_loop(card, false).is_none() {
                continue;
            }
            let marked = run_loop(card, true).unwrap_or_else(|| {
                panic!("seed {seed}: a repeating step ran unmarked on {card} B, not marked")
            });
            shared += marked.num_plans_shared;
        }
    }
    assert!(shared >= 5, "{shared} shared plans in the 20 loops");
}

/// Random steps near a card's capacity, on the tightest card (from 1.02 × the step's peak live
/// bytes up, by 1 %) where every step runs unmarked, the allocator's invariants checked after
/// every step:
/// - a loop of one repeating step runs every step marked too: a plan never turns a repeating
///   step into an out-of-memory;
/// - a loop with a changed step (a request resized, one added) may fail that step marked (the
///   plan's range holds the layout of the step before it; 2 changed steps of these 40 loops
///   did on 2026-11-29, as the test prints), but every step that repeats the one before runs.
#[test]
fn random_loops_marked_run_every_step_that_repeats() {
    let mut installed = 0;
    let mut changed_failed = 0;
    let only: Option<u64> = std::env::var("SEED").ok().map(|s| s.parse().unwrap());
    for seed in 1..=40u64 {
        if only.is_some_and(|o| o != seed) {
            continue;
        }
        let step = random_step(seed);
        // the steps: the same, then one with a request resized, then one with a request added
        let mut resized = step.clone();
        if let Some(e) = resized.iter_mut().find(|e| e.alloc && e.bytes > MIB) {
            e.bytes += 3 * MIB;
        }
        let mut added = step.clone();
        added.insert(
            0,
            Event {
                alloc: true,
                id: u64::MAX,
                bytes: 5 * MIB,
                thread: 1,
            },
        );
        added.push(Event {
            alloc: false,
            id: u64::MAX,
            bytes: 0,
            thread: 1,
        });
        let repeating: Vec<&Vec<Event>> = vec![&step; 9];
        let changed = vec![
            &step, &step, &step, &step, &resized, &step, &added, &step, &step,
        ];
        // the card: a little above the step's peak live bytes
        let (mut live, mut peak) = (HashMap::new(), 0u64);
        for e in &step {
            if e.alloc {
                live.insert(e.id, e.bytes);
            } else {
                live.remove(&e.id);
            }
            peak = peak.max(live.values().sum());
        }
        let runs = |steps: &[&Vec<Event>], card: u64, mark: bool| {
            let a = Arc::new(allocator(card));
            let mut ok = Vec::new();
            for st in steps.iter() {
                if mark {
                    a.mark_step();
                }
                let mut held: HashMap<u64, Allocation> = HashMap::new();
                let mut failed = false;
                for e in st.iter() {
                    if e.alloc {
                        match a.allocate(e.bytes, 0) {
                            Ok(h) => {
                                held.insert(e.id, h);
                            }
                            Err(err) => {
                                assert!(err.is_oom(), "{err}");
                                failed = true;
                                break;
                            }
                        }
                    } else if let Some(h) = held.remove(&e.id) {
                        a.free(h).unwrap();
                    }
                }
                for (_, h) in held {
                    a.free(h).unwrap();
                }
                a.check_invariants()
                    .unwrap_or_else(|e| panic!("seed {seed}, marked {mark}: {e}"));
                ok.push(!failed);
            }
            (ok, a.stats())
        };
        for (steps, is_changed) in [(&repeating, false), (&changed, true)] {
            let Some(card) = (0..50)
                .map(|k| (peak as f64 * (1.02 + 0.01 * k as f64)) as u64)
                .find(|&card| runs(steps, card, false).0.iter().all(|&ok| ok))
            else {
                continue;
            };
            let (marked, stats) = runs(steps, card, true);
            for (k, &ok) in marked.iter().enumerate() {
                let repeats = k == 0 || std::ptr::eq(steps[k], steps[k - 1]);
                assert!(
                    ok || (is_changed && !repeats),
                    "seed {seed}: step {k} ran unmarked on {card} B, not marked: {marked:?} ({stats:?})"
                );
            }
            if is_changed {
                changed_failed += marked.iter().filter(|&&ok| !ok).count();
            }
            installed += stats.num_plans_installed;
        }
    }
    eprintln!("changed steps that failed marked: {changed_failed}");
    // the case is one where plans happen, not only one where they could
    assert!(
        installed > 0,
        "no plan was installed in any of the 40 loops"
    );
}

/// The same step on a card that reports 143,771 MiB (the H200's total) but leaves the step
/// 137.8 GiB: the rest is held outside the allocator, as libtorch's context and cuBLAS hold it.
/// Once the device has refused a map, a contiguous plan taller than what the device held is not
/// tried: the try gave every free page back and recreated it (on the simulator, 70,313 pages
/// created at the mark of the third step, against 1,702 with the check). Only the marks that
/// install the shared plan create the step's memory again; the loop settles as before.
#[test]
fn a_plan_taller_than_the_card_holds_is_not_tried_when_its_total_is_larger() {
    use oomguard_runtime::backend::Backend;
    let step = trace_step("tch_vgg16_b1951.trace.csv", 604);
    let (total, left) = (143_771 * MIB, 147_961_623_347u64);
    let peak_pages = peak_live(&step) / (2 * MIB);
    for threads in [false, true] {
        let sim = SimDevice::new(ByteSize(total));
        let _outside = sim
            .alloc_segment((total - left).next_multiple_of(2 * MIB), 0)
            .unwrap();
        let a = Arc::new(CachingAllocator::new(
            Arc::new(sim.clone()),
            AllocatorConfig::parse("expandable_segments:True").unwrap(),
        ));
        let mut moves = Vec::new();
        for i in 0..STEPS {
            let (c0, plans0) = (sim.calls(), a.stats().num_plans_installed);
            moves.extend(run(&a, &step, 1, true, threads));
            let created = sim.calls().pages_created - c0.pages_created;
            let installed = a.stats().num_plans_installed > plans0;
            if i >= 1 && !installed {
                assert!(
                    created * 10 < peak_pages,
                    "threads {threads}: step {i} created {created} pages (peak live {peak_pages})"
                );
            }
        }
        let s = a.stats();
        assert_eq!(
            (s.num_plans_installed, s.num_plans_shared, s.num_ooms),
            (1, 1, 0),
            "threads {threads}: {moves:?}"
        );
        for (i, m) in moves.iter().enumerate().skip(4) {
            assert_eq!(
                *m,
                Moves::default(),
                "threads {threads}: step {i} moved: {moves:?}"
            );
        }
    }
}
