use oomguard::memory_budget;

#[memory_budget("2 GiX")]
fn step() {}

fn main() {}
