//! Fuzz targets for every trace reader (CSV, RMM log, PyTorch snapshot pickle, and format
//! detection), on the workspace's stable harness: corpora checked in under
//! `tests/fuzz_corpus/`, mutated for a bounded number of cases. A reader must return `Ok` or an
//! error naming the line or offset — never panic — and whatever it reads must replay through
//! the allocator without panicking, on threads of their own too where it names a few threads.

use std::path::Path;

use oomguard_cli::replay::{replay, ReplayOptions};
use oomguard_cli::{csv_trace, detect, rmm, snapshot, ReadError, Trace};

fn fuzz(target: &str, cases: usize, check: impl Fn(&[u8])) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fuzz_corpus")
        .join(target);
    oomguard_runtime::fuzzing::fuzz_test(&dir, cases, check);
}

/// Whatever parses replays (on a small device, so out-of-memory paths run too).
fn replays(r: Result<Trace, ReadError>) {
    match r {
        Ok(t) => {
            let opts = ReplayOptions {
                capacity: 256 << 20,
                ..ReplayOptions::default()
            };
            let (report, _) = replay(&t, &opts, &mut |_| {});
            assert_eq!(report.events, t.events.len());
            // a few recorded threads: replayed on threads of their own, the same live bytes
            let named = oomguard_cli::threads::thread_count(&t.events);
            if (2..=8).contains(&named) {
                let opts = ReplayOptions {
                    threads: true,
                    ..opts
                };
                let (threaded, _) = replay(&t, &opts, &mut |_| {});
                assert_eq!(threaded.events, t.events.len());
                assert_eq!(threaded.threads, named);
                assert_eq!(threaded.peak_live_bytes, report.peak_live_bytes);
            }
        }
        Err(e) => assert!(!e.to_string().is_empty()),
    }
}

#[test]
fn fuzz_csv_reader() {
    fuzz("csv", 20_000, |d| replays(csv_trace::parse(d)));
}

#[test]
fn fuzz_rmm_reader() {
    fuzz("rmm", 20_000, |d| replays(rmm::parse(d)));
}

#[test]
fn fuzz_snapshot_pickle_reader() {
    fuzz("pickle", 10_000, |d| replays(snapshot::parse(d)));
}

#[test]
fn fuzz_format_detection() {
    fuzz("csv", 1_000, |d| replays(detect::parse(d, None)));
    fuzz("pickle", 1_000, |d| {
        replays(detect::parse(d, Some(Path::new("x.pickle"))))
    });
}
