use oomguard::{ByteSize, Device};

fn main() -> Result<(), oomguard::Error> {
    let dev = Device::sim(ByteSize::gib(8));            // or a real GPU (CUDA backend)
    let _x = dev.from_slice(&[1.0f32, 2.0, 3.0])?;      // returned to the cache on drop
    match dev.alloc::<f32>(4 << 30) {                   // 16 GiB: too much
        Err(e) if e.is_oom() => eprintln!("{e}"),       // "out of memory. Tried to allocate 16.00 GiB. Device 0 has ..."
        _ => {}
    }
    println!("{}", dev.memory_summary());
    Ok(())
}
