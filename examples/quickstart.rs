//! Quickstart: buffers on a simulated device, an out-of-memory turned into an explained error,
//! `empty_cache` and `memory_summary`.
//!
//! ```text
//! cargo run --example quickstart
//! ```

use oomguard::{AllocatorConfig, ByteSize, Device, Error};

fn main() {
    if let Err(e) = run() {
        eprintln!("quickstart: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Error> {
    // A simulated 8 GiB GPU; OOMGUARD_ALLOC_CONF configures the allocator as PyTorch's
    // PYTORCH_CUDA_ALLOC_CONF does.
    let config = AllocatorConfig::from_env()?;
    let dev = Device::new(
        oomguard::backend::sim::SimDevice::new(ByteSize::gib(8)),
        config,
    );
    println!(
        "device: {} ({} total)",
        dev.name(),
        ByteSize(dev.mem_info()?.total)
    );

    // Buffers are RAII: dropping one returns its memory to the cache.
    let weights = dev.from_slice(&vec![0.5f32; 1 << 20])?;
    let activations = dev.zeros::<f32>(256 << 20)?; // 1 GiB
    println!(
        "allocated {} in 2 buffers; first weight = {}",
        ByteSize(dev.stats().allocated_bytes.all.current),
        weights.to_vec()?[0]
    );

    // Ask for more than the device has: a typed error that explains itself.
    match dev.alloc::<f32>(2 << 30) {
        Ok(_) => println!("unexpected: 8 GiB fitted"),
        Err(e) => {
            assert!(e.is_oom());
            println!("\nout of memory, as expected:\n  {e}\n");
        }
    }

    drop(activations);
    let s = dev.stats();
    println!(
        "after drop: allocated {}, reserved {} (cached for reuse)",
        ByteSize(s.allocated_bytes.all.current),
        ByteSize(s.reserved_bytes.all.current)
    );
    dev.empty_cache()?;
    println!(
        "after empty_cache: reserved {}",
        ByteSize(dev.stats().reserved_bytes.all.current)
    );
    drop(weights);
    println!("\n{}", dev.memory_summary());
    Ok(())
}
