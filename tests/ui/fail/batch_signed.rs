use oomguard::{no_grad, oom_retry, Error};

#[oom_retry(batch = rows)]
#[no_grad]
fn signed(rows: i32) -> Result<i32, Error> {
    Ok(rows)
}

#[oom_retry(batch = rows)]
#[no_grad]
fn wide(rows: u128) -> Result<u128, Error> {
    Ok(rows)
}

fn main() {}
