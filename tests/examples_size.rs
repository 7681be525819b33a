//! The example each framework crate offers to copy (README: "With candle", "With burn", "With
//! tch") stays short enough to read whole, and CI runs it: a file over the limit, or an example
//! that `.ci/run` no longer runs, fails here.

use std::path::Path;

/// Most lines an example to copy may have, comments included (as `wc -l` counts them).
const MAX_LINES: usize = 100;

/// Each framework's example to copy: its file, and the name `cargo run --example` takes.
const EXAMPLES: [(&str, &str); 3] = [
    (
        "candle/examples/candle_quickstart/main.rs",
        "candle_quickstart",
    ),
    ("burn/examples/burn_quickstart/main.rs", "burn_quickstart"),
    ("tch/examples/tch_quickstart/main.rs", "tch_quickstart"),
];

/// The text of a file of the repository, or why it cannot be read.
fn read(relative: &str) -> Result<String, String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(relative);
    std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))
}

#[test]
fn each_framework_example_fits_in_max_lines() {
    let failing: Vec<String> = EXAMPLES
        .iter()
        .filter_map(|(file, _)| match read(file) {
            Ok(text) if text.lines().count() <= MAX_LINES => None,
            Ok(text) => Some(format!("{file}: {} lines", text.lines().count())),
            Err(e) => Some(e),
        })
        .collect();
    assert!(
        failing.is_empty(),
        "examples over {MAX_LINES} lines (comments included), or missing: {failing:?}"
    );
}

#[test]
fn ci_runs_each_framework_example() {
    let ci = read(".ci/run").expect("CI's script");
    let missing: Vec<&str> = EXAMPLES
        .iter()
        .map(|(_, name)| *name)
        .filter(|name| {
            let run = format!("--example {name}");
            !ci.lines()
                .any(|l| l.trim_start().starts_with("cargo run") && l.contains(&run))
        })
        .collect();
    assert!(
        missing.is_empty(),
        ".ci/run has no `cargo run ... --example NAME` line for {missing:?}"
    );
}
