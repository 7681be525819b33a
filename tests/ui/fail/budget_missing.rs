use oomguard::memory_budget;

#[memory_budget]
fn step() {}

fn main() {}
