//! The cost of a run of failing allocations: 12,000 allocations of 4 KiB, each on a stream of
//! its own, replayed on a simulated 16 GiB device. 8,192 fit (one 2 MiB page or segment per
//! stream); the other 3,808 fail, each after the allocator releases its cache and retries.
//! `cli/tests/hostile.rs` counts what each failure visits (free blocks and segments); this
//! prints the time, per failed allocation, for both segment kinds (best of 5).
//!
//! Run: `cargo bench -p oomguard-cli --bench failing_run`.

use oomguard_cli::replay::{replay, ReplayOptions};
use oomguard_cli::{Event, Trace, TraceFormat};
use oomguard_runtime::AllocatorConfig;

fn main() {
    let events: Vec<Event> = (0..12_000u64).map(|i| Event::alloc(i, 4096, i)).collect();
    let trace = Trace::new(TraceFormat::Csv, events);
    println!("12,000 allocations of 4 KiB on their own streams, 16 GiB simulated (best of 5)");
    for config in ["expandable_segments:True", "expandable_segments:False"] {
        let opts = ReplayOptions {
            config: AllocatorConfig::parse(config).expect("valid config"),
            capacity: 16 << 30,
            ..Default::default()
        };
        let mut best = f64::MAX;
        let mut ooms = 0;
        for _ in 0..5 {
            let (r, _) = replay(&trace, &opts, &mut |_| {});
            best = best.min(r.seconds);
            ooms = r.num_ooms;
        }
        println!(
            "  {config}: {best:.3} s, {ooms} failed, {:.1} us per failed allocation",
            best * 1e6 / ooms.max(1) as f64
        );
    }
}
