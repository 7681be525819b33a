use oomguard::leak_check;

#[leak_check(allow = 1024)]
fn step() {}

#[leak_check(allow = "lots")]
fn other() {}

fn main() {}
