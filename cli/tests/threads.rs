//! `oomguard replay --threads`: a trace whose events come from several threads (libtorch's
//! autograd engine frees the forward's tensors on its own thread) replays each event on a thread
//! of its own recorded thread, so that the allocator runs in its multi-thread mode (thread
//! caches) as it did in the program.

mod common;

use std::collections::HashMap;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use oomguard_cli::replay::{replay, ReplayOptions, ReplayReport};
use oomguard_cli::{csv_trace, Event, Op, Trace, TraceFormat};
use oomguard_runtime::backend::sim::SimDevice;
use oomguard_runtime::{Allocation, AllocatorConfig, ByteSize, CachingAllocator};

fn oomguard(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_oomguard"))
        .args(args)
        .output()
        .expect("run oomguard")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn json(o: &Output) -> serde_json::Value {
    let out = String::from_utf8_lossy(&o.stdout);
    serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"))
}

/// A training loop of `steps` steps as libtorch runs one: the parameters allocated once on
/// thread 1; each step's forward allocates activations on thread 1, the backward (thread 2, the
/// autograd engine) frees them and allocates the gradients, the optimizer (thread 1) frees the
/// gradients. Activations alternate in size between steps, small (below 1 MiB) and large.
fn training(steps: usize) -> Vec<Event> {
    let mut events = Vec::new();
    let mut id = 0u64;
    let mut alloc = |events: &mut Vec<Event>, bytes: u64, thread: u64| {
        events.push(Event::alloc(id, bytes, 0).on_thread(thread));
        id += 1;
        (id - 1, bytes)
    };
    let params: Vec<(u64, u64)> = [3 << 20, 5 << 20, 700 << 10, 96 << 10, 12 << 20]
        .into_iter()
        .map(|b| alloc(&mut events, b, 1))
        .collect();
    for step in 0..steps as u64 {
        let acts: Vec<(u64, u64)> = (0..20)
            .map(|k| {
                let b = [256 << 10, 3 << 20, 512, 7 << 20, 40 << 10][k % 5] * (1 + step % 2);
                alloc(&mut events, b, 1)
            })
            .collect();
        for &(a, b) in acts.iter().rev() {
            events.push(Event::free(a, b, 0).on_thread(2));
        }
        let grads: Vec<(u64, u64)> = params
            .iter()
            .map(|&(_, b)| alloc(&mut events, b, 2))
            .collect();
        for (g, b) in grads {
            events.push(Event::free(g, b, 0).on_thread(1));
        }
    }
    events
}

/// The allocator's own figures when `events` are made by real threads, one per recorded thread,
/// in trace order (each thread waits for its turn): what a replay with threads must report.
/// `threads == false`: every event on the test's thread.
fn driven(events: &[Event], threads: bool) -> (u64, u64, u64) {
    let alloc = CachingAllocator::new(
        Arc::new(SimDevice::address_only(ByteSize(80 << 30))),
        AllocatorConfig::default(),
    );
    let live: Mutex<HashMap<u64, Allocation>> = Mutex::new(HashMap::new());
    let run = |e: &Event| match e.op {
        Op::Alloc => {
            let a = alloc.allocate(e.bytes, e.stream).unwrap();
            live.lock().unwrap().insert(e.id, a);
        }
        Op::Free => {
            let a = live.lock().unwrap().remove(&e.id).unwrap();
            alloc.free(a).unwrap();
        }
    };
    if threads {
        let turn = AtomicUsize::new(0);
        let mut names: Vec<u64> = events.iter().map(|e| e.thread).collect();
        names.sort_unstable();
        names.dedup();
        std::thread::scope(|s| {
            for name in names {
                let (turn, run) = (&turn, &run);
                s.spawn(move || {
                    for (i, e) in events.iter().enumerate() {
                        if e.thread != name {
                            continue;
                        }
                        while turn.load(Ordering::Acquire) != i {
                            std::thread::yield_now();
                        }
                        run(e);
                        turn.store(i + 1, Ordering::Release);
                    }
                });
            }
        });
    } else {
        events.iter().for_each(run);
    }
    let st = alloc.stats();
    (
        st.reserved_bytes.all.peak,
        st.num_map,
        st.mapped_bytes_total,
    )
}

fn figures(r: &ReplayReport) -> (u64, u64, u64) {
    (
        r.peak_reserved_bytes,
        r.backend_calls.map,
        r.backend_calls.mapped_bytes,
    )
}

/// The replay with threads reports what two real threads make the allocator do, and the replay
/// without what one thread does; on this loop they differ (the backward's frees of thread 1's
/// small blocks go back to thread 1's cache, where they stay at their size instead of merging as
/// one thread's quick lists do on a miss: 2 MiB more reserved), so a replay that ignored the
/// threads would fail here.
#[test]
fn replay_with_threads_does_what_the_recorded_threads_did() {
    let trace = Trace::new(TraceFormat::Csv, training(6));
    let with = ReplayOptions {
        threads: true,
        ..ReplayOptions::default()
    };
    let (r, _) = replay(&trace, &with, &mut |_| {});
    assert!(r.completed, "{:?}", r.failures);
    assert_eq!((r.threads, r.allocating_threads), (2, 2));
    let two = driven(&trace.events, true);
    assert_eq!(figures(&r), two);

    let (one_r, _) = replay(&trace, &ReplayOptions::default(), &mut |_| {});
    assert!(one_r.completed);
    assert_eq!((one_r.threads, one_r.allocating_threads), (1, 1));
    let one = driven(&trace.events, false);
    assert_eq!(figures(&one_r), one);

    assert_ne!(two, one, "the loop must tell the two modes apart");
    assert_eq!(r.peak_live_bytes, one_r.peak_live_bytes);
    assert_eq!(r.peak_live_bytes, trace.peak_live_bytes());
}

/// The command line: `--threads` on a CSV file with the thread column, with `--steps`; the
/// per-step figures add up to the whole replay's, as without threads; the table says the mode.
#[test]
fn the_command_replays_a_two_thread_file_step_by_step() {
    let dir = common::scratch("threads");
    let file = dir.path().join("two_threads.csv");
    std::fs::write(&file, csv_trace::write(&training(6))).unwrap();
    let file = file.to_str().unwrap();
    for threads in [true, false] {
        let mut args = vec!["replay", file, "--steps", "6", "--json"];
        if threads {
            args.push("--threads");
        }
        let o = oomguard(&args);
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        let v = json(&o);
        let n = if threads { 2 } else { 1 };
        assert_eq!(v["threads"], n, "{v}");
        assert_eq!(v["allocating_threads"], n, "{v}");
        let steps = v["per_step"].as_array().unwrap();
        assert_eq!(steps.len(), 6, "{v}");
        let sum = |k: &str| steps.iter().map(|s| s[k].as_u64().unwrap()).sum::<u64>();
        let calls = &v["backend_calls"];
        assert_eq!(sum("mapped_bytes"), calls["mapped_bytes"].as_u64().unwrap());
        assert_eq!(sum("maps"), calls["map"].as_u64().unwrap());
        assert_eq!(sum("unmaps"), calls["unmap"].as_u64().unwrap());
        assert_eq!(
            sum("synchronizations"),
            calls["synchronize"].as_u64().unwrap() + calls["stream_synchronize"].as_u64().unwrap()
        );
        assert_eq!(sum("retries"), v["num_alloc_retries"].as_u64().unwrap());
        // the first step maps what the loop needs
        assert!(steps[0]["mapped_bytes"].as_u64().unwrap() > 0, "{v}");
    }
    let text = oomguard(&["replay", file, "--threads"]);
    assert_eq!(text.status.code(), Some(0), "{}", stderr(&text));
    let out = String::from_utf8_lossy(&text.stdout);
    assert!(
        out.contains("threads          2 called the allocator, 2 allocated (multi-thread mode"),
        "{out}"
    );
    let help = oomguard(&["replay", "--help"]);
    assert!(
        String::from_utf8_lossy(&help.stdout).contains("--threads"),
        "{}",
        String::from_utf8_lossy(&help.stdout)
    );
}

/// Under pressure the allocator releases its cache and retries; a replay with threads counts
/// those retries per step as one without does, whichever thread's allocation caused them. Each
/// step allocates a larger block than the last on one thread and frees it on the other; on a
/// 64 MiB device, growing beside the cached block of the step before fails from the second step
/// on (30 + 40 MiB > 64 MiB), so that step retries once.
#[test]
fn retries_are_counted_per_step_with_threads() {
    let mut events = Vec::new();
    for (k, mib) in [30u64, 40, 50, 60].into_iter().enumerate() {
        let (id, bytes, t) = (k as u64 * 2, mib << 20, k as u64 % 2 + 1);
        let other = 3 - t;
        events.push(Event::alloc(id, bytes, 0).on_thread(t));
        events.push(Event::alloc(id + 1, 4096, 0).on_thread(other));
        events.push(Event::free(id, bytes, 0).on_thread(other));
        events.push(Event::free(id + 1, 4096, 0).on_thread(t));
    }
    let trace = Trace::new(TraceFormat::Csv, events);
    let opts = |threads| ReplayOptions {
        threads,
        steps: Some(4),
        capacity: 64 << 20,
        config: AllocatorConfig::native(),
        ..ReplayOptions::default()
    };
    let mut per_step = Vec::new();
    for threads in [false, true] {
        let (r, _) = replay(&trace, &opts(threads), &mut |_| {});
        assert!(r.completed, "threads {threads}: {:?}", r.failures);
        assert_eq!(r.allocating_threads, if threads { 2 } else { 1 });
        let retries: Vec<u64> = r.per_step.iter().map(|s| s.retries).collect();
        assert_eq!(retries, vec![0, 1, 1, 1], "threads {threads}: {r:?}");
        assert_eq!(r.num_alloc_retries, 3);
        per_step.push(r.per_step);
    }
    assert_eq!(per_step[0], per_step[1]);
}

/// Files without the thread column replay as before, with or without `--threads` (one thread).
#[test]
fn one_thread_files_replay_unchanged() {
    let file = common::traces_dir().join("candle_gpt24.trace.csv");
    let file = file.to_str().unwrap();
    let run = |threads: bool| {
        let mut args = vec!["replay", file, "--json", "--steps", "6"];
        if threads {
            args.push("--threads");
        }
        let o = oomguard(&args);
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        let mut v = json(&o);
        v.as_object_mut().unwrap().remove("seconds");
        v
    };
    let (plain, threaded) = (run(false), run(true));
    assert_eq!(plain, threaded);
    assert_eq!(plain["threads"], 1);
}

/// A thread value that is not a number is a one-line error naming its line, status 2.
#[test]
fn a_malformed_thread_is_a_one_line_error() {
    let dir = common::scratch("threads-bad");
    for (body, needle) in [
        ("a,0,100,0,1\nf,0,100,0,two\n", "line 3: thread \"two\""),
        ("a,0,100,0,1\nf,0,100,0,-2\n", "line 3: thread \"-2\""),
        ("a,0,100,0,1\nf,0,100,0\n", "line 3: expected 5 fields"),
        (
            "a,0,100,0,99999999999999999999\n",
            "line 2: thread \"99999999999999999999\": too large for 64 bits",
        ),
    ] {
        let file = dir.path().join("bad.csv");
        std::fs::write(&file, format!("op,id,bytes,stream,thread\n{body}")).unwrap();
        for threads in [false, true] {
            let mut args = vec!["replay", file.to_str().unwrap()];
            if threads {
                args.push("--threads");
            }
            let o = oomguard(&args);
            let err = stderr(&o);
            assert_eq!(o.status.code(), Some(2), "{err}");
            assert_eq!(err.trim_end().lines().count(), 1, "{err}");
            assert!(err.contains(needle), "want {needle:?} in {err}");
            assert!(!err.contains("panicked"), "{err}");
        }
    }
}

/// Written and read back through a file, a trace keeps its threads.
#[test]
fn threads_survive_writing_and_reading_a_file() {
    let events = training(2);
    let dir = common::scratch("threads-roundtrip");
    let file = dir.path().join("t.csv");
    std::fs::write(&file, csv_trace::write(&events)).unwrap();
    let back = oomguard_cli::detect::read_trace(&file).unwrap();
    assert_eq!(back.events, events);
    assert!(back.events.iter().any(|e| e.thread == 2));
}

/// More recorded threads than a replay starts: refused with `--threads` (status 2, one line),
/// replayed on one thread without it.
#[test]
fn too_many_threads_are_refused() {
    let n = oomguard_cli::threads::MAX_THREADS as u64 + 1;
    let events: Vec<Event> = (0..n)
        .map(|t| Event::alloc(t, 512, 0).on_thread(t + 1))
        .collect();
    let dir = common::scratch("threads-many");
    let file = dir.path().join("many.csv");
    std::fs::write(&file, csv_trace::write(&events)).unwrap();
    let file = file.to_str().unwrap();
    let o = oomguard(&["replay", file, "--threads"]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(err.contains(&format!("names {n} threads")), "{err}");
    let o = oomguard(&["replay", file]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    // the library refuses too, in the report
    let trace = Trace::new(TraceFormat::Csv, events);
    let opts = ReplayOptions {
        threads: true,
        ..ReplayOptions::default()
    };
    let (r, _) = replay(&trace, &opts, &mut |_| {});
    assert!(!r.completed);
    assert_eq!(r.threads, 0);
    assert!(
        r.failures[0].message.contains("threads"),
        "{:?}",
        r.failures
    );
}

/// A thread counts as allocating only when it was handed memory: zero-byte allocations (which
/// allocate nothing) and frees from a second thread leave the allocator in one-thread mode.
#[test]
fn threads_that_only_free_or_allocate_nothing_are_not_allocating() {
    let events = vec![
        Event::alloc(0, 1 << 20, 0).on_thread(1),
        Event::alloc(1, 0, 0).on_thread(2),
        Event::free(0, 1 << 20, 0).on_thread(2),
        Event::free(1, 0, 0).on_thread(2),
        Event::alloc(2, 4096, 0).on_thread(1),
    ];
    let trace = Trace::new(TraceFormat::Csv, events);
    let opts = ReplayOptions {
        threads: true,
        ..ReplayOptions::default()
    };
    let (r, _) = replay(&trace, &opts, &mut |_| {});
    assert!(r.completed, "{:?}", r.failures);
    assert_eq!((r.threads, r.allocating_threads), (2, 1));
}
