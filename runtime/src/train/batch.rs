//! The rows of a batch, from its tensors' shapes.

/// The rows of a batch given its tensors' shapes: dimension 0 is the row, and every tensor
/// must have the same number of them. The error says which tensor disagrees, with both shapes
/// (a batch with targets for fewer rows than its inputs is refused, never trained on in part).
///
/// ```
/// use oomguard_runtime::train::batch_rows;
/// assert_eq!(batch_rows(&[&[8, 4], &[8, 1]]), Ok(8));
/// let e = batch_rows(&[&[8, 4], &[10, 1]]).unwrap_err();
/// assert!(e.contains("tensor 1 has shape [10, 1]"), "{e}");
/// assert!(batch_rows(&[]).is_err());
/// assert!(batch_rows(&[&[]]).is_err()); // a scalar has no rows
/// ```
pub fn batch_rows(shapes: &[&[usize]]) -> Result<usize, String> {
    let Some(first) = shapes.first() else {
        return Err(
            "no tensor given for the batch: pass the batch's tensors (e.g. `&[&x, &y]`), \
                    whose dimension 0 is the row"
                .into(),
        );
    };
    let Some(&rows) = first.first() else {
        return Err("the batch's first tensor is a scalar: dimension 0 must be the row".into());
    };
    for (i, shape) in shapes.iter().enumerate() {
        if shape.first() != Some(&rows) {
            return Err(format!(
                "the batch's tensors disagree on their rows (dimension 0): tensor 0 has shape \
                 {first:?}, tensor {i} has shape {shape:?}"
            ));
        }
    }
    Ok(rows)
}

/// Checks that a tensor of `shape` is a whole batch of `batch` rows (dimension 0), as splitting
/// it by a plan of that batch needs: fewer rows would fail in the slicing, more would train on
/// part of the data.
///
/// ```
/// use oomguard_runtime::train::rows_match;
/// assert!(rows_match(&[8, 4], 8).is_ok());
/// assert!(rows_match(&[5, 4], 8).unwrap_err().contains("5 rows"));
/// ```
pub fn rows_match(shape: &[usize], batch: usize) -> Result<(), String> {
    let rows = shape.first().copied().unwrap_or(0);
    if shape.is_empty() || rows != batch {
        return Err(format!(
            "a tensor of shape {shape:?} has {rows} rows; the plan splits a batch of {batch}"
        ));
    }
    Ok(())
}
