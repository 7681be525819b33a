use oomguard::oom_retry;

#[oom_retry(batch = rows, plan = rows)]
fn step(rows: usize) -> Result<usize, oomguard::Error> {
    Ok(rows)
}

fn main() {}
