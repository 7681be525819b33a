//! Quickstart: buffers on a (simulated or real) GPU, an out-of-memory turned into an explained
//! error, `empty_cache`, `no_grad` lowering the peak memory of a forward pass (measured with a
//! peak scope), and `memory_summary`.
//!
//! ```text
//! cargo run --example quickstart                       # simulated 8 GiB device
//! cargo run --example quickstart -- --device cuda:0    # a real GPU
//! ```

use oomguard::{is_grad_enabled, no_grad, AllocatorConfig, ByteSize, Device, DeviceBuffer, Error};

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

    // A forward pass keeps each layer's input for backward only when grad mode is on; under
    // `no_grad` an activation is dropped as soon as the next one exists.
    let with_grad = {
        let scope = dev.peak_scope();
        drop(forward(&dev)?);
        scope.peak_bytes()
    };
    let without_grad = {
        let scope = dev.peak_scope();
        let _g = no_grad(); // restored on drop, also if forward panics
        drop(forward(&dev)?);
        scope.peak_bytes()
    };
    println!(
        "peak memory of an 8-layer forward pass: {} with grad, {} under no_grad",
        ByteSize(with_grad),
        ByteSize(without_grad)
    );

    println!("\n{}", dev.memory_summary());
    Ok(())
}

/// A toy 8-layer forward pass over 1 MiB activations (64 rows × 4096 floats).
fn forward(dev: &Device) -> Result<Vec<DeviceBuffer<f32>>, Error> {
    let mut saved = Vec::new();
    let mut x = dev.zeros::<f32>(64 * 4096)?;
    for _layer in 0..8 {
        let y = dev.zeros::<f32>(64 * 4096)?; // y = relu(x · W) on a real model
        if is_grad_enabled() {
            saved.push(x); // backward needs it
        }
        x = y;
    }
    saved.push(x);
    Ok(saved)
}
