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
