use oomguard::memory_budget;

#[memory_budget(fraction = 1e-300)]
fn step() {}

fn main() {}
