fn main() {
    let dev = oomguard::Device::sim(oomguard::ByteSize::gib(80));
    for _step in 0..100 {
        dev.mark_step(); // once per step, at its start
        // ... the step's forward, backward and optimizer update ...
    }
    println!("{} plans installed", dev.stats().num_plans_installed);
}
