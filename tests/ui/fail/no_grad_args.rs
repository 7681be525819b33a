use oomguard::no_grad;

#[no_grad(always)]
fn step() {}

fn main() {}
