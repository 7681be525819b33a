//! libtorch's CUDA caching allocator as an oomguard source, on a real card (CUDA device 0).
//!
//! The allocator's state (peaks, memory fraction, history) is per process: run these one at a
//! time, `--test-threads=1`.
//!
//! ```text
//! cargo test --release --test source_gpu -- --ignored --test-threads=1
//! ```

use oomguard::source::guards::{UsageLeakCheck, UsagePeakScope};
use oomguard::source::MemorySource;
use oomguard::IsOom;
use oomguard_tch::cuda_allocator as alloc;
use oomguard_tch::memory_history::{self, HistoryOptions};
use oomguard_tch::{tch_error_is_oom, LibtorchCudaSource};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

const MIB: u64 = 1 << 20;
const CUDA: Device = Device::Cuda(0);

fn source() -> LibtorchCudaSource {
    LibtorchCudaSource::new(0).expect("a CUDA device")
}

/// A float tensor of `mib` MiB on the card.
fn mib_tensor(mib: u64) -> Result<Tensor, tch::TchError> {
    Tensor::f_zeros([(mib * MIB / 4) as i64], (Kind::Float, CUDA))
}

#[test]
#[ignore = "needs a CUDA device"]
fn allocated_and_reserved_follow_tch_tensors_and_empty_cache_releases() {
    let src = source();
    assert!(src.info().total_bytes > 0, "{:?}", src.info());
    src.empty_cache().unwrap();
    let u0 = src.usage().unwrap();
    // 256 MiB: larger than any block earlier tests of this process left cached, so that it
    // takes a segment of its own, which empty_cache can give back
    let t = mib_tensor(256).unwrap();
    let u1 = src.usage().unwrap();
    assert_eq!(u1.used - u0.used, 256 * MIB, "{u0:?} -> {u1:?}");
    assert!(u1.reserved >= u0.reserved + 256 * MIB, "{u0:?} -> {u1:?}");
    drop(t);
    let u2 = src.usage().unwrap();
    assert_eq!(u2.used, u0.used, "the block is free again");
    assert_eq!(u2.reserved, u1.reserved, "and cached");
    src.empty_cache().unwrap();
    let u3 = src.usage().unwrap();
    assert!(u3.reserved <= u2.reserved - 256 * MIB, "{u2:?} -> {u3:?}");
    // the stats agree with the usage
    let s = src.stats().unwrap();
    assert_eq!(s.allocated_bytes.all().current as u64, u3.used);
    assert_eq!(s.reserved_bytes.all().current as u64, u3.reserved);
    // available: at most the device's free memory plus the cache
    let info = alloc::device_info(0).unwrap();
    let avail = src.available().unwrap();
    assert!(avail <= info.free_bytes + (u3.reserved - u3.used) && avail > 0);
}

