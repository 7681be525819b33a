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

fn key(site: &str) -> MemoryKey {
    MemoryKey::at(
        site.to_string(),
        &crate::Device::sim(crate::ByteSize::mib(64)),
        crate::retry::StepMode::Train,
    )
}

fn micro(m: usize) -> Limits {
    Limits {
        micro_batch: Some(m),
        batch: None,
    }
}

fn temp_file(name: &str) -> std::path::PathBuf {
    // the process id before the name: the lock is `<file>.lock`, one per process's file
    let p = std::env::temp_dir().join(format!("oomguard-memory-{}-{name}", std::process::id()));
    let _ = std::fs::remove_file(&p);
    p
}

/// Two writers of one file: an entry one of them only read never overwrites the other's newer
/// lesson (it wrote back every entry it held, and a cap known to fail came back).
#[test]
fn an_entry_only_read_does_not_overwrite_a_newer_one() {
    let p = temp_file("lost-update.json");
    let (s, t) = (key("s"), key("t"));
    PlanMemory::open(&p)
        .unwrap()
        .set_limits(&s, micro(50))
        .unwrap();
    let mut a = PlanMemory::open(&p).unwrap();
    let mut b = PlanMemory::open(&p).unwrap();
    b.set_limits(&s, micro(25)).unwrap();
    a.set_limits(&t, micro(10)).unwrap();
    let file = PlanMemory::open(&p).unwrap();
    assert_eq!(file.limits(&s), micro(25), "B's lesson kept");
    assert_eq!(file.limits(&t), micro(10), "A's own saved");
    // what A changed itself still wins over the file
    a.set_limits(&s, micro(12)).unwrap();
    assert_eq!(PlanMemory::open(&p).unwrap().limits(&s), micro(12));
    std::fs::remove_file(&p).unwrap();
}

/// A file that another oomguard rewrote in a format this one cannot read is not replaced by
/// the next save (it was, with this memory's plans alone, and only a trace warning said so).
#[test]
fn a_file_of_another_version_is_not_replaced() {
    let p = temp_file("other-version.json");
    let mut a = PlanMemory::open(&p).unwrap();
    let theirs = r#"{"version":2,"plans":[{"anything":1}]}"#;
    std::fs::write(&p, theirs).unwrap();
    let e = a.set_limits(&key("s"), micro(8)).unwrap_err();
    assert!(e.to_string().contains("not replaced"), "{e}");
    assert!(a.error().unwrap().contains("version 2"), "{:?}", a.error());
    assert_eq!(std::fs::read_to_string(&p).unwrap(), theirs);
    std::fs::remove_file(&p).unwrap();
}

