use oomguard::oom_retry;

struct Trainer;

impl Trainer {
    #[oom_retry]
    fn step(self) -> Result<(), oomguard::Error> {
        Ok(())
    }
}

fn main() {}
