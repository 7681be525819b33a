//! Trace readers on the real traces, on malformed files, and on garbage.

mod common;

use oomguard_cli::{csv_trace, detect, rmm, snapshot, Op, ReadError, TraceFormat};
use proptest::prelude::*;

#[test]
fn every_real_trace_reads_with_the_published_figures() {
    let figs = common::figures();
    let traces = figs["traces"].as_object().unwrap();
    assert_eq!(traces.len(), 3);
    for (name, f) in traces {
        let path = common::traces_dir().join(format!("{name}.trace.csv"));
        let t = detect::read_trace(&path).unwrap();
        assert_eq!(t.format, TraceFormat::Csv);
        assert_eq!(
            t.events.len() as u64,
            f["trace_events"].as_u64().unwrap(),
            "{name}"
        );
        assert_eq!(
            t.peak_live_bytes(),
            f["peak_live_bytes"].as_u64().unwrap(),
            "{name}"
        );
        // The only note: the few allocations (the model's state) live when recording stopped.
        assert_eq!(t.notes.len(), 1, "{:?}", t.notes);
        assert!(
            t.notes[0].contains("still live at the end"),
            "{:?}",
            t.notes
        );
    }
}

#[test]
fn the_real_snapshot_pickle_gives_the_csv_events() {
    let dir = common::traces_dir();
    let snap = detect::read_trace(&dir.join("resnet50.snapshot.pickle")).unwrap();
    let csv = detect::read_trace(&dir.join("resnet50.trace.csv")).unwrap();
    assert_eq!(snap.format, TraceFormat::PytorchSnapshot);
    assert_eq!(snap.events, csv.events);
    assert!(
        snap.notes.iter().any(|n| n.contains("110 segment calls")),
        "{:?}",
        snap.notes
    );
}

#[test]
fn truncated_real_pickle_errors_name_an_offset() {
    let data = std::fs::read(common::traces_dir().join("resnet50.snapshot.pickle")).unwrap();
    let step = data.len() / 97;
    for cut in (0..data.len())
        .step_by(step)
        .chain([1, 2, 11, data.len() - 1])
    {
        match snapshot::parse(&data[..cut]) {
            Err(ReadError::Pickle { offset, .. }) => assert!(offset <= cut, "cut {cut}"),
            Err(ReadError::Empty) => assert_eq!(cut, 0),
            other => panic!("cut at {cut}: {other:?}"),
        }
    }
}

#[test]
fn truncated_real_csv_is_read_or_rejected_by_line() {
    let data = std::fs::read(common::traces_dir().join("vit_b16.trace.csv")).unwrap();
    let mut errors = 0;
    for cut in (0..data.len()).step_by(data.len() / 61) {
        match csv_trace::parse(&data[..cut]) {
            Ok(t) => assert!(!t.events.is_empty()),
            Err(ReadError::Line { line, .. }) => {
                errors += 1;
                assert!(line >= 1)
            }
            Err(ReadError::Empty | ReadError::NoEvents) => assert!(cut < 40, "cut {cut}"),
            Err(e) => panic!("cut {cut}: {e}"),
        }
    }
    // A cut inside a line leaves a short line or a free of an unknown id only sometimes; at
    // least the header cut is an error.
    assert!(errors >= 1);
}

#[test]
fn malformed_files_get_one_clear_error() {
    let cases: &[(&[u8], &str)] = &[
        (b"", "empty file: not a trace"),
        (
            b"op,id,bytes,stream\n",
            "the trace has no allocation events",
        ),
        (
            b"Thread,Time,Action,Pointer,Size,Stream\n",
            "the trace has no allocation events",
        ),
        (b"hello world\n", "unknown trace format"),
        (b"op,id,bytes,stream\nz,1,2,0\n", "line 2: unknown op"),
        (
            b"op,id,bytes,stream\na,1,2,0\nf,9,2,0\n",
            "line 3: free of id 9, which is not live",
        ),
        (
            b"op,id,bytes,stream\na,1,2,0\na,1,2,0\n",
            "line 3: duplicate allocation id 1",
        ),
        (
            b"op,id,bytes,stream\na,1,184467440737095516160,0\n",
            "line 2: bytes \"184467440737095516160\": too large for 64 bits",
        ),
        (
            b"\x80\x04K\x01.",
            "not a PyTorch memory snapshot: the pickle holds a int",
        ),
        (
            b"\x80\x04}\x94.",
            "not a PyTorch memory snapshot: no `device_traces` key",
        ),
        (b"\x80\x04}\x94(", "pickle byte offset 5: truncated"),
    ];
    for (data, want) in cases {
        let e = detect::parse(data, None).unwrap_err().to_string();
        assert!(
            e.starts_with(want),
            "{:?}: {e}",
            String::from_utf8_lossy(data)
        );
    }
}

