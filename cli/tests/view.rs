//! `oomguard view`: the page it writes, and the page in a real browser (headless Chromium).
//!
//! The browser check needs a `chromium` (Debian package) on PATH, or `OOMGUARD_CHROMIUM` naming
//! one. Without it the check says SKIPPED on stderr and passes, unless `OOMGUARD_REQUIRE_BROWSER`
//! is set (then a missing browser fails it). CI's machines have no Chromium, so there it skips.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use oomguard_cli::detect;
use oomguard_cli::replay::ReplayOptions;
use oomguard_cli::viewdata::ViewData;
use oomguard_runtime::{AllocatorConfig, ByteSize, Device};

fn oomguard(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_oomguard"))
        .args(args)
        .output()
        .expect("run oomguard")
}

fn real(name: &str) -> String {
    common::traces_dir().join(name).display().to_string()
}

#[test]
fn view_writes_one_self_contained_page() {
    let dir = common::scratch("view_page");
    let out = dir.path().join("oom.html");
    // resnet50 on 5.5 GiB with fixed segments: out of memory (its smallest card is ~5.6 GiB).
    let o = oomguard(&[
        "view",
        &real("resnet50.trace.csv"),
        "-o",
        &out.display().to_string(),
        "--capacity",
        "5.5GiB",
        "--config",
        "expandable_segments:False",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("failed allocations"), "{err}");
    let page = std::fs::read_to_string(&out).unwrap();
    assert!(page.starts_with("<!DOCTYPE html>"));
    // Nothing fetched: no URLs, no external scripts, styles or images.
    for bad in ["http://", "https://", "<link", " src=", "@import", "url("] {
        assert!(!page.contains(bad), "the page contains {bad:?}");
    }
    assert!(page.contains("<canvas id=\"timeline\""));
    assert!(page.contains("<canvas id=\"map\""));
    // The data names the failures (with the allocator's explanation) and the config.
    assert!(
        page.contains("largest free block"),
        "no OOM message in the data"
    );
    assert!(page.contains("expandable_segments:False"));
    // Without pressure: no failures, exit 0.
    let ok = dir.path().join("ok.html");
    let o = oomguard(&[
        "view",
        &real("gpt2.trace.csv"),
        "-o",
        &ok.display().to_string(),
    ]);
    assert_eq!(o.status.code(), Some(0));
    assert!(std::fs::read_to_string(&ok)
        .unwrap()
        .contains("\"failures\":[]"));
}

#[test]
fn snapshot_stack_frames_become_allocation_sites() {
    // A snapshot with frames, written by oomguard's own exporter in PyTorch's format.
    let dev = Device::sim(ByteSize::gib(1));
    dev.allocator().record_history(1000, true);
    let a = dev.alloc::<f32>(1 << 20).unwrap();
    let b = dev.alloc::<f32>(3 << 20).unwrap();
    drop(a);
    let pickle = dev.memory_snapshot().to_pytorch_pickle();
    drop(b);
    let dir = common::scratch("view_frames");
    let p = dir.path().join("frames.pickle");
    std::fs::write(&p, &pickle).unwrap();
    let t = detect::read_trace(&p).unwrap();
    assert_eq!(t.alloc_site.len(), 2, "{:?}", t.sites);
    assert!(
        t.sites.iter().all(|s| s.contains("view.rs:")),
        "{:?}",
        t.sites
    );
    let out = dir.path().join("frames.html");
    let o = oomguard(&[
        "view",
        &p.display().to_string(),
        "-o",
        &out.display().to_string(),
    ]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let page = std::fs::read_to_string(&out).unwrap();
    assert!(page.contains("\"sites\":[\""), "no sites in the page");
    assert!(page.contains("view.rs:"));
}

fn chromium() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("OOMGUARD_CHROMIUM") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    for dir in std::env::split_paths(&path) {
        for name in ["chromium", "chromium-browser", "google-chrome", "chrome"] {
            let c = dir.join(name);
            if c.is_file() {
                return Some(c);
            }
        }
    }
    None
}

/// The DOM after the page's script ran, from headless Chromium (killed after 90 s).
fn dump_dom(browser: &Path, page: &Path, hash: &str) -> String {
    let profile = common::scratch(&format!(
        "chromium-profile-{}",
        page.file_stem().unwrap().to_string_lossy()
    ));
    let mut child = Command::new(browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--window-size=1400,1100",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg("--dump-dom")
        .arg(format!("file://{}{hash}", page.display()))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start chromium");
    let mut out = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut out, &mut s);
        s
    });
    let start = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        // a hang guard only: a browser starting on a loaded machine may take long
        if start.elapsed() > Duration::from_secs(300) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("chromium did not finish with {}", page.display());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    reader.join().unwrap()
}

