//! Shared helpers of the integration tests.
#![allow(dead_code)]

use std::path::PathBuf;

/// The real traces: `$OOMGUARD_TRACES_DIR` when set, else the copy in the repository's `traces/`
/// (a fresh clone needs nothing beside it). A test binary run elsewhere than where it was built
/// (the GPU machine runs staged binaries from `.gpu/bin` in a copy of the tree) finds `traces/`
/// in its working directory or a parent of it.
pub fn traces_dir() -> PathBuf {
    if let Ok(d) = std::env::var("OOMGUARD_TRACES_DIR") {
        return PathBuf::from(d);
    }
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../traces");
    if built.join("pytorch_figures.json").exists() {
        return built;
    }
    let cwd = std::env::current_dir().unwrap_or_default();
    cwd.ancestors()
        .map(|d| d.join("traces"))
        .find(|d| d.join("pytorch_figures.json").exists())
        .unwrap_or(built)
}

/// The trace names and their figures, from `pytorch_figures.json`.
pub fn figures() -> serde_json::Value {
    let text = std::fs::read_to_string(traces_dir().join("pytorch_figures.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// A scratch directory for one test, named after `name`, removed (with its contents) when it
/// drops, so repeated runs do not fill the temporary directory.
pub fn scratch(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("oomguard-cli-test-{name}-"))
        .tempdir()
        .unwrap()
}