#[test]
fn snapshot_structure_errors_name_the_entry() {
    // {'device_traces': [[{'action': 'alloc', 'addr': 16}]]}  (no size), protocol 4
    let p = b"\x80\x04}\x94\x8c\rdevice_traces\x94]\x94]\x94}\x94(\x8c\x06action\x94\x8c\x05alloc\x94\x8c\x04addr\x94K\x10uaas.";
    let e = snapshot::parse(p).unwrap_err().to_string();
    assert_eq!(
        e,
        "not a PyTorch memory snapshot: device_traces[0][0]: no `size`"
    );
}

#[test]
fn rmm_log_file_with_failures() {
    let log = "Thread,Time,Action,Pointer,Size,Stream\n\
               1,10:31:27:589049,allocate,0x7f0000000000,1048576,0x0\n\
               1,10:31:27:589050,allocate failure,0x0,999999999999,0x0\n\
               1,10:31:27:589051,allocate,0x7f0000100000,2097152,0x0\n\
               1,10:31:27:589052,free,0x7f0000000000,1048576,0x0\n";
    let t = detect::parse(log.as_bytes(), None).unwrap();
    assert_eq!(t.format, TraceFormat::RmmLog);
    assert_eq!(t.events.len(), 3);
    assert_eq!(t.events[2].op, Op::Free);
    assert_eq!(t.peak_live_bytes(), 3 << 20);
    assert!(rmm::parse(b"Thread,Time,Action,Pointer,Size,Stream\n1,2,free,0x1,1,0\n").is_err());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn never_panics_on_garbage(data in proptest::collection::vec(any::<u8>(), 0..400)) {
        let _ = detect::parse(&data, None);
        let _ = snapshot::parse(&data);
        let _ = csv_trace::parse(&data);
        let _ = rmm::parse(&data);
    }

    #[test]
    fn never_panics_on_pickle_like_garbage(
        body in proptest::collection::vec(
            prop_oneof![
                Just(b'('), Just(b')'), Just(b']'), Just(b'}'), Just(b'a'), Just(b'e'), Just(b'u'),
                Just(b's'), Just(b't'), Just(b'0'), Just(b'1'), Just(b'2'), Just(0x94u8),
                Just(b'h'), Just(b'K'), Just(0x85u8), Just(0x86u8), Just(b'R'), Just(b'b'),
                Just(0x93u8), Just(0x8cu8), Just(0x8au8), Just(b'.'), any::<u8>()
            ],
            0..200,
        )
    ) {
        let mut data = vec![0x80, 4];
        data.extend(body);
        let _ = snapshot::parse(&data);
    }

    #[test]
    fn never_panics_on_csv_like_garbage(
        lines in proptest::collection::vec("[af],[0-9]{1,3},[0-9]{0,22},[0-9x]{0,3}", 0..40)
    ) {
        let text = format!("op,id,bytes,stream\n{}\n", lines.join("\n"));
        if let Ok(t) = csv_trace::parse(text.as_bytes()) {
            let (r, _) = oomguard_cli::replay::replay(
                &t,
                &oomguard_cli::replay::ReplayOptions::default(),
                &mut |_| {},
            );
            prop_assert_eq!(r.events, t.events.len());
        }
    }
}

/// A snapshot libtorch wrote for a tch training step (through oomguard-tch on an H100,
/// traces/README.md): read as PyTorch's snapshot, replayed, and viewed.
#[test]
fn a_tch_training_steps_snapshot_from_libtorch_reads_replays_and_views() {
    let path = common::traces_dir().join("tch_step.snapshot.pickle");
    let t = detect::read_trace(&path).unwrap();
    assert_eq!(t.format, TraceFormat::PytorchSnapshot);
    let allocs = t.events.iter().filter(|e| e.op == Op::Alloc).count();
    let frees = t.events.iter().filter(|e| e.op == Op::Free).count();
    assert!(
        allocs >= 40 && frees >= 20,
        "{allocs} allocs, {frees} frees: {:?}",
        t.notes
    );
    assert!(t.peak_live_bytes() > 0);
    let opts = oomguard_cli::replay::ReplayOptions::default();
    let (report, _) = oomguard_cli::replay::replay(&t, &opts, &mut |_| {});
    assert_eq!(report.peak_live_bytes, t.peak_live_bytes());
    assert!(
        report.peak_reserved_bytes >= report.peak_live_bytes,
        "{report:?}"
    );
    let data = oomguard_cli::viewdata::ViewData::record(&t, &opts);
    let page = oomguard_cli::view::html("tch_step.snapshot.pickle", &t, &report, &data);
    assert!(page.contains("tch_step.snapshot.pickle"));
}
