use std::future::Future;

use oomguard::{memory_budget, no_grad};

// The guards would hold only while the call makes the future: refused (write an `async fn`).
#[no_grad]
fn eval() -> impl Future<Output = bool> {
    async { oomguard::is_grad_enabled() }
}

#[memory_budget("1 MiB")]
fn load() -> impl std::future::Future<Output = ()> + Send {
    async {}
}

fn main() {}
