//! What a training step did.

use crate::retry::RetryReport;

/// What a `train_step` (oomguard-candle, oomguard-burn, oomguard-tch) did.
#[derive(Debug)]
pub struct TrainedStep {
    /// The batch's mean loss (weighted sum of the chunks' mean losses).
    pub loss: f64,
    /// Rows that contributed to the update: always the whole batch.
    pub rows: usize,
    /// How the step went: plans tried, retries, the plan that worked.
    pub report: RetryReport,
}