/// The attributes of the `<html>` element.
fn html_attrs(dom: &str) -> HashMap<String, String> {
    let start = dom.find("<html").expect("an <html> element");
    let end = start + dom[start..].find('>').unwrap();
    let mut attrs = HashMap::new();
    let tag = &dom[start + 5..end];
    for part in tag.split("\" ") {
        if let Some((k, v)) = part.trim().split_once("=\"") {
            attrs.insert(k.to_string(), v.trim_end_matches('"').to_string());
        }
    }
    attrs
}

#[test]
fn view_page_runs_in_headless_chromium_and_agrees_with_the_replay() {
    let Some(browser) = chromium() else {
        assert!(
            std::env::var_os("OOMGUARD_REQUIRE_BROWSER").is_none(),
            "OOMGUARD_REQUIRE_BROWSER is set but no chromium was found"
        );
        eprintln!("SKIPPED: no chromium on PATH (apt-get install chromium); the page was not run");
        return;
    };
    let dir = common::scratch("view_browser");
    let trace_path = real("resnet50.trace.csv");
    let trace = detect::read_trace(Path::new(&trace_path)).unwrap();
    for (name, capacity, config) in [
        ("oom", "5.5GiB", "expandable_segments:False"),
        ("peak", "80GiB", "expandable_segments:True"),
    ] {
        let out = dir.path().join(format!("{name}.html"));
        let o = oomguard(&[
            "view",
            &trace_path,
            "-o",
            &out.display().to_string(),
            "--capacity",
            capacity,
            "--config",
            config,
        ]);
        assert!(o.status.code() == Some(0) || o.status.code() == Some(1));
        let dom = dump_dom(&browser, &out, "#selftest");
        let attrs = html_attrs(&dom);
        assert_eq!(
            attrs.get("data-js-error"),
            None,
            "JavaScript error in {name}"
        );
        assert_eq!(
            attrs.get("data-ready").map(String::as_str),
            Some("1"),
            "{name}: {attrs:?}"
        );
        // The page opens on the first OOM (or the peak of live bytes) and its map there is the
        // one the Rust side computes (itself checked against the allocator in viewdata.rs).
        let opts = ReplayOptions {
            config: AllocatorConfig::parse(config).unwrap(),
            capacity: capacity.parse::<ByteSize>().unwrap().0,
            ..Default::default()
        };
        let data = ViewData::record(&trace, &opts);
        let t = match data.failures.first() {
            Some(f) => f.event,
            None => {
                assert_eq!(name, "peak");
                let mut live = 0u64;
                let mut peak = (0u64, 0u32);
                for (i, e) in trace.events.iter().enumerate() {
                    match e.op {
                        oomguard_cli::Op::Alloc => live += e.bytes,
                        oomguard_cli::Op::Free => live -= e.bytes,
                    }
                    if live > peak.0 {
                        peak = (live, i as u32);
                    }
                }
                peak.1
            }
        };
        if name == "oom" {
            assert!(!data.failures.is_empty());
        }
        let m = data.map_at(t);
        assert_eq!(attrs["data-selected"], t.to_string(), "{name}");
        assert_eq!(attrs["data-allocated"], m.allocated.to_string(), "{name}");
        assert_eq!(attrs["data-free"], m.free.to_string(), "{name}");
        assert_eq!(
            attrs["data-largest-free"],
            m.largest_free.map_or(0, |l| l.1).to_string(),
            "{name}"
        );
        // The facts panel says it in words.
        assert!(dom.contains("largest free range"), "{name}");
        if name == "oom" {
            assert!(dom.contains("failed here"), "{name}");
        }
        println!(
            "{name}: map computed in {} ms in the browser",
            attrs["data-map-ms"]
        );
    }
}
