//! Every README block that a framework crate compiles and runs is the file that crate tests: a
//! `<!-- readme-NAME: ... (a copy in PATH) -->` marker names the file, and the first rust block
//! after the marker must be its text. The framework crates' `tests/readme.rs` run those files;
//! this one test keeps every copy equal, for every framework, whether or not it is built here.

use std::path::Path;

const README: &str = include_str!("../README.md");
const COPY_IN: &str = "(a copy in ";

/// `(marker line, path, block)` for every `<!-- readme-` marker.
fn marked_blocks() -> Vec<(&'static str, &'static str, &'static str)> {
    let mut out = Vec::new();
    for (at, _) in README.match_indices("<!-- readme-") {
        let line = README[at..].lines().next().unwrap_or_default();
        let path = line
            .split_once(COPY_IN)
            .and_then(|(_, rest)| rest.split_once(')'))
            .map(|(path, _)| path)
            .unwrap_or_else(|| panic!("README marker names no copy ({COPY_IN}PATH)): {line}"));
        let code = &README[at..];
        let start = code
            .find("```rust\n")
            .unwrap_or_else(|| panic!("no rust block after {line}"))
            + "```rust\n".len();
        let code = &code[start..];
        let block = &code[..code.find("```").expect("the block ends")];
        out.push((line, path, block));
    }
    out
}

#[test]
fn every_marked_readme_block_is_its_tested_file() {
    let blocks = marked_blocks();
    // candle (2), burn, tch: a marker that lost its text would drop a block from the check.
    assert!(blocks.len() >= 4, "{} marked blocks", blocks.len());
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for (line, path, block) in blocks {
        let file = std::fs::read_to_string(root.join(path))
            .unwrap_or_else(|e| panic!("{path}, named by {line}: {e}"));
        assert_eq!(
            block.trim(),
            file.trim(),
            "README.md's block under {line} and {path} differ: keep them equal"
        );
    }
}
