//! The `oomguard` binary on real traces and on bad input.

mod common;

use std::path::Path;
use std::process::{Command, Output};

fn oomguard(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_oomguard"))
        .args(args)
        .output()
        .expect("run oomguard")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}
fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn trace(name: &str) -> String {
    common::traces_dir().join(name).display().to_string()
}

/// A trace committed under the repository's `traces/`.
fn repo_trace(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../traces")
        .join(name)
        .display()
        .to_string()
}

fn json(o: &Output) -> serde_json::Value {
    serde_json::from_str(stdout(o).trim()).unwrap_or_else(|e| panic!("{e}: {}", stdout(o)))
}

/// A one-line error, no panic, the given exit status.
fn assert_error(o: &Output, code: i32, needle: &str) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(code), "stderr: {err}");
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    assert!(err.starts_with("oomguard: "), "{err}");
    assert!(err.contains(needle), "want {needle:?} in {err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// Every shared trace replays; its growable segments reserve at most what PyTorch's expandable
/// segments reserved on the H100 for the same run (`pytorch_figures.json`). vit_b16 held
/// 1.0413 × its peak live bytes before free blocks at the edge of unmapped space were ranked as
/// PyTorch ranks them (PyTorch: 1.0206 ×).
#[test]
fn replay_json_on_every_real_trace() {
    let figs = common::figures();
    for (name, f) in figs["traces"].as_object().unwrap() {
        for file in [format!("{name}.trace.csv")]
            .into_iter()
            .chain((name == "resnet50").then(|| "resnet50.snapshot.pickle".to_string()))
        {
            let o = oomguard(&[
                "replay",
                &trace(&file),
                "--config",
                "expandable_segments:True",
                "--json",
            ]);
            assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
            let v = json(&o);
            let live = f["peak_live_bytes"].as_u64().unwrap();
            assert_eq!(v["peak_live_bytes"].as_u64(), Some(live), "{file}");
            assert_eq!(v["events"].as_u64(), f["trace_events"].as_u64(), "{file}");
            let reserved = v["peak_reserved_bytes"].as_u64().unwrap();
            assert!(reserved >= live, "{file}");
            let pytorch = f["pytorch_expandable_segments"]["peak_reserved"]
                .as_u64()
                .unwrap();
            assert!(
                reserved <= pytorch,
                "{file}: {reserved} > PyTorch's {pytorch}"
            );
            let ratio = v["ratio"].as_f64().unwrap();
            assert!((ratio - reserved as f64 / live as f64).abs() < 1e-9);
            // Growable segments map pages; no fixed segments.
            assert_eq!(v["backend_calls"]["alloc_segment"].as_u64(), Some(0));
            assert!(v["backend_calls"]["map"].as_u64().unwrap() > 0);
            // Every mapped page holds at least the peak reserved (nothing is unmapped below it
            // without being mapped first), and what was unmapped was mapped before.
            let mapped = v["backend_calls"]["mapped_bytes"].as_u64().unwrap();
            let unmapped = v["backend_calls"]["unmapped_bytes"].as_u64().unwrap();
            assert!(mapped >= reserved, "{file}: {mapped} < {reserved}");
            assert!(unmapped <= mapped, "{file}");
            assert_eq!(v["num_ooms"].as_u64(), Some(0));
            assert_eq!(v["completed"].as_bool(), Some(true));
        }
    }
}

/// Every trace committed under `traces/` (CSV and snapshot) runs on a card of at most 1.02 × its
/// peak live bytes with the default configuration (`mincap`), or on the fewest 2 MiB pages that
/// hold its peak live bytes where 1.02 × is less than that: no allocator that maps 2 MiB pages
/// can do better. Only `tch_step.snapshot.pickle` (66.36 MiB live at its peak: 34 pages, 68 MiB,
/// 1.0248 ×) is at that floor.
#[test]
fn every_committed_trace_runs_within_1_02_of_peak_live_or_on_its_fewest_pages() {
    const PAGE: u64 = 2 << 20;
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../traces");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".trace.csv") || n.ends_with(".snapshot.pickle"))
        .collect();
    names.sort();
    assert!(names.len() >= 11, "{names:?}");
    let mut at_the_floor = Vec::new();
    for name in &names {
        let m = oomguard(&["mincap", &repo_trace(name), "--json"]);
        assert_eq!(m.status.code(), Some(0), "{name}: {}", stderr(&m));
        let v = json(&m);
        let live = v["peak_live_bytes"].as_u64().unwrap();
        let min = v["min_capacity_bytes"].as_u64().unwrap();
        let pages = live.div_ceil(PAGE) * PAGE;
        let bound = ((live as f64 * 1.02) as u64).max(pages);
        assert!(min <= bound, "{name}: {min} B > {bound} B ({v})");
        assert!(min >= live, "{name}: {v}");
        if min as f64 > live as f64 * 1.02 {
            at_the_floor.push(name.as_str());
            assert_eq!(min, pages, "{name}: over 1.02 × and not at its page floor");
        }
    }
    assert_eq!(at_the_floor, ["tch_step.snapshot.pickle"]);
}

/// VGG-16's first five steps at 128 rows (recorded under oomguard on the H200, run 76), each
/// marked as `train_step` marks it, on the H200's capacity: the first two steps set the peak
/// reserved, 1.3032 × peak live before free blocks at the edge of unmapped space ranked as
/// PyTorch ranks them; a model of PyTorch's allocator gives 1.1266 × (docs/BENCHMARKS.md).
#[test]
fn vgg_first_steps_with_room_reserve_what_expandable_segments_would() {
    let o = oomguard(&[
        "replay",
        &repo_trace("tch_vgg16_b128_first.trace.csv"),
        "--capacity",
        "139.8GiB",
        "--steps",
        "5",
        "--json",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let ratio = json(&o)["ratio"].as_f64().unwrap();
    assert!(ratio <= 1.13, "peak reserved {ratio} x peak live");
}

#[test]
fn replay_table_and_oom_exit_status() {
    let o = oomguard(&["replay", &trace("resnet50.trace.csv")]);
    assert_eq!(o.status.code(), Some(0));
    let out = stdout(&o);
    assert!(
        out.contains("peak live        5.43 GiB (5830299792 bytes)"),
        "{out}"
    );
    assert!(out.contains("ratio"));
    assert!(out.contains("remapped         "), "{out}");
    assert!(out.contains("device synchronisations"), "{out}");
    // 4 GiB cannot hold 5.43 GiB live: out-of-memory, exit 1, failures listed.
    let o = oomguard(&[
        "replay",
        &trace("resnet50.trace.csv"),
        "--capacity",
        "4GiB",
        "--json",
    ]);
    assert_eq!(o.status.code(), Some(1));
    let v = json(&o);
    assert_eq!(v["completed"].as_bool(), Some(false));
    assert!(v["num_ooms"].as_u64().unwrap() >= 1);
    let f = &v["failures"][0];
    assert!(f["message"].as_str().unwrap().contains("out of memory"));
    assert!(f["index"].as_u64().is_some());
}

#[test]
fn compare_prints_one_row_per_config() {
    let o = oomguard(&[
        "compare",
        &trace("vit_b16.trace.csv"),
        "--config",
        "expandable_segments:False",
        "--config",
        "expandable_segments:True",
        "--config",
        "expandable_segments:False,max_split_size_mb:64",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    assert_eq!(out.lines().count(), 5, "{out}");
    assert!(out.contains("max_split_size_mb:64"));
    let o = oomguard(&["compare", &trace("gpt2.trace.csv"), "--json"]);
    let v = json(&o);
    let rows = v.as_array().unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0]["config"], "expandable_segments:False");
    assert!(rows[0]["backend_calls"]["alloc_segment"].as_u64().unwrap() > 0);
}

#[test]
fn plot_writes_self_contained_svg_and_html() {
    let dir = common::scratch("plot");
    for ext in ["svg", "html"] {
        let out = dir.path().join(format!("resnet.{ext}"));
        let o = oomguard(&[
            "plot",
            &trace("resnet50.snapshot.pickle"),
            "-o",
            &out.display().to_string(),
            "--config",
            "expandable_segments:False",
        ]);
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        let body = std::fs::read_to_string(&out).unwrap();
        assert!(body.contains("<svg"));
        assert!(body.contains("polyline"));
        assert!(body.contains("segments at peak live"));
        assert!(!body.contains("<script"));
        assert!(!body.contains("https://"), "no network references");
        if ext == "html" {
            assert!(body.starts_with("<!DOCTYPE html>"));
        }
    }
    let o = oomguard(&[
        "plot",
        &trace("resnet50.trace.csv"),
        "-o",
        &dir.path().join("x.png").display().to_string(),
    ]);
    assert_error(&o, 2, "must end in .svg or .html");
}

#[test]
fn gen_then_mincap_on_a_small_trace() {
    let dir = common::scratch("mincap");
    let file = dir.path().join("tiny.trace.csv");
    let f = file.display().to_string();
    let o = oomguard(&["gen", "training", "--tiny", "--seed", "3", "-o", &f]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let o = oomguard(&[
        "mincap",
        &f,
        "--config",
        "expandable_segments:False",
        "--json",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v = json(&o);
    let min = v["min_capacity_bytes"].as_u64().unwrap();
    let live = v["peak_live_bytes"].as_u64().unwrap();
    assert!(min >= live);
    assert!((v["ratio"].as_f64().unwrap() - min as f64 / live as f64).abs() < 1e-9);
    // It completes at the minimum and fails 0.2% below it.
    let ok = oomguard(&[
        "replay",
        &f,
        "--config",
        "expandable_segments:False",
        "--capacity",
        &min.to_string(),
    ]);
    assert_eq!(ok.status.code(), Some(0), "{}", stdout(&ok));
    let below = (min as f64 * 0.998) as u64;
    let bad = oomguard(&[
        "replay",
        &f,
        "--config",
        "expandable_segments:False",
        "--capacity",
        &below.to_string(),
    ]);
    assert_eq!(bad.status.code(), Some(1));
}

#[test]
fn bad_input_is_one_line_and_status_2() {
    let dir = common::scratch("bad");
    let write = |name: &str, data: &[u8]| {
        let p = dir.path().join(name);
        std::fs::write(&p, data).unwrap();
        p.display().to_string()
    };
    let empty = write("empty.csv", b"");
    assert_error(&oomguard(&["replay", &empty]), 2, "empty file");
    let header = write("header.csv", b"op,id,bytes,stream\n");
    assert_error(&oomguard(&["replay", &header]), 2, "no allocation events");
    let badop = write("badop.csv", b"op,id,bytes,stream\na,1,10,0\nx,2,10,0\n");
    assert_error(&oomguard(&["replay", &badop]), 2, "line 3: unknown op");
    let unknown = write("unk.csv", b"op,id,bytes,stream\nf,1,10,0\n");
    assert_error(&oomguard(&["mincap", &unknown]), 2, "line 2: free of id 1");
    let dup = write("dup.csv", b"op,id,bytes,stream\na,1,10,0\na,1,10,0\n");
    assert_error(
        &oomguard(&["compare", &dup]),
        2,
        "line 3: duplicate allocation id 1",
    );
    let fmt = write("what.txt", b"hello\n");
    assert_error(&oomguard(&["replay", &fmt]), 2, "unknown trace format");
    let data = std::fs::read(trace("resnet50.snapshot.pickle")).unwrap();
    let cut = write("cut.pickle", &data[..data.len() / 2]);
    assert_error(&oomguard(&["replay", &cut]), 2, "pickle byte offset");
    let missing = dir.path().join("nope.csv").display().to_string();
    assert_error(&oomguard(&["replay", &missing]), 2, "nope.csv");
    let real = trace("resnet50.trace.csv");
    assert_error(
        &oomguard(&["replay", &real, "--capacity", "12 furlongs"]),
        2,
        "invalid byte size",
    );
    assert_error(
        &oomguard(&["replay", &real, "--config", "expandible_segments:True"]),
        2,
        "unknown key",
    );
    assert_error(&oomguard(&["replay"]), 2, "required");
    assert_error(&oomguard(&["frobnicate"]), 2, "unrecognized subcommand");
}

#[test]
fn huge_sizes_fail_the_replay_without_panicking() {
    let dir = common::scratch("huge");
    let p = dir.path().join("huge.csv");
    std::fs::write(
        &p,
        format!(
            "op,id,bytes,stream\na,1,{},0\nf,1,0,0\na,2,512,0\n",
            u64::MAX
        ),
    )
    .unwrap();
    let o = oomguard(&["replay", &p.display().to_string(), "--json"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let v = json(&o);
    assert_eq!(v["failures"].as_array().unwrap().len(), 1);
    assert_eq!(v["events"].as_u64(), Some(3));
    assert!(Path::new(&p).exists());
}

#[test]
fn rmm_log_replays_and_help_works() {
    let dir = common::scratch("rmm");
    let p = dir.path().join("rmm_log.csv");
    std::fs::write(
        &p,
        "Thread,Time,Action,Pointer,Size,Stream\n\
         1,10:31:27:589049,allocate,0x7f0000000000,33554432,0x0\n\
         1,10:31:27:589050,allocate,0x7f0002000000,1048576,0x7f00aa\n\
         1,10:31:27:589051,allocate failure,0x0,999999999999,0x0\n\
         1,10:31:27:589052,free,0x7f0000000000,33554432,0x0\n\
         1,10:31:27:589053,free,0x7f0002000000,1048576,0x7f00aa\n",
    )
    .unwrap();
    let o = oomguard(&["replay", &p.display().to_string(), "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v = json(&o);
    assert_eq!(v["format"], "rmm-log");
    assert_eq!(v["events"].as_u64(), Some(4));
    assert_eq!(v["peak_live_bytes"].as_u64(), Some(33554432 + 1048576));
    assert!(v["notes"][0]
        .as_str()
        .unwrap()
        .contains("1 failed allocations"));
    let o = oomguard(&["--help"]);
    assert_eq!(o.status.code(), Some(0));
    for sub in ["replay", "compare", "plot", "mincap", "gen"] {
        assert!(stdout(&o).contains(sub), "{sub}");
    }
}

fn oomguard_with_conf(conf: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_oomguard"))
        .args(args)
        .env("OOMGUARD_ALLOC_CONF", conf)
        .output()
        .expect("run oomguard")
}

#[test]
fn the_allocator_config_comes_from_the_environment_unless_given() {
    let t = trace("vit_b16.trace.csv");
    let reserved = |o: &Output| {
        assert_eq!(o.status.code(), Some(0), "{}", stderr(o));
        json(o)["peak_reserved_bytes"].as_u64().unwrap()
    };
    let plain = Command::new(env!("CARGO_BIN_EXE_oomguard"))
        .args(["replay", &t, "--json"])
        .env_remove("OOMGUARD_ALLOC_CONF")
        .output()
        .unwrap();
    let fixed = oomguard_with_conf("expandable_segments:False", &["replay", &t, "--json"]);
    assert_ne!(
        reserved(&plain),
        reserved(&fixed),
        "OOMGUARD_ALLOC_CONF=expandable_segments:False changes the replay"
    );
    let flag = oomguard_with_conf(
        "expandable_segments:False",
        &[
            "replay",
            &t,
            "--json",
            "--config",
            "expandable_segments:True",
        ],
    );
    assert_eq!(
        reserved(&flag),
        reserved(&plain),
        "an explicit --config wins"
    );
    let bad = oomguard_with_conf("expandable_segmens:True", &["replay", &t]);
    assert_error(&bad, 2, "OOMGUARD_ALLOC_CONF");
}

/// Issue 26, point 14: a variable-batch BERT-base inference workload (200 requests, batch 1–64,
/// sequence 16–512, fp16, no grad), captured by this project on the H100 with PyTorch
/// (`scripts/capture_bert_inference.py`; traces/README.md). The smallest capacity that runs it
/// stays within 1.02 of peak live with the default, and without a limit the default reserves
/// less than PyTorch's own expandable segments on the same run (1.3075): it maps instead of
/// moving while the card has room (1.2387 here, docs/BENCHMARKS.md). Tight mode
/// (`page_recycle_threshold:0`, pages moved before passing the high-water mark) keeps peak
/// reserved without a limit within 1.025 of peak live (1.0217).
#[test]
fn bert_inference_trace_stays_within_1_02_of_peak_live() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../traces");
    let file = dir.join("bert_infer.trace.csv").display().to_string();
    let figs: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("bert_infer.figures.json")).unwrap(),
    )
    .unwrap();
    let live = figs["peak_live_bytes"].as_u64().unwrap();
    let o = oomguard(&[
        "replay",
        &file,
        "--config",
        "expandable_segments:True",
        "--json",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v = json(&o);
    assert_eq!(v["peak_live_bytes"].as_u64(), Some(live));
    assert_eq!(v["events"].as_u64(), figs["trace_events"].as_u64());
    let pytorch = figs["pytorch_expandable_segments"]["peak_reserved"]
        .as_u64()
        .unwrap();
    assert!(v["peak_reserved_bytes"].as_u64().unwrap() < pytorch, "{v}");
    let tight = oomguard(&[
        "replay",
        &file,
        "--config",
        "expandable_segments:True,page_recycle_threshold:0",
        "--json",
    ]);
    assert_eq!(tight.status.code(), Some(0), "{}", stderr(&tight));
    let ratio = json(&tight)["ratio"].as_f64().unwrap();
    assert!(
        ratio <= 1.025,
        "tight mode: peak reserved / peak live {ratio}"
    );
    let m = oomguard(&["mincap", &file, "--json"]);
    assert_eq!(m.status.code(), Some(0), "{}", stderr(&m));
    let mincap = json(&m)["ratio"].as_f64().unwrap();
    assert!(mincap <= 1.02, "smallest capacity / peak live {mincap}");
}

/// Issue 26, point 14, on the generated inference workloads (`gen inference`, about 0.85 GB
/// live), in tight mode (`page_recycle_threshold:0`): peak reserved is 1.03 × peak live with an
/// H100's 2 MiB pages, and what is over is page rounding, not placement: the same replay with
/// smaller pages of the simulated device
/// (`--page-size`) comes down with the page size, to within 1% of peak live at 512 KiB.
#[test]
fn generated_inference_excess_shrinks_with_the_page_size() {
    let dir = common::scratch("pagesize");
    let f = dir.path().join("inf2.csv").display().to_string();
    let o = oomguard(&["gen", "inference", "--seed", "2", "-o", &f]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let ratio = |page: Option<&str>| {
        let mut args = vec![
            "replay",
            f.as_str(),
            "--json",
            "--config",
            "page_recycle_threshold:0",
        ];
        if let Some(p) = page {
            args.extend(["--page-size", p]);
        }
        let o = oomguard(&args);
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        let v = json(&o);
        let want = match page {
            Some(p) => format!("pages of {p}"),
            None => "simulated device".into(),
        };
        assert!(v["device"].as_str().unwrap().contains(&want), "{v}");
        v["ratio"].as_f64().unwrap()
    };
    let r: Vec<f64> = [
        None,
        Some("1.00 MiB"),
        Some("512.00 KiB"),
        Some("64.00 KiB"),
    ]
    .into_iter()
    .map(ratio)
    .collect();
    println!("2 MiB, 1 MiB, 512 KiB, 64 KiB pages: {r:?}");
    assert!(r.windows(2).all(|w| w[1] < w[0]), "{r:?}");
    assert!(r[2] <= 1.01 && r[3] <= 1.002, "{r:?}");
    // the excess scales with the page size: at least 3× less at a quarter of it
    assert!((r[0] - 1.0) >= 3.0 * (r[2] - 1.0), "{r:?}");
}

/// A page size the simulated device cannot use, or one given for a GPU, is one line and exit 2.
#[test]
fn bad_page_sizes_are_refused() {
    let dir = common::scratch("badpage");
    let f = dir.path().join("t.csv").display().to_string();
    let o = oomguard(&["gen", "inference", "--tiny", "-o", &f]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    for (args, says) in [
        (vec!["--page-size", "3MiB"], "power of two"),
        (vec!["--page-size", "1KiB"], "power of two"),
        (vec!["--page-size", "2GiB"], "power of two"),
        (vec!["--page-size", "banana"], "--page-size"),
        (
            vec!["--page-size", "64KiB", "--device", "cuda:0"],
            "applies to the simulated device",
        ),
    ] {
        let mut all = vec!["replay", f.as_str()];
        all.extend(args.iter().copied());
        let o = oomguard(&all);
        let e = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {e}");
        assert!(
            e.contains(says) && e.contains("--page-size"),
            "{args:?}: {e}"
        );
        assert_eq!(e.trim().lines().count(), 1, "{args:?}: {e}");
    }
}

/// Issue 31: `replay --steps N` prints what each step of a training loop made growable segments
/// do. candle_gpt's own requests (6 steps at batch 24, recorded on an H100): the default never
/// unmaps and its later steps map nothing; tight mode (`page_recycle_threshold:0`) moves pages
/// (24.5 GiB) before it settles. A step count outside 1..=100000 is refused.
#[test]
fn replay_reports_the_pages_each_step_moves() {
    let file = repo_trace("candle_gpt24.trace.csv");
    let steps = |config: &str| -> Vec<serde_json::Value> {
        let o = oomguard(&[
            "replay", &file, "--steps", "6", "--json", "--config", config,
        ]);
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        json(&o)["per_step"].as_array().unwrap().clone()
    };
    let default = steps("expandable_segments:True");
    assert_eq!(default.len(), 6, "{default:?}");
    assert!(default[0]["mapped_bytes"].as_u64().unwrap() > 60 << 30);
    for s in &default[4..] {
        assert_eq!(s["mapped_bytes"], 0, "{s}");
        assert_eq!(s["unmapped_bytes"], 0, "{s}");
        assert_eq!(s["synchronizations"], 0, "{s}");
    }
    assert!(
        default.iter().all(|s| s["unmapped_bytes"] == 0),
        "{default:?}"
    );
    // tight mode moves pages while the loop settles
    let tight = steps("expandable_segments:True,page_recycle_threshold:0");
    let moved: u64 = tight
        .iter()
        .map(|s| s["unmapped_bytes"].as_u64().unwrap())
        .sum();
    assert!(moved > 10 << 30, "{tight:?}");
    let text = oomguard(&["replay", &file, "--steps", "6"]);
    assert_eq!(text.status.code(), Some(0), "{}", stderr(&text));
    let out = String::from_utf8_lossy(&text.stdout);
    assert!(
        out.contains("step 5") && out.contains("from event"),
        "{out}"
    );
    let bad = oomguard(&["replay", &file, "--steps", "0"]);
    assert_eq!(bad.status.code(), Some(2), "{}", stderr(&bad));
    assert!(stderr(&bad).contains("--steps"), "{}", stderr(&bad));
    // more steps than the trace can be cut into: a one-line error, not a silent shorter list
    let dir = common::scratch("steps");
    let tiny = dir.path().join("tiny.csv");
    std::fs::write(
        &tiny,
        "op,id,bytes,stream\na,0,100,0\nf,0,100,0\na,1,5000000,0\n",
    )
    .unwrap();
    let few = oomguard(&["replay", tiny.to_str().unwrap(), "--steps", "10"]);
    assert_eq!(few.status.code(), Some(2), "{}", stderr(&few));
    assert!(
        stderr(&few).contains("--steps 10") && stderr(&few).contains("3 events"),
        "{}",
        stderr(&few)
    );
    assert_eq!(stderr(&few).trim().lines().count(), 1, "{}", stderr(&few));
}

/// `layout`: a loop of the recorded VGG-16 step at 1,118 rows (traces/README.md) has a static
/// layout between its peak live bytes and the sum of its blocks; text and JSON agree.
#[test]
fn layout_bounds_a_settled_loop_of_a_recorded_step() {
    let file = repo_trace("tch_vgg16_b1118.trace.csv");
    let o = oomguard(&[
        "layout",
        &file,
        "--steps",
        "3",
        "--tries",
        "20",
        "--capacity",
        "200GiB",
        "--json",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v = json(&o);
    let peak = v["peak_live_bytes"].as_u64().unwrap();
    let height = v["layout_bytes"].as_u64().unwrap();
    // 77.19 GiB live at once at the step's peak (docs/BENCHMARKS.md)
    assert!(peak > 77 << 30 && peak < 78 << 30, "{v}");
    assert!(height >= peak && height < 100 << 30, "{v}");
    assert_eq!(v["fits"], serde_json::json!(true), "{v}");
    assert!(v["tries"].as_u64().unwrap() <= 20, "{v}");
    let text = stdout(&oomguard(&[
        "layout",
        &file,
        "--steps",
        "3",
        "--tries",
        "20",
        "--capacity",
        "70GiB",
    ]));
    assert!(text.contains("static layout"), "{text}");
    assert!(text.contains("no layout found under it"), "{text}");
}

/// VGG-16 at 1,951 rows, recorded on the H200 with libtorch's autograd thread freeing (run 87):
/// replayed on its two threads at the 137.8 GiB the card left the step, it runs by best fit,
/// moving pages; no static layout of its step comes within 1.0103 x its peak live bytes, above
/// that capacity: why the contiguous step plan was refused on the card (docs/BENCHMARKS.md); a
/// plan shared at page granularity settles it (`runtime/tests/step_plan.rs`).
#[test]
fn the_largest_vgg_step_on_the_h200_runs_but_has_no_layout_under_the_card() {
    let file = repo_trace("tch_vgg16_b1951.trace.csv");
    let o = oomguard(&[
        "replay",
        &file,
        "--steps",
        "3",
        "--threads",
        "--capacity",
        "137.8GiB",
        "--json",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v = json(&o);
    assert_eq!(v["completed"].as_bool(), Some(true), "{v}");
    assert_eq!(v["threads"].as_u64(), Some(2), "{v}");
    assert_eq!(v["peak_live_bytes"].as_u64(), Some(147_390_494_607), "{v}");
    let capacity = v["capacity_bytes"].as_u64().unwrap();
    assert!(
        v["peak_reserved_bytes"].as_u64().unwrap() <= capacity,
        "{v}"
    );
    assert!(
        v["backend_calls"]["unmapped_bytes"].as_u64().unwrap() > 0,
        "{v}"
    );
    let o = oomguard(&[
        "layout",
        &file,
        "--steps",
        "3",
        "--tries",
        "64",
        "--capacity",
        "137.8GiB",
        "--json",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let l = json(&o);
    let (peak, height) = (
        l["peak_live_bytes"].as_u64().unwrap(),
        l["layout_bytes"].as_u64().unwrap(),
    );
    assert!(height as f64 >= 1.01 * peak as f64, "{l}");
    assert_eq!(l["fits"], serde_json::json!(false), "{l}");
}

/// The recorded VGG-16 step at 1,118 rows on the default 80 GiB card: best fit moves 10-24 GiB
/// a step; with the steps marked (`--steps`, as `train_step` marks them), step 1 repeats step
/// 0, so step 2 starts with the plan's one range mapped (one map call, one wait), and nothing
/// else moves in it, on one thread and with the autograd thread's frees on a thread of their
/// own (issue 37; runtime/tests/step_plan.rs runs the step 8 times).
#[test]
fn replay_with_steps_lays_out_the_recorded_vgg_step() {
    let file = repo_trace("tch_vgg16_b1118.trace.csv");
    for threads in [false, true] {
        let mut args = vec!["replay", &file, "--steps", "3", "--json"];
        if threads {
            args.push("--threads");
        }
        let o = oomguard(&args);
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        let v = json(&o);
        let steps = v["per_step"].as_array().unwrap();
        assert_eq!(steps.len(), 3, "{v}");
        assert!(steps[0]["unmapped_bytes"].as_u64().unwrap() > 0, "{v}");
        let last = &steps[2];
        assert_eq!(last["maps"].as_u64(), Some(1), "threads {threads}: {last}");
        assert_eq!(
            last["synchronizations"].as_u64(),
            Some(1),
            "threads {threads}: {last}"
        );
        assert_eq!(
            last["retries"].as_u64(),
            Some(0),
            "threads {threads}: {last}"
        );
        // the range: the step's layout, within 0.5 % of its 77.18 GiB live at once
        let range = last["mapped_bytes"].as_u64().unwrap();
        let peak = v["peak_live_bytes"].as_u64().unwrap();
        assert!(
            range >= peak && range as f64 <= 1.005 * peak as f64,
            "threads {threads}: {range} against {peak}"
        );
    }
}

#[test]
fn layout_refuses_bad_arguments_in_one_line() {
    let file = repo_trace("tch_vgg16_b1118.trace.csv");
    assert_error(
        &oomguard(&["layout", &file, "--capacity", "lots"]),
        2,
        "capacity",
    );
    assert_error(&oomguard(&["layout", &file, "--tries", "0"]), 2, "tries");
    assert_error(
        &oomguard(&["layout", "/nonexistent/trace.csv"]),
        2,
        "trace.csv",
    );
}
