//! The batch's mean loss from its chunks' mean losses, and the check that a chunk's loss is one
//! value.

use std::ops::Range;

use crate::retry::Chunk;

/// Checks that a chunk's loss is one value (`elements == 1`), as the weighting needs: each
/// chunk's gradients are weighted by its share of the batch, which turns per-chunk *means* into
/// the batch's mean. Per-row losses (or a sum) would make the update depend on how an
/// out-of-memory split the batch. `example` names the framework's way to take the mean (e.g.
/// ``"`.mean_all()`"``), quoted in the error.
///
/// ```
/// use oomguard_runtime::train::one_value;
/// assert!(one_value(1, &[], 0..4, "`.mean()`").is_ok());
/// let e = one_value(8, &[8], 0..8, "`.mean()`").unwrap_err();
/// assert!(e.contains("shape [8]") && e.contains("per-row mean"), "{e}");
/// ```
pub fn one_value(
    elements: usize,
    shape: &[usize],
    chunk: Range<usize>,
    example: &str,
) -> Result<(), String> {
    if elements == 1 {
        return Ok(());
    }
    Err(format!(
        "the loss of chunk {chunk:?} has {elements} elements (shape {shape:?}): give the \
         chunk's per-row mean loss, one value (e.g. {example}); per-row losses or a sum would \
         make the update depend on how the batch was split"
    ))
}

/// The weighted sum of the chunks' mean losses of one attempt (the batch's mean loss, in `f64`)
/// and the rows they cover, checked to come from one batch and, at the end, to cover it.
///
/// ```
/// use oomguard_runtime::retry::BatchPlan;
/// use oomguard_runtime::train::LossSum;
/// let plan = BatchPlan::with_micro_batch(10, 4)?; // 4 + 3 + 3 rows
/// let mut sum = LossSum::new();
/// for (c, mean) in plan.chunks().zip([1.0, 2.0, 3.0]) {
///     sum.admit(&c)?;
///     sum.add_mean(&c, mean);
/// }
/// sum.covers_batch()?;
/// assert!((sum.loss() - (4.0 * 1.0 + 3.0 * 2.0 + 3.0 * 3.0) / 10.0).abs() < 1e-12);
/// assert_eq!(sum.rows(), 10);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LossSum {
    loss: f64,
    rows: usize,
    batch: Option<usize>,
}

impl LossSum {
    /// An empty sum.
    pub fn new() -> Self {
        Self::default()
    }

    /// Checks that `chunk` belongs to the batch of the chunks admitted before (the first one
    /// sets it). Call it before the chunk's backward, so that a foreign chunk adds nothing.
    pub fn admit(&mut self, chunk: &Chunk) -> Result<(), String> {
        match self.batch {
            Some(b) if b != chunk.batch() => Err(format!(
                "a chunk of a batch of {} rows added to an accumulator of a batch of {b} rows",
                chunk.batch()
            )),
            _ => {
                self.batch = Some(chunk.batch());
                Ok(())
            }
        }
    }

    /// Adds the chunk's mean loss, weighted by its share of the batch (`chunk.weight()`), and
    /// its rows.
    pub fn add_mean(&mut self, chunk: &Chunk, mean_loss: f64) {
        self.add_weighted(chunk, mean_loss * chunk.weight());
    }

    /// Adds a loss already weighted by the chunk's share (read from the weighted loss the
    /// backward ran on), and the chunk's rows.
    pub fn add_weighted(&mut self, chunk: &Chunk, weighted_loss: f64) {
        self.loss += weighted_loss;
        self.rows += chunk.len();
    }

    /// The batch's mean loss so far.
    pub fn loss(&self) -> f64 {
        self.loss
    }

    /// Rows added so far.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The batch of the admitted chunks (`None` before the first).
    pub fn batch(&self) -> Option<usize> {
        self.batch
    }

    /// Checks that the chunks added cover their whole batch (every chunk of the plan ran).
    pub fn covers_batch(&self) -> Result<(), String> {
        match self.batch {
            Some(batch) if self.rows != batch => Err(format!(
                "only {} of the batch's {batch} rows were backpropagated: every chunk of the \
                 plan must be",
                self.rows
            )),
            _ => Ok(()),
        }
    }
}
