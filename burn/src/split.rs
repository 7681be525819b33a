//! Batch splitting: the rows of a [`Chunk`] of a [`BatchPlan`] (`narrow` on dimension 0).

use burn::tensor::backend::Backend;
use burn::tensor::{BasicOps, Tensor};
use oomguard::retry::{BatchPlan, Chunk};

use crate::Error;

/// The batch a chunk belongs to (`len / weight`, exact for any batch below 2^52 rows).
fn batch_of(chunk: &Chunk) -> usize {
    (chunk.len() as f64 / chunk.weight()).round() as usize
}

/// The rows of `chunk` in `t` (dimension 0): `t.narrow(0, chunk.start(), chunk.len())`.
///
/// `t` must be the whole batch: an [`Error::Rows`], not a panic, when its first dimension is not
/// the plan's batch (fewer rows would panic in `narrow`; more would silently train on part of
/// the data).
pub fn chunk_rows<B, const D: usize, K>(
    t: &Tensor<B, D, K>,
    chunk: &Chunk,
) -> Result<Tensor<B, D, K>, Error>
where
    B: Backend,
    K: BasicOps<B>,
{
    let dims = t.dims();
    let batch = batch_of(chunk);
    if let Err(e) = oomguard::train::rows_match(&dims, batch) {
        return Err(Error::Rows(format!("{e} (chunk rows {:?})", chunk.rows())));
    }
    Ok(t.clone().narrow(0, chunk.start(), chunk.len()))
}

/// Splits `t` by `plan`: one tensor per chunk, in order. `t` must have exactly `plan.batch()`
/// rows ([`Error::Rows`] otherwise).
pub fn split_rows<B, const D: usize, K>(
    t: &Tensor<B, D, K>,
    plan: &BatchPlan,
) -> Result<Vec<Tensor<B, D, K>>, Error>
where
    B: Backend,
    K: BasicOps<B>,
{
    plan.chunks().map(|c| chunk_rows(t, &c)).collect()
}
