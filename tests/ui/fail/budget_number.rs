use oomguard::memory_budget;

#[memory_budget(1024)]
fn step() {}

fn main() {}
