use oomguard::oom_retry;

struct Batch(Vec<f32>);

#[oom_retry]
fn step(data: Batch) -> Result<usize, oomguard::Error> {
    Ok(data.0.len())
}

fn main() {}
