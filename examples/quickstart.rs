//! Quickstart: buffers on a (simulated or real) GPU, an out-of-memory turned into an explained
//! error, `empty_cache` and `memory_summary`.
//!
//! ```text
//! cargo run --example quickstart                       # simulated 8 GiB device
//! cargo run --example quickstart -- --device cuda:0    # a real GPU
//! ```

use oomguard::{AllocatorConfig, ByteSize, Device, Error};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let device = match args.as_slice() {
        [] => "sim".to_string(),
        [flag, d] if flag == "--device" => d.clone(),
        _ => {
            eprintln!("usage: quickstart [--device sim|cuda:N]");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(&device) {
        eprintln!("quickstart: {e}");
        std::process::exit(1);
    }
}

/// `sim` (a simulated 8 GiB GPU) or `cuda:N`. `OOMGUARD_ALLOC_CONF` configures the allocator as
/// PyTorch's `PYTORCH_CUDA_ALLOC_CONF` does.
fn open(device: &str) -> Result<Device, Error> {
    let config = AllocatorConfig::from_env()?;
    if device == "sim" {
        let sim = oomguard::backend::sim::SimDevice::new(ByteSize::gib(8));
        return Ok(Device::new(sim, config));
    }
    let ordinal = device
        .strip_prefix("cuda:")
        .and_then(|n| n.parse::<usize>().ok())
        .ok_or_else(|| {
            Error::InvalidArgument(format!("unknown device {device:?}; use sim or cuda:N"))
        })?;
    open_cuda(ordinal, config)
}

#[cfg(feature = "cuda")]
fn open_cuda(ordinal: usize, config: AllocatorConfig) -> Result<Device, Error> {
    Device::cuda_with_config(ordinal, config)
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(_: usize, _: AllocatorConfig) -> Result<Device, Error> {
    Err(Error::InvalidArgument(
        "this build has no CUDA support (the `cuda` feature is off)".into(),
    ))
}

fn run(device: &str) -> Result<(), Error> {
    let dev = open(device)?;
    let total = dev.mem_info()?.total;
    println!("device: {} ({} total)", dev.name(), ByteSize(total));

    // Buffers are RAII: dropping one returns its memory to the cache.
    let weights = dev.from_slice(&vec![0.5f32; 1 << 20])?;
    let activations = dev.zeros::<f32>(256 << 20)?; // 1 GiB
    println!(
        "allocated {} in 2 buffers; first weight = {}",
        ByteSize(dev.stats().allocated_bytes.all.current),
        weights.to_vec()?[0]
    );

    // Ask for more than the device has: a typed error that explains itself.
    match dev.alloc::<u8>(total as usize + 1) {
        Ok(_) => println!("unexpected: more than the device's capacity fitted"),
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
