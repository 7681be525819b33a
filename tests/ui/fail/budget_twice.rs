use oomguard::memory_budget;

#[memory_budget("1 GiB", fraction = 0.5)]
fn step() {}

fn main() {}
