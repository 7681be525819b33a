// A step returning `anyhow::Result` while oomguard's `anyhow` feature is off: the error names
// the feature. The tests build with the feature on (a dev-dependency), so this module stands in
// for the anyhow crate as a user without the feature sees it: an error type with no `IsOom`.
mod anyhow {
    #[derive(Debug)]
    pub struct Error;
    impl std::fmt::Display for Error {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("error")
        }
    }
    pub type Result<T, E = Error> = std::result::Result<T, E>;
}

#[oomguard::oom_retry]
fn step(rows: usize) -> anyhow::Result<usize> {
    Ok(rows)
}

fn main() {}
