use oomguard::{leak_check, Error};

#[leak_check(action = "error")]
fn step() -> Result<(), Error> {
    Ok(())
}

fn main() {}
