//! Pages moved per training step by growable segments (issue 31), and what a move costs on a GPU.
//!
//! 1. Simulated device (always): candle_gpt's own requests, 6 training steps recorded on an
//!    H100 (`traces/candle_gpt24.trace.csv`, `candle_gpt28.trace.csv`; traces/README.md), replayed
//!    through the allocator on a device the size the allocator had on that card (78,945 MiB:
//!    the card less the memory outside the allocator and the model's weights, which the trace
//!    does not hold) and on one with room (80 GiB + the trace's peak). Per step: bytes mapped and
//!    unmapped, for the default and for tight mode (`page_recycle_threshold:0`). A settled loop
//!    maps nothing: a regression shows as a figure here.
//! 2. CUDA device (feature `cuda`, a driver present): the wall time of mapping and unmapping
//!    1,000 MiB of new memory in 2 MiB handles (oomguard's page) and in 20 MiB handles
//!    (PyTorch's large pool), and of a 1 GiB move through the allocator (pages unmapped from a
//!    hole and mapped where a request needs them, handles kept) against a fresh 1 GiB map.
//!
//! Run: `cargo bench -p oomguard-runtime --bench page_moves`.

use std::path::PathBuf;
use std::sync::Arc;

use oomguard_runtime::alloc::{Allocation, CachingAllocator};
use oomguard_runtime::backend::sim::SimDevice;
use oomguard_runtime::{AllocatorConfig, ByteSize};

const MIB: u64 = 1 << 20;
const GIB: f64 = (1u64 << 30) as f64;
const STEPS: usize = 6;

/// The allocator's room on the H100 the traces were recorded on (GPU.md, issue 31 runs).
const CARD: u64 = 78_945 * MIB;

struct Event {
    alloc: bool,
    id: u64,
    bytes: u64,
}

fn read_trace(name: &str) -> Option<Vec<Event>> {
    let dir = std::env::var_os("OOMGUARD_TRACES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../traces"));
    let text = std::fs::read_to_string(dir.join(name)).ok()?;
    let mut out = Vec::new();
    for line in text.lines().skip(1) {
        let f: Vec<&str> = line.split(',').collect();
        if f.len() != 4 {
            continue;
        }
        out.push(Event {
            alloc: f[0] == "a",
            id: f[1].parse().ok()?,
            bytes: f[2].parse().ok()?,
        });
    }
    Some(out)
}

/// Per step: (GiB mapped, GiB unmapped, synchronisations); `None` when a request failed.
fn replay(events: &[Event], capacity: u64, cfg: &str) -> Option<Vec<(f64, f64, u64)>> {
    let sim = SimDevice::address_only(ByteSize(capacity));
    let a = CachingAllocator::new(Arc::new(sim), AllocatorConfig::parse(cfg).unwrap());
    let mut live: std::collections::HashMap<u64, Allocation> = Default::default();
    let per = events.len() / STEPS;
    let mut out = Vec::new();
    let mut last = (0u64, 0u64, 0u64);
    for (i, e) in events.iter().enumerate() {
        if e.alloc {
            live.insert(e.id, a.allocate(e.bytes, 0).ok()?);
        } else if let Some(x) = live.remove(&e.id) {
            a.free(x).unwrap();
        }
        if (i + 1) % per == 0 && out.len() < STEPS {
            let s = a.stats();
            let now = (
                s.mapped_bytes_total,
                s.unmapped_bytes_total,
                s.num_sync_all_streams + s.num_stream_syncs,
            );
            out.push((
                (now.0 - last.0) as f64 / GIB,
                (now.1 - last.1) as f64 / GIB,
                now.2 - last.2,
            ));
            last = now;
        }
    }
    Some(out)
}

fn simulated() {
    println!("Pages moved per step, candle_gpt's requests on the simulated device (GiB mapped / unmapped, synchronisations)");
    for batch in [24, 28] {
        let name = format!("candle_gpt{batch}.trace.csv");
        let Some(events) = read_trace(&name) else {
            println!("  {name}: not found (OOMGUARD_TRACES_DIR)");
            continue;
        };
        for (room, capacity) in [("the card", CARD), ("room", 160 << 30)] {
            for (mode, cfg) in [
                ("default", "expandable_segments:True"),
                ("tight", "expandable_segments:True,page_recycle_threshold:0"),
            ] {
                match replay(&events, capacity, cfg) {
                    None => println!("  batch {batch}, {room}, {mode}: out of memory"),
                    Some(steps) => {
                        let cells: Vec<String> = steps
                            .iter()
                            .map(|(m, u, s)| format!("{m:.2}/{u:.2}/{s}"))
                            .collect();
                        let steady: f64 = steps[3..].iter().map(|(m, u, _)| m + u).sum::<f64>()
                            / (steps.len() - 3) as f64;
                        println!(
                            "  batch {batch}, {room:<8} {mode:<8} steps {}  | steps 3-5: {steady:.2} GiB mapped + unmapped per step",
                            cells.join("  ")
                        );
                    }
                }
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
