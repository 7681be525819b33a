//! `Device::sim` with an invalid `OOMGUARD_ALLOC_CONF` and no `tracing` subscriber says so on
//! standard error, once (it cannot return the error; `Device::try_sim` does). Runs itself as a
//! child process, so that the variable is set for that process only.

use std::process::Command;

use oomguard_runtime::{ByteSize, Device};

const CHILD: &str = "OOMGUARD_TEST_SIM_BAD_ENV_CHILD";

#[test]
fn a_bad_alloc_conf_is_said_on_stderr_once_without_a_subscriber() {
    if std::env::var_os(CHILD).is_some() {
        // the child: two devices, one message
        let a = Device::sim(ByteSize::mib(1));
        let b = Device::sim(ByteSize::mib(1));
        assert!(Device::try_sim(ByteSize::mib(1)).is_err());
        drop((a, b));
        return;
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_bad_alloc_conf_is_said_on_stderr_once_without_a_subscriber",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .env("OOMGUARD_ALLOC_CONF", "expandable_segments:Flase")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(
        stderr.matches("ignoring OOMGUARD_ALLOC_CONF").count(),
        1,
        "{stderr}"
    );
    assert!(stderr.contains("expandable_segments"), "{stderr}");
}

/// PyTorch's keys that have no effect here are accepted with a warning; with no `tracing`
/// subscriber it is said on standard error, once for the process however many devices read
/// the variable (before: only through `tracing`, so nothing was printed).
#[test]
fn an_ignored_key_is_said_on_stderr_once_without_a_subscriber() {
    const IGNORED_CHILD: &str = "OOMGUARD_TEST_SIM_IGNORED_KEY_CHILD";
    if std::env::var_os(IGNORED_CHILD).is_some() {
        let a = Device::sim(ByteSize::mib(4));
        let b = Device::try_sim(ByteSize::mib(4)).unwrap();
        a.alloc::<u8>(1000).unwrap();
        drop((a, b));
        return;
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "an_ignored_key_is_said_on_stderr_once_without_a_subscriber",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(IGNORED_CHILD, "1")
        .env("OOMGUARD_ALLOC_CONF", "release_lock_on_cudamalloc:True")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(stderr.matches("oomguard warning:").count(), 1, "{stderr}");
    assert!(stderr.contains("release_lock_on_cudamalloc"), "{stderr}");
}
