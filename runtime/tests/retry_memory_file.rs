//! The plan file with several writers (threads or processes): merged under a lock, never
//! losing another writer's plans; unreadable or unwritable files are reported (issue 15,
//! point 7).

use oomguard_runtime::retry::{DeviceKey, Limits, MemoryKey, PlanMemory, StepMode};

fn key(site: &str) -> MemoryKey {
    MemoryKey {
        site: site.into(),
        device: DeviceKey {
            name: "sim".into(),
            ordinal: 0,
            total_bytes: 1 << 30,
        },
        mode: StepMode::Train,
    }
}

fn limits(m: usize) -> Limits {
    Limits {
        micro_batch: Some(m),
        batch: None,
    }
}

/// A plan file path in a temporary directory of its own, removed (with the plan's lock and
/// anything else left there) when the directory drops, so a failed or interrupted test leaves
/// nothing behind.
fn temp(name: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::Builder::new()
        .prefix(&format!("oomguard-{name}-"))
        .tempdir()
        .unwrap();
    let path = dir.path().join("plans.json");
    (dir, path)
}

#[test]
fn two_writers_keep_each_others_plans() {
    let (_dir, path) = temp("two-writers");
    let mut a = PlanMemory::open(&path).unwrap();
    let mut b = PlanMemory::open(&path).unwrap();
    a.set_limits(&key("a.rs:1 a"), limits(4)).unwrap();
    b.set_limits(&key("b.rs:1 b"), limits(8)).unwrap();
    a.set_limits(&key("a.rs:2 a2"), limits(2)).unwrap();
    let read = PlanMemory::open(&path).unwrap();
    assert_eq!(read.len(), 3, "{:?}", read.iter().collect::<Vec<_>>());
    assert_eq!(read.limits(&key("b.rs:1 b")), limits(8));
    assert_eq!(read.limits(&key("a.rs:2 a2")), limits(2));
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn many_threads_writing_lose_nothing() {
    let (_dir, path) = temp("threads");
    std::thread::scope(|s| {
        for t in 0..8 {
            let path = &path;
            s.spawn(move || {
                let mut m = PlanMemory::open(path).unwrap();
                for i in 0..20 {
                    m.set_limits(&key(&format!("t{t}.rs:{i} f")), limits(i + 1))
                        .unwrap();
                }
            });
        }
    });
    let read = PlanMemory::open(&path).unwrap();
    assert_eq!(read.len(), 160);
    let leftovers: Vec<_> = std::fs::read_dir(std::env::temp_dir())
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&format!("oomguard-threads-{}", std::process::id())))
        .filter(|n| n.ends_with(".tmp") || n.ends_with(".lock"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn clear_empties_the_file() {
    let (_dir, path) = temp("clear");
    let mut a = PlanMemory::open(&path).unwrap();
    a.set_limits(&key("a.rs:1 a"), limits(4)).unwrap();
    a.clear().unwrap();
    assert!(PlanMemory::open(&path).unwrap().is_empty());
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn an_unreadable_or_unwritable_file_is_reported() {
    let (_dir, path) = temp("corrupt");
    std::fs::write(&path, "{not json").unwrap();
    let m = PlanMemory::open_or_in_memory(&path);
    assert!(m.path().is_none(), "in memory only");
    assert!(
        m.error().unwrap().contains("is not valid"),
        "{:?}",
        m.error()
    );
    std::fs::remove_file(&path).unwrap();

    let nowhere = std::env::temp_dir()
        .join(format!("oomguard-no-such-dir-{}", std::process::id()))
        .join("plans.json");
    let mut m = PlanMemory::open(&nowhere).unwrap();
    let e = m.set_limits(&key("a.rs:1 a"), limits(4)).unwrap_err();
    assert!(m.error().is_some(), "{e}");
    assert_eq!(
        m.limits(&key("a.rs:1 a")),
        limits(4),
        "still remembered in memory"
    );
}

/// Writers that die holding the lock (issue 26, point 9). Each round starts with a stale lock
/// (older than `STALE_LOCK`) and 16 writers released at once; meanwhile an injector creates
/// the lock file as a writer would (exclusively, only when it is free) and never removes it,
/// again and again. Every stale lock must be taken over by exactly one writer: when two both
/// removed it, one deleted the other's fresh lock, both saved at once and plans were lost (on
/// old main, at a normal machine load: plans lost in 3 of 3 runs). The race is one of timing;
/// the unit test `a_stale_lock_is_taken_over_by_exactly_one_writer` in `retry/memory/tests.rs`
/// forces it.
#[test]
fn stale_locks_are_taken_over_by_one_writer_and_nothing_is_lost() {
    use oomguard_runtime::retry::STALE_LOCK;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let (_dir, path) = temp("stale-lock");
    let lock = path.with_extension("json.lock");
    let stale = |f: std::fs::File| {
        std::io::Write::write_all(&mut &f, b"a writer that died").unwrap();
        f.set_modified(std::time::SystemTime::now() - STALE_LOCK * 4)
            .unwrap();
    };
    let (writers, saves) = (16, 3);
    let injected = AtomicUsize::new(0);
    for round in 0..20 {
        let _ = std::fs::remove_file(&path);
        stale(std::fs::File::create(&lock).unwrap());
        let done = AtomicBool::new(false);
        let start = std::sync::Barrier::new(writers);
        std::thread::scope(|s| {
            s.spawn(|| {
                while !done.load(Ordering::Relaxed) {
                    // a writer that takes the lock and dies at once
                    if let Ok(f) = std::fs::OpenOptions::new()
                        .write(true)
                        .create_new(true)
                        .open(&lock)
                    {
                        stale(f);
                        injected.fetch_add(1, Ordering::Relaxed);
                    }
                    std::thread::sleep(std::time::Duration::from_micros(300));
                }
            });
            let handles: Vec<_> = (0..writers)
                .map(|t| {
                    let (path, start) = (&path, &start);
                    s.spawn(move || {
                        let mut m = PlanMemory::open(path).unwrap();
                        start.wait();
                        for i in 0..saves {
                            m.set_limits(&key(&format!("t{t}.rs:{i} f")), limits(i + 1))
                                .unwrap();
                        }
                    })
                })
                .collect();
            for h in handles {
                h.join().unwrap();
            }
            done.store(true, Ordering::Relaxed);
        });
        let read = PlanMemory::open(&path).unwrap();
        assert_eq!(
            read.len(),
            writers * saves,
            "round {round}: plans lost ({} stale locks injected so far)",
            injected.load(Ordering::Relaxed)
        );
    }
    println!(
        "20 rounds, {} stale locks injected besides the 20 at the start: no plan lost",
        injected.load(Ordering::Relaxed)
    );
    let _ = std::fs::remove_file(&lock); // the injector's last one
    let leftovers: Vec<_> = std::fs::read_dir(std::env::temp_dir())
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&format!("oomguard-stale-lock-{}", std::process::id())))
        .filter(|n| !n.ends_with(".json"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    std::fs::remove_file(&path).unwrap();
}
