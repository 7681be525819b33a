use oomguard::oom_retry;

#[oom_retry]
fn step(rows: usize) -> usize {
    rows
}

#[oom_retry]
fn nothing() {}

fn main() {}
