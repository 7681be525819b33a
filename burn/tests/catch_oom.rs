//! `catch_oom`: cubecl's out-of-memory panics become `Error::DevicePanic`, on the caller's
//! thread and, behind a bare `CallError`, on a device thread; every other panic continues.
//! One test function: the count of device out-of-memory panics is process-wide, so these
//! cases must not run in parallel with each other.
// `Err(..).unwrap()` on purpose: the panic message of `unwrap` is what cubecl raises.
#![allow(clippy::unnecessary_literal_unwrap)]

use std::panic;
use std::thread;

use cubecl_common::backtrace::BackTrace;
use cubecl_runtime::server::IoError;
use oomguard::IsOom;
use oomguard_burn::{catch_oom, oom_panics, Error};

/// cubecl-common's `CallError` (not reachable outside cubecl): the same derived `Debug`.
#[derive(Debug)]
struct CallError;

fn too_big() -> IoError {
    IoError::BufferTooBig {
        size: 1 << 36,
        backtrace: BackTrace::capture(),
    }
}

/// What cubecl's device thread does when `initialize_memory`'s reservation fails: it panics
/// (its runner catches the panic and drops the caller's reply channel).
fn device_thread_oom() {
    thread::spawn(|| {
        let _ = panic::catch_unwind(|| Err::<(), _>(too_big()).unwrap());
    })
    .join()
    .unwrap();
}

#[test]
fn panics_are_classified_and_others_continue() {
    // On the caller's thread: an unwrap of cubecl's out-of-memory.
    let e = catch_oom(|| -> Result<(), Error> { Err::<Result<(), Error>, _>(too_big()).unwrap() })
        .unwrap_err();
    assert!(matches!(e, Error::DevicePanic { .. }) && e.is_oom(), "{e}");
    assert!(
        e.to_string().contains("can't allocate buffer of size"),
        "{e}"
    );

    // A bare CallError after a device thread's out-of-memory panic: an out-of-memory.
    let before = oom_panics();
    let e = catch_oom(|| -> Result<(), Error> {
        device_thread_oom();
        Err::<Result<(), Error>, _>(CallError).unwrap()
    })
    .unwrap_err();
    assert!(e.is_oom(), "{e}");
    assert!(oom_panics() > before);

    // A closure that returned Ok while a device thread's reservation failed: its results are
    // not trusted.
    let e = catch_oom(|| -> Result<u32, Error> {
        device_thread_oom();
        Ok(7)
    })
    .unwrap_err();
    assert!(e.is_oom(), "{e}");

    // A CallError with no out-of-memory behind it is not ours: the panic continues.
    let r = panic::catch_unwind(|| {
        catch_oom(|| -> Result<(), Error> { Err::<Result<(), Error>, _>(CallError).unwrap() })
    });
    assert!(r.is_err(), "a CallError without a device OOM was caught");
    // Nor is any other panic.
    let r = panic::catch_unwind(|| {
        catch_oom(|| -> Result<(), Error> { panic!("index out of bounds") })
    });
    assert!(r.is_err());

    // An out-of-memory panic on another thread that is itself inside catch_oom is that call's
    // own: it does not fail this closure (two loops, or parallel tests, in one process).
    let before = oom_panics();
    let r = catch_oom(|| -> Result<u32, Error> {
        let other = thread::spawn(|| {
            catch_oom(|| -> Result<(), Error> { Err::<Result<(), Error>, _>(too_big()).unwrap() })
        })
        .join()
        .unwrap();
        assert!(other.unwrap_err().is_oom());
        Ok(7)
    });
    assert_eq!(r.unwrap(), 7);
    assert_eq!(
        oom_panics(),
        before,
        "a panic caught by its own catch_oom is not counted"
    );

    // The closure's own result and errors pass through.
    assert_eq!(catch_oom(|| Ok::<_, Error>(3)).unwrap(), 3);
    let e = catch_oom(|| -> Result<(), Error> { Err(Error::Rows("short".into())) }).unwrap_err();
    assert!(matches!(e, Error::Rows(_)) && !e.is_oom());
}
