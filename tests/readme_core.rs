//! The README's blocks marked `readme-core` and `readme-core-steps`, compiled and run: their
//! copies are in `tests/readme_core/`, kept equal to the README by `tests/readme_blocks.rs`.

mod quick {
    include!("readme_core/quick.rs");

    #[test]
    fn the_readme_first_block_runs() {
        main().unwrap();
    }
}

mod steps {
    include!("readme_core/steps.rs");

    #[test]
    fn the_readme_step_plan_block_runs() {
        main();
    }
}