#[test]
#[ignore = "needs a CUDA device"]
fn peaks_reset_and_peak_scopes_measure() {
    let src = source();
    drop(mib_tensor(128).unwrap());
    let u = src.usage().unwrap();
    assert!(u.used_peak >= u.used + 128 * MIB, "{u:?}");
    src.reset_peak().unwrap();
    let u = src.usage().unwrap();
    assert_eq!(u.used_peak, u.used, "{u:?}");
    assert_eq!(u.reserved_peak, u.reserved, "{u:?}");

    let scope = UsagePeakScope::new(&src).unwrap();
    let base = src.usage().unwrap().used;
    drop(mib_tensor(32).unwrap());
    assert!(scope.peak_bytes().unwrap() >= base + 32 * MIB);
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_budget_is_the_memory_fraction_and_makes_libtorch_run_out() {
    let src = source();
    let total = src.info().total_bytes;
    assert_eq!(alloc::memory_fraction(0).unwrap(), 1.0);
    src.empty_cache().unwrap();
    let reserved = src.usage().unwrap().reserved;
    let limit = reserved + 256 * MIB;
    {
        let outer = src.budget(1 << 30).unwrap();
        let budget = src.budget(limit).unwrap();
        assert_eq!(budget.limit(), limit);
        let f = alloc::memory_fraction(0).unwrap();
        // libtorch keeps the cap in whole bytes (fraction × total, truncated) and gives back
        // cap / total: within a byte or two of the limit, not bit for bit.
        assert!((f * total as f64 - limit as f64).abs() <= 2.0, "{f}");
        // 512 MiB cannot be reserved under the cap: libtorch's own out-of-memory
        let ooms = src.stats().unwrap().num_ooms;
        let e = mib_tensor(512).unwrap_err();
        assert!(tch_error_is_oom(&e), "{e}");
        let text = e.to_string();
        assert!(text.contains("allowed;"), "{text}");
        let e = oomguard_tch::Error::from(e);
        assert!(e.is_oom() && !e.is_budget_exceeded(), "{e}");
        assert_eq!(src.stats().unwrap().num_ooms, ooms + 1);
        // 128 MiB fits
        drop(mib_tensor(128).unwrap());
        // the tightest live budget is in force; dropping it restores the outer one
        drop(budget);
        let f = alloc::memory_fraction(0).unwrap();
        assert!((f * total as f64 - (1u64 << 30) as f64).abs() <= 2.0, "{f}");
        drop(outer);
    }
    assert_eq!(alloc::memory_fraction(0).unwrap(), 1.0);
    drop(mib_tensor(512).unwrap());
    // refused budgets
    assert!(src.budget(0).is_err());
    assert!(src.budget(total + 1).is_err());
}

#[test]
#[ignore = "needs a CUDA device"]
fn the_leak_check_catches_a_kept_tensor() {
    let src = source();
    let check = UsageLeakCheck::new(&src).unwrap();
    let kept = mib_tensor(16).unwrap();
    drop(mib_tensor(32).unwrap());
    let r = check.finish().unwrap();
    assert_eq!(r.leaked_bytes, 16 * MIB, "{r}");
    assert!(r.exceeds_allowance());
    drop(kept);
    let check = UsageLeakCheck::new(&src).unwrap();
    drop(mib_tensor(32).unwrap());
    check.finish_strict().unwrap();
}

#[test]
#[ignore = "needs a CUDA device"]
fn find_max_batch_over_the_source_under_a_budget() {
    let src = source();
    src.empty_cache().unwrap();
    let reserved = src.usage().unwrap().reserved;
    let _budget = src.budget(reserved + 2048 * MIB).unwrap();
    // 64 MiB of workspace and 4 MiB per row: about 496 rows fit in 2 GiB
    let step = |rows: usize| -> Result<(), oomguard_tch::Error> {
        let _w = mib_tensor(64)?;
        let _a = mib_tensor(4 * rows as u64)?;
        Ok(())
    };
    let opts = oomguard::retry::FinderOptions {
        verify_steps: 4,
        ..Default::default()
    };
    let report = oomguard::retry::find_max_batch(&src, opts, step).unwrap();
    // the budget caps reserved memory, which also holds what earlier tests of this process
    // left live or cached: about (2048 MiB + that - 64 MiB) / 4 MiB rows
    assert!((400..=540).contains(&report.max_batch), "{report}");
    step(report.max_batch).unwrap();
    // and 5% more does not fit
    let over = step(report.max_batch * 21 / 20).unwrap_err();
    assert!(over.is_oom(), "{over}");
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_snapshot_of_a_tch_training_step_opens_in_oomguard_view() {
    let src = source();
    memory_history::record_history(HistoryOptions::default()).unwrap();
    assert_eq!(alloc::allocator_info().unwrap().history_enabled, Some(true));
    let vs = nn::VarStore::new(CUDA);
    let net = nn::seq()
        .add(nn::linear(vs.root() / "l1", 256, 512, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs.root() / "l2", 512, 10, Default::default()));
    let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
    for _ in 0..2 {
        let x = Tensor::randn([64, 256], (Kind::Float, CUDA));
        let y = Tensor::randint(10, [64], (Kind::Int64, CUDA));
        let loss = net.forward(&x).cross_entropy_for_logits(&y);
        opt.backward_step(&loss);
    }
    let dir = std::env::temp_dir().join(format!("oomguard-tch-gpu-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tch_step.pickle");
    memory_history::write_snapshot(&path).unwrap();
    memory_history::stop_history().unwrap();

    let bytes = std::fs::read(&path).unwrap();
    assert_eq!(&bytes[..2], &[0x80, 0x02], "a protocol-2 pickle");
    // `oomguard view`'s loader, replay and page
    let trace = oomguard_cli::detect::read_trace(&path).unwrap();
    assert_eq!(trace.format, oomguard_cli::TraceFormat::PytorchSnapshot);
    let allocs = trace
        .events
        .iter()
        .filter(|e| e.op == oomguard_cli::Op::Alloc)
        .count();
    assert!(allocs >= 10, "{allocs} allocations in {:?}", trace.notes);
    let opts = oomguard_cli::replay::ReplayOptions::default();
    let (report, _) = oomguard_cli::replay::replay(&trace, &opts, &mut |_| {});
    let data = oomguard_cli::viewdata::ViewData::record(&trace, &opts);
    let page = oomguard_cli::view::html("tch_step.pickle", &trace, &report, &data);
    assert!(page.len() > 1000);
    eprintln!(
        "snapshot: {} ({} bytes, {allocs} allocations)",
        path.display(),
        bytes.len()
    );

    let summary = src.memory_summary();
    assert!(summary.contains("Allocated memory"), "{summary}");
    assert!(summary.contains("allocator: native"), "{summary}");
    eprintln!("{summary}");
}
