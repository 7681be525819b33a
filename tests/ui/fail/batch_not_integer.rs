use oomguard::oom_retry;

#[oom_retry(batch = rows)]
fn step(rows: f32) -> Result<f32, oomguard::Error> {
    Ok(rows)
}

fn main() {}
