//! The README's "With burn" example, compiled and run: `readme_burn/example.rs` is the block
//! under the `readme-burn` marker (the root's `tests/readme_blocks.rs` checks that the two are the
//! same text).

mod example {
    include!("readme_burn/example.rs");
    pub fn run() -> Result<(), Box<dyn std::error::Error>> {
        main()
    }
}

#[test]
fn readme_example_runs() {
    example::run().unwrap();
}
