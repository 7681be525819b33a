//! The README's tch example, compiled and run: `readme_tch/example.rs` is the block under the
//! `readme-tch:` marker (the root's `tests/readme_blocks.rs` checks that the two are the same
//! text).

mod example {
    include!("readme_tch/example.rs");
    pub fn run() -> Result<(), Box<dyn std::error::Error>> {
        main()
    }
}

#[test]
fn the_readme_example_runs() {
    example::run().unwrap();
}
