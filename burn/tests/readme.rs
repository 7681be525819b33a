//! The README's "With burn" example, compiled and run: `readme_burn/example.rs` is the block
//! under the `readme-burn` marker, and this test checks that the two are the same text.

mod example {
    include!("readme_burn/example.rs");
    pub fn run() -> Result<(), Box<dyn std::error::Error>> {
        main()
    }
}

const README: &str = include_str!("../../README.md");
const EXAMPLE: &str = include_str!("readme_burn/example.rs");

fn readme_block() -> &'static str {
    let start = README
        .find("<!-- readme-burn:")
        .expect("the README has a readme-burn block");
    let code = &README[start..];
    let code = &code[code.find("```rust\n").expect("a rust block") + "```rust\n".len()..];
    &code[..code.find("```").expect("the block ends")]
}

#[test]
fn readme_block_is_the_tested_file() {
    assert_eq!(
        readme_block().trim(),
        EXAMPLE.trim(),
        "README.md's burn block and burn/tests/readme_burn/example.rs differ: keep them equal"
    );
}

#[test]
fn readme_example_runs() {
    example::run().unwrap();
}
