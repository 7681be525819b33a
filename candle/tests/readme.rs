//! The README's candle examples, compiled and run: `readme_candle/example.rs` is the block under
//! the `readme-candle:` marker, `readme_candle/cpu_oom.rs` the one under `readme-candle-cpu:`
//! (the root's `tests/readme_blocks.rs` checks that each pair is the same text).

mod example {
    include!("readme_candle/example.rs");
    pub fn run() -> Result<(), Box<dyn std::error::Error>> {
        main()
    }
}

mod cpu_oom {
    include!("readme_candle/cpu_oom.rs");
    pub fn run() -> Result<(), Box<dyn std::error::Error>> {
        main()
    }
}

#[test]
fn readme_example_runs() {
    example::run().unwrap();
}

#[test]
fn readme_cpu_oom_recipe_runs() {
    cpu_oom::run().unwrap();
}
