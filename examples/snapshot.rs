//! Records allocator history during a small workload on a simulated device and writes a memory
//! snapshot as a PyTorch-format pickle (for `python -m torch.cuda._memory_viz`) and as JSON.
//!
//! ```text
//! cargo run --example snapshot -- OUT_PREFIX [expandable_segments:False]
//! ```

use oomguard::{AllocatorConfig, ByteSize, Device};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(prefix) = args.first() else {
        eprintln!("usage: snapshot OUT_PREFIX [CONFIG]");
        std::process::exit(2);
    };
    let config = match AllocatorConfig::parse(args.get(1).map_or("", String::as_str)) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("snapshot: {e}");
            std::process::exit(2);
        }
    };
    let dev = Device::new(
        oomguard::backend::sim::SimDevice::new(ByteSize::gib(2)),
        config,
    );
    dev.allocator().record_history(100_000, true);
    // three "steps" of a model: weights live throughout, activations per step
    let weights: Vec<_> = (0..8)
        .map(|i| dev.zeros::<f32>(1 << (16 + i % 4)).unwrap())
        .collect();
    for step in 0..3usize {
        let acts: Vec<_> = (0..24)
            .map(|i| {
                dev.alloc::<f32>((i % 5 + 1) * 50_000 + step * 1000)
                    .unwrap()
            })
            .collect();
        drop(acts);
    }
    let snap = dev.memory_snapshot();
    let (pkl, json) = (format!("{prefix}.pickle"), format!("{prefix}.json"));
    let written = std::fs::write(&pkl, snap.to_pytorch_pickle())
        .and_then(|_| std::fs::write(&json, snap.to_json().unwrap_or_default()));
    if let Err(e) = written {
        eprintln!("snapshot: cannot write {prefix}.*: {e}");
        std::process::exit(1);
    }
    println!(
        "wrote {pkl} and {json}: {} segments, {} events",
        snap.segments.len(),
        snap.device_traces.len()
    );
    drop(weights);
}
