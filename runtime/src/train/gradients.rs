//! The text naming parameters that got no gradient.

/// At most this many names are listed in one error (the count says how many there are).
pub const NAMED: usize = 8;

/// `names` joined by `, `, at most [`NAMED`] of them, then `, ... (N more)`.
///
/// ```
/// use oomguard_runtime::train::name_list;
/// assert_eq!(name_list(&["a", "b"]), "a, b");
/// let many: Vec<String> = (0..10).map(|i| format!("p{i}")).collect();
/// assert!(name_list(&many).ends_with("p7, ... (2 more)"));
/// ```
pub fn name_list(names: &[impl AsRef<str>]) -> String {
    let mut list: Vec<&str> = names.iter().take(NAMED).map(AsRef::as_ref).collect();
    let more = names.len().saturating_sub(NAMED);
    let more = format!("... ({more} more)");
    if names.len() > NAMED {
        list.push(&more);
    }
    list.join(", ")
}

/// The error text of a step whose backward left `missing` of its `trained` parameters without
/// a gradient (the names, in the framework's words: a path, a shape). The framework crate adds
/// what usually causes it and how to freeze a parameter on purpose.
///
/// ```
/// use oomguard_runtime::train::missing_gradients;
/// let t = missing_gradients(&["fc2.bias"], 4);
/// assert_eq!(t, "no gradient reached 1 of the 4 trained variables in this step: fc2.bias");
/// ```
pub fn missing_gradients(missing: &[impl AsRef<str>], trained: usize) -> String {
    format!(
        "no gradient reached {} of the {trained} trained variables in this step: {}",
        missing.len(),
        name_list(missing)
    )
}
