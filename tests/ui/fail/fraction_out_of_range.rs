use oomguard::memory_budget;

#[memory_budget(fraction = 1.5)]
fn step() {}

#[memory_budget(fraction = 0.0)]
fn other() {}

fn main() {}
