use super::lock::{FileLock, STALE_HOOK};
use super::*;
use crate::retry_report::BatchPlan;
use std::time::Duration;

#[test]
fn limits_give_plans_and_grow_back() {
    let l = Limits::NONE;
    assert_eq!(l.plan_for(100), BatchPlan::whole(100).ok());
    let p = BatchPlan::new(100, 4).unwrap();
    let l = l.learned(&p, 100);
    assert_eq!(l.micro_batch, Some(25));
    assert_eq!(l.batch, None);
    assert_eq!(l.plan_for(100), Some(p));
    assert_eq!(l.plan_for(10), BatchPlan::whole(10).ok());
    let up = l.one_up(100).unwrap();
    assert_eq!(up.micro_batch, Some(50));
    assert_eq!(up.one_up(100).unwrap().micro_batch, None);
    assert_eq!(Limits::NONE.one_up(100), None);
    // a shrunk batch grows back first
    let shrunk = Limits::NONE.learned(&BatchPlan::with_micro_batch(20, 10).unwrap(), 100);
    assert_eq!(shrunk.batch, Some(20));
    assert_eq!(shrunk.micro_batch, Some(10));
    let up = shrunk.one_up(100).unwrap();
    assert_eq!((up.batch, up.micro_batch), (Some(40), Some(10)));
}

#[test]
fn bad_files_are_clear_errors() {
    let dir = std::env::temp_dir();
    let p = dir.join(format!("oomguard-memory-bad-{}.json", std::process::id()));
    std::fs::write(&p, "{not json").unwrap();
    let e = PlanMemory::open(&p).unwrap_err();
    assert!(e.to_string().contains("is not valid"), "{e}");
    std::fs::write(&p, r#"{"version": 99, "plans": []}"#).unwrap();
    let e = PlanMemory::open(&p).unwrap_err();
    assert!(e.to_string().contains("version 99"), "{e}");
    std::fs::remove_file(&p).unwrap();
}

/// Writers wait at a stale lock, all judge it stale before any of them acts (the hook), and
/// still exactly one holds the lock at any time; the lock of a live owner is never deleted.
#[test]
fn a_stale_lock_is_taken_over_by_exactly_one_writer() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let path = std::env::temp_dir().join(format!(
        "oomguard-memory-takeover-{}.json",
        std::process::id()
    ));
    let lock = path.with_extension("json.lock");
    // Every waiter judges the lock stale, then acts at a different time: some act after
    // another has already taken it over and made a fresh lock.
    *STALE_HOOK.lock().unwrap() = Some(|| {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed) as u64;
        std::thread::sleep(Duration::from_millis(5 + (n % 4) * 2));
    });
    let inside = AtomicUsize::new(0);
    let most = AtomicUsize::new(0);
    for _round in 0..5 {
        let f = std::fs::File::create(&lock).unwrap();
        std::io::Write::write_all(&mut &f, b"dead writer").unwrap();
        f.set_modified(std::time::SystemTime::now() - STALE_LOCK * 2)
            .unwrap();
        drop(f);
        let start = std::sync::Barrier::new(12);
        std::thread::scope(|s| {
            for _ in 0..12 {
                s.spawn(|| {
                    start.wait();
                    let held = FileLock::acquire(&path).unwrap();
                    let n = inside.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(n, Ordering::SeqCst);
                    std::thread::sleep(Duration::from_millis(10));
                    assert!(held.held(), "the lock was deleted from under its owner");
                    inside.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        assert!(!lock.exists());
    }
    *STALE_HOOK.lock().unwrap() = None;
    assert_eq!(
        most.load(Ordering::SeqCst),
        1,
        "two writers held the lock at once"
    );
}
