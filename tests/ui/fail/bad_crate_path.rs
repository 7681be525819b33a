use oomguard::no_grad;

#[no_grad(crate = "not a path")]
fn step() {}

fn main() {}