/// A symbolic link is written through: its target gets the plans, the link stays a link (the
/// rename replaced the link with a file, and the shared target never saw a plan).
#[cfg(unix)]
#[test]
fn a_symbolic_link_is_written_through() {
    let real = temp_file("link-target.json");
    let link = temp_file("link.json");
    std::fs::write(&real, r#"{"version":1,"plans":[]}"#).unwrap();
    std::os::unix::fs::symlink(&real, &link).unwrap();
    let mut m = PlanMemory::open(&link).unwrap();
    m.set_limits(&key("s"), micro(8)).unwrap();
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(PlanMemory::open(&real).unwrap().limits(&key("s")), micro(8));
    std::fs::remove_file(&link).unwrap();
    std::fs::remove_file(&real).unwrap();
}

/// A read-only file is not replaced (even by root, who may write it): the save fails and says
/// so; the file keeps its plans and its mode.
#[test]
fn a_read_only_file_is_not_replaced() {
    let p = temp_file("read-only.json");
    PlanMemory::open(&p)
        .unwrap()
        .set_limits(&key("s"), micro(50))
        .unwrap();
    let before = std::fs::read_to_string(&p).unwrap();
    let mut perm = std::fs::metadata(&p).unwrap().permissions();
    perm.set_readonly(true);
    std::fs::set_permissions(&p, perm.clone()).unwrap();
    let mut m = PlanMemory::open(&p).unwrap();
    let e = m.set_limits(&key("s"), micro(25)).unwrap_err();
    assert!(e.to_string().contains("read-only: not replaced"), "{e}");
    assert_eq!(std::fs::read_to_string(&p).unwrap(), before);
    assert!(std::fs::metadata(&p).unwrap().permissions().readonly());
    #[allow(clippy::permissions_set_readonly_false)]
    perm.set_readonly(false);
    std::fs::set_permissions(&p, perm).unwrap();
    std::fs::remove_file(&p).unwrap();
}

/// A FIFO as the plan file is refused at once (reading it blocked until a writer came).
#[cfg(unix)]
#[test]
fn a_fifo_is_not_read() {
    let p = temp_file("fifo.json");
    let made = std::process::Command::new("mkfifo").arg(&p).status();
    if !made.is_ok_and(|s| s.success()) {
        eprintln!("mkfifo is not available: skipped");
        return;
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let path = p.clone();
    std::thread::spawn(move || {
        let _ = tx.send(
            PlanMemory::open(&path)
                .map(|_| ())
                .map_err(|e| e.to_string()),
        );
    });
    let got = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("open returns instead of blocking on the FIFO");
    let e = got.unwrap_err();
    assert!(e.contains("not a regular file"), "{e}");
    // a FIFO put where the file was after it was read: the save refuses it too
    let q = temp_file("fifo-later.json");
    let mut m = PlanMemory::open(&q).unwrap();
    assert!(std::process::Command::new("mkfifo")
        .arg(&q)
        .status()
        .unwrap()
        .success());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(m.set_limits(&key("s"), micro(8)).map_err(|e| e.to_string()));
    });
    let got = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the save returns instead of blocking on the FIFO");
    assert!(got.unwrap_err().contains("not a regular file"));
    std::fs::remove_file(&q).unwrap();
    std::fs::remove_file(&p).unwrap();
}

/// The lock of a writer of this machine whose process is gone (killed while it held the lock:
/// the out-of-memory killer's `SIGKILL`) is taken over at once; each save waited 5 s and failed
/// until the lock was 30 s old.
#[cfg(target_os = "linux")]
#[test]
fn the_lock_of_a_dead_process_is_taken_over_at_once() {
    let Some(host) = super::lock::host_id() else {
        eprintln!("no host name: skipped");
        return;
    };
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let p = temp_file("dead-writer.json");
    let lock = p.with_extension("json.lock");
    std::fs::write(&lock, format!("{dead}-0-1@{host}")).unwrap();
    let started = std::time::Instant::now();
    let mut m = PlanMemory::open(&p).unwrap();
    m.set_limits(&key("s"), micro(8)).unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "waited {:?}",
        started.elapsed()
    );
    assert!(!lock.exists(), "released");
    // a live writer's lock (this process's own token format, another live pid) is waited for
    let live = std::process::id();
    std::fs::write(&lock, format!("{live}-0-1@{host}")).unwrap();
    let e = m.set_limits(&key("s"), micro(4)).unwrap_err();
    assert!(e.to_string().contains("held by another writer"), "{e}");
    std::fs::remove_file(&lock).unwrap();
    std::fs::remove_file(&p).unwrap();
}

/// The lock is `<file>.lock`, as documented: it replaced the file's own extension, so two plan
/// files `plans.v1` and `plans.v2` shared `plans.json.lock` (one writer of each waited 5 s for
/// the other and failed).
#[test]
fn plan_files_that_differ_in_extension_have_their_own_locks() {
    let base = std::env::temp_dir().join(format!("oomguard-memory-{}-ext", std::process::id()));
    let v1 = base.with_extension("v1");
    let v2 = base.with_extension("v2");
    let held = FileLock::acquire(&v1).unwrap();
    let started = std::time::Instant::now();
    let other = FileLock::acquire(&v2).expect("another file's lock is free");
    assert!(started.elapsed() < Duration::from_secs(2));
    assert!(held.held() && other.held());
    assert!(std::path::Path::new(&format!("{}.lock", v1.display())).exists());
}
