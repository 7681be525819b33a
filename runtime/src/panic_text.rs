//! What a caught panic says: for the framework crates that read an out-of-memory in it (tch's
//! plain methods and cubecl unwrap their errors, so the error reaches Rust as a panic message),
//! and for every other `catch_unwind` here (the CUDA backend's open, the fuzzing support).
//! Public as `retry::advanced::{panic_text, UNWRAP}`.

use std::any::Any;

/// The message of `Result::unwrap` on an error, followed by the error's `Debug`.
pub const UNWRAP: &str = "called `Result::unwrap()` on an `Err` value: ";

/// The text of a panic's payload: a `&'static str` or a `String` (what `panic!` and `unwrap`
/// give); `None` for any other payload.
pub fn panic_text(payload: &(dyn Any + Send)) -> Option<&str> {
    payload
        .downcast_ref::<&'static str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_both_kinds_of_message_and_nothing_else() {
        let of = |p: Box<dyn Any + Send>| panic_text(p.as_ref()).map(str::to_owned);
        assert_eq!(of(Box::new("static")).as_deref(), Some("static"));
        assert_eq!(
            of(Box::new(String::from("owned"))).as_deref(),
            Some("owned")
        );
        assert_eq!(of(Box::new(7_u32)), None);
    }
}
