//! The leak report of `#[leak_check]` names the user's function and where its check is, and
//! leaks that do not fail the function (`warn`, or found while panicking) are visible on
//! standard error when no `tracing` subscriber is installed (issue 15, point 16).

use oomguard::{leak_check, ByteSize, Device, DeviceBuffer, Error};

#[leak_check(action = error)]
fn leaky(dev: &Device, kept: &mut Vec<DeviceBuffer<u8>>) -> Result<(), Error> {
    kept.push(dev.alloc::<u8>(4096)?);
    Ok(())
}

#[test]
fn the_report_names_the_function_and_its_file() {
    let dev = Device::sim(ByteSize::mib(8));
    let mut kept = Vec::new();
    let Err(Error::Leak(report)) = leaky(&dev, &mut kept) else {
        panic!("a leak")
    };
    assert_eq!(report.function, Some("leaky"));
    assert_eq!(report.scope.file(), file!(), "not oomguard's own file");
    let text = report.to_string();
    assert!(text.contains("leak check of `leaky`"), "{text}");
    assert!(!text.contains("private.rs"), "{text}");
}

#[leak_check(action = warn)]
fn warn_leaky(dev: &Device, kept: &mut Vec<DeviceBuffer<u8>>) {
    kept.push(dev.alloc::<u8>(4096).unwrap());
}

#[leak_check]
fn panic_leaky(dev: &Device, kept: &mut Vec<DeviceBuffer<u8>>) {
    kept.push(dev.alloc::<u8>(4096).unwrap());
    panic!("the body fails");
}

/// Runs in a child process (no subscriber installed): the leaks of `warn_leaky` and
/// `panic_leaky`.
#[test]
fn child_leaks() {
    if std::env::var_os("OOMGUARD_LEAK_CHILD").is_none() {
        return;
    }
    let dev = Device::sim(ByteSize::mib(8));
    let mut kept = Vec::new();
    warn_leaky(&dev, &mut kept);
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        panic_leaky(&dev, &mut kept)
    }));
}

#[test]
fn warn_leaks_and_leaks_while_panicking_reach_stderr_without_a_subscriber() {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_leaks", "--nocapture", "--test-threads=1"])
        .env("OOMGUARD_LEAK_CHILD", "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("oomguard warning: leak check of `warn_leaky`"),
        "{stderr}"
    );
    assert!(
        stderr.contains("oomguard error: leak check of `panic_leaky`"),
        "{stderr}"
    );
}
