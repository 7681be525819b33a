//! The README's candle examples, compiled and run: `readme_candle/example.rs` is the block under
//! the `readme-candle:` marker, `readme_candle/cpu_oom.rs` the one under `readme-candle-cpu:`,
//! and this test checks that each pair is the same text.

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

const README: &str = include_str!("../../README.md");

/// The first rust block after `marker`.
fn readme_block(marker: &str) -> &'static str {
    let start = README
        .find(marker)
        .unwrap_or_else(|| panic!("the README has a {marker} block"));
    let code = &README[start..];
    let code = &code[code.find("```rust\n").expect("a rust block") + "```rust\n".len()..];
    &code[..code.find("```").expect("the block ends")]
}

#[test]
fn readme_blocks_are_the_tested_files() {
    for (marker, file, text) in [
        (
            "<!-- readme-candle:",
            "example.rs",
            include_str!("readme_candle/example.rs"),
        ),
        (
            "<!-- readme-candle-cpu:",
            "cpu_oom.rs",
            include_str!("readme_candle/cpu_oom.rs"),
        ),
    ] {
        assert_eq!(
            readme_block(marker).trim(),
            text.trim(),
            "README.md's {marker} block and candle/tests/readme_candle/{file} differ: keep them equal"
        );
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
