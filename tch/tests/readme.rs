//! The README's tch example, compiled and run: `readme_tch/example.rs` is the block under the
//! `readme-tch:` marker, and this test checks that the two are the same text.

mod example {
    include!("readme_tch/example.rs");
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
fn the_readme_block_is_the_tested_file() {
    assert_eq!(
        readme_block("<!-- readme-tch:"),
        include_str!("readme_tch/example.rs"),
        "README.md's tch example and tch/tests/readme_tch/example.rs differ: copy one to the other"
    );
}

#[test]
fn the_readme_example_runs() {
    example::run().unwrap();
}
