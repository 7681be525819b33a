//! The rows of a micro-batch: `narrow` on dimension 0.

use candle_core::Tensor;
use oomguard::retry::{BatchPlan, Chunk};

/// The rows of `chunk` in `t` (dimension 0): `t.narrow(0, chunk.start(), chunk.len())`. An
/// error, not a panic, when `t` has fewer rows than the chunk needs. `t` may have more rows
/// than the chunk's batch (e.g. an evaluation whose batch shrank); [`train_step`](crate::train_step)
/// hands its closure the chunk's rows of the batch's tensors itself, so that a training step
/// always covers every row.
pub fn chunk_rows(t: &Tensor, chunk: &Chunk) -> candle_core::Result<Tensor> {
    let rows = t.dims().first().copied().unwrap_or(0);
    if chunk.rows().end > rows {
        return Err(crate::oom::refusal(format!(
            "chunk {:?} needs rows up to {}, but the tensor has {rows} (shape {:?})",
            chunk.rows(),
            chunk.rows().end,
            t.dims()
        )));
    }
    t.narrow(0, chunk.start(), chunk.len())
}

/// Splits each tensor of a batch by `plan`: one `Vec` of tensors per chunk, in order. Every
/// tensor must have exactly `plan.batch()` rows.
pub fn split_rows(tensors: &[&Tensor], plan: &BatchPlan) -> candle_core::Result<Vec<Vec<Tensor>>> {
    for t in tensors {
        oomguard::train::rows_match(t.dims(), plan.batch()).map_err(crate::oom::refusal)?;
    }
    plan.chunks()
        .map(|c| tensors.iter().map(|t| chunk_rows(t, &c)).collect())
        .collect()
}
