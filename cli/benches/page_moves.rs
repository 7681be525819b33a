//! Pages moved per training step by growable segments (issue 31), and what a move costs on a GPU.
//!
//! 1. Simulated device (always): candle_gpt's own requests, 6 training steps recorded on an
//!    H100 (`traces/candle_gpt24.trace.csv`, `candle_gpt28.trace.csv`; traces/README.md), replayed
//!    through the allocator on a device the size the allocator had on that card (78,945 MiB:
//!    the card less the memory outside the allocator and the model's weights, which the trace
//!    does not hold) and on one with room (160 GiB). Per step: bytes mapped and
//!    unmapped, for the default and for tight mode (`page_recycle_threshold:0`). A settled loop
//!    maps nothing: a regression shows as a figure here.
//! 2. CUDA device (feature `cuda`, a driver present): the wall time of mapping and unmapping
//!    1,000 MiB of new memory in 2 MiB handles (a page) and in 20 MiB handles (PyTorch's large
//!    pool, and oomguard's large maps since issue 37), and of a 1 GiB move through the
//!    allocator (pages unmapped from a hole and mapped where a request needs them, handles
//!    kept) against a fresh 1 GiB map.
//!
//! Steps are cut as `oomguard replay --steps` cuts them (where the fewest bytes are live).
//!
//! Run: `cargo bench -p oomguard-cli --bench page_moves`.

use std::path::PathBuf;

use oomguard_cli::device::DeviceSpec;
use oomguard_cli::replay::{replay, ReplayOptions};
use oomguard_runtime::AllocatorConfig;

const MIB: u64 = 1 << 20;
const GIB: f64 = (1u64 << 30) as f64;
const STEPS: usize = 6;

/// The allocator's room on the H100 the traces were recorded on (GPU.md, issue 31 runs).
const CARD: u64 = 78_945 * MIB;

fn traces_dir() -> PathBuf {
    std::env::var_os("OOMGUARD_TRACES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../traces"))
}

fn simulated() {
    println!("Pages moved per step, candle_gpt's requests on the simulated device (GiB mapped / unmapped, synchronisations)");
    for batch in [24, 28] {
        let name = format!("candle_gpt{batch}.trace.csv");
        let trace = match oomguard_cli::detect::read_trace(&traces_dir().join(&name)) {
            Ok(t) => t,
            Err(e) => {
                println!("  {name}: {e} (OOMGUARD_TRACES_DIR)");
                continue;
            }
        };
        for (room, capacity) in [("the card", CARD), ("room", 160 << 30)] {
            for (mode, cfg) in [
                ("default", "expandable_segments:True"),
                ("tight", "expandable_segments:True,page_recycle_threshold:0"),
            ] {
                let opts = ReplayOptions {
                    config: AllocatorConfig::parse(cfg).expect("valid config"),
                    capacity,
                    device: DeviceSpec::Sim,
                    steps: Some(STEPS),
                    ..Default::default()
                };
                let (r, _) = replay(&trace, &opts, &mut |_| {});
                if !r.completed {
                    println!("  batch {batch}, {room}, {mode}: out of memory");
                    continue;
                }
                let cells: Vec<String> = r
                    .per_step
                    .iter()
                    .map(|m| {
                        format!(
                            "{:.2}/{:.2}/{}",
                            m.mapped_bytes as f64 / GIB,
                            m.unmapped_bytes as f64 / GIB,
                            m.synchronizations
                        )
                    })
                    .collect();
                let later = &r.per_step[3.min(r.per_step.len())..];
                let steady = later
                    .iter()
                    .map(|m| (m.mapped_bytes + m.unmapped_bytes) as f64 / GIB)
                    .sum::<f64>()
                    / later.len().max(1) as f64;
                println!(
                    "  batch {batch}, {room:<8} {mode:<8} steps {}  | steps 3-5: {steady:.2} GiB mapped + unmapped per step",
                    cells.join("  ")
                );
            }
        }
    }
}

#[cfg(feature = "cuda")]
fn gpu() {
    use oomguard_runtime::Device;
    use std::time::Instant;
    if !oomguard_runtime::cuda::driver_available() {
        println!("\nno CUDA driver: the GPU half is skipped");
        return;
    }
    let dev = Device::cuda_with_config(0, AllocatorConfig::default()).unwrap();
    let backend = dev.cuda_backend().unwrap();
    println!(
        "\nMapping cost on {} (1,000 MiB of new memory; median of 5)",
        dev.name()
    );
    for handle in [2 * MIB, 20 * MIB] {
        let mut maps = Vec::new();
        let mut unmaps = Vec::new();
        for _ in 0..5 {
            let (m, u) = backend.measure_map_cost(1000 * MIB, handle).unwrap();
            maps.push(m.as_secs_f64() * 1e3);
            unmaps.push(u.as_secs_f64() * 1e3);
        }
        maps.sort_by(f64::total_cmp);
        unmaps.sort_by(f64::total_cmp);
        println!(
            "  handles of {:>2} MiB: map {:.1} ms, unmap {:.1} ms",
            handle / MIB,
            maps[2],
            unmaps[2]
        );
    }

    // A 1 GiB move: two 1 GiB blocks, the first freed; under a limit of what is reserved, a
    // 1 GiB request in a new place takes the free block's pages (unmapped, handles kept, mapped
    // again), against a fresh 1 GiB map with room.
    let a = dev.allocator();
    let mut moves = Vec::new();
    let mut fresh = Vec::new();
    for _ in 0..5 {
        a.empty_cache().unwrap();
        a.set_memory_limit(None);
        let x = a.allocate(1 << 30, 0).unwrap();
        let y = a.allocate(1 << 30, 0).unwrap();
        a.free(x).unwrap();
        let t = Instant::now();
        let z = a.allocate((1 << 30) + (2 << 20), 0).unwrap();
        fresh.push(t.elapsed().as_secs_f64() * 1e3);
        a.free(z).unwrap();
        a.empty_cache().unwrap();
        let x = a.allocate(1 << 30, 0).unwrap();
        a.free(x).unwrap();
        a.set_memory_limit(Some(
            a.stats().reserved_bytes.all.current + (1 << 30) + (4 << 20),
        ));
        let t = Instant::now();
        let z = a.allocate((2 << 30) + (2 << 20), 0).unwrap();
        moves.push(t.elapsed().as_secs_f64() * 1e3);
        a.free(z).unwrap();
        a.free(y).unwrap();
    }
    moves.sort_by(f64::total_cmp);
    fresh.sort_by(f64::total_cmp);
    let (created, reused) = backend.page_counts();
    let s = a.stats();
    println!(
        "  a 1 GiB request mapped fresh: {:.1} ms; a 2 GiB request that moves 1 GiB of free pages: {:.1} ms \
         (pages created {created}, mapped from kept handles {reused}; {} stream and {} device synchronisations)",
        fresh[2], moves[2], s.num_stream_syncs, s.num_sync_all_streams
    );
    a.set_memory_limit(None);
}

fn main() {
    // `cargo bench` passes --bench; `cargo test --benches` runs this too (quickly: the traces
    // replay in well under a second).
    simulated();
    #[cfg(feature = "cuda")]
    gpu();
}
