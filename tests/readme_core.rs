//! The README's first block (marked `readme-core`), compiled and run: its copy is
//! `tests/readme_core/quick.rs`, kept equal to the README by `tests/readme_blocks.rs`.

include!("readme_core/quick.rs");

#[test]
fn the_readme_first_block_runs() {
    main().unwrap();
}
