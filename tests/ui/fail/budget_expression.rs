use oomguard::memory_budget;

struct Trainer {
    budget: u64,
}

impl Trainer {
    #[memory_budget(self.budget)]
    fn step(&self) {}
}

#[memory_budget(budget)]
fn step(budget: u64) {
    let _ = budget;
}

fn main() {}
