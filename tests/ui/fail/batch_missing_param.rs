use oomguard::oom_retry;

#[oom_retry(batch = rows)]
fn step(batch_size: usize) -> Result<usize, oomguard::Error> {
    Ok(batch_size)
}

fn main() {}
