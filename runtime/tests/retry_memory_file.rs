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

fn temp(name: &str) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("oomguard-{name}-{}.json", std::process::id()));
    let _ = std::fs::remove_file(&p);
    p
}

#[test]
fn two_writers_keep_each_others_plans() {
    let path = temp("two-writers");
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
    let path = temp("threads");
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
    let path = temp("clear");
    let mut a = PlanMemory::open(&path).unwrap();
    a.set_limits(&key("a.rs:1 a"), limits(4)).unwrap();
    a.clear().unwrap();
    assert!(PlanMemory::open(&path).unwrap().is_empty());
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn an_unreadable_or_unwritable_file_is_reported() {
    let path = temp("corrupt");
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

/// A lock file left by a writer that died (older than `STALE_LOCK`), then many writers at once
/// (issue 26, point 9): exactly one of them takes the stale lock over, so no save runs beside
/// another and no writer's plans are lost. Repeated, as the race is one of timing.
#[test]
fn a_stale_lock_is_taken_over_by_one_writer_and_nothing_is_lost() {
    use oomguard_runtime::retry::STALE_LOCK;
    let path = temp("stale-lock");
    let lock = path.with_extension("json.lock");
    for round in 0..40 {
        let _ = std::fs::remove_file(&path);
        let f = std::fs::File::create(&lock).unwrap();
        std::io::Write::write_all(&mut &f, b"a writer that died").unwrap();
        f.set_modified(std::time::SystemTime::now() - STALE_LOCK * 4)
            .unwrap();
        drop(f);
        let writers = 16;
        let start = std::sync::Barrier::new(writers);
        std::thread::scope(|s| {
            for t in 0..writers {
                let (path, start) = (&path, &start);
                s.spawn(move || {
                    let mut m = PlanMemory::open(path).unwrap();
                    start.wait();
                    for i in 0..3 {
                        m.set_limits(&key(&format!("r{round}t{t}.rs:{i} f")), limits(i + 1))
                            .unwrap();
                    }
                });
            }
        });
        let read = PlanMemory::open(&path).unwrap();
        assert_eq!(
            read.len(),
            writers * 3,
            "round {round}: plans lost: {:?}",
            read.iter().map(|(k, _)| k.site.clone()).collect::<Vec<_>>()
        );
        assert!(!lock.exists(), "round {round}: the lock is released");
    }
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
