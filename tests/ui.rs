//! Compile-time checks of the attribute macros (trybuild): misuse fails at the offending token;
//! every supported function shape compiles.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/fail/*.rs");
    t.pass("tests/ui/pass/*.rs");
}
