//! The ranks' agreement on each attempt's status and plan (skipped with one process).

use crate::retry::consensus::ConsensusError;
use crate::retry::decision::Status;
use crate::retry_report::BatchPlan;

use super::config::RetryEngine;

impl RetryEngine {
    pub(super) fn agree(&self, values: &mut [u64; 3]) -> Result<(), ConsensusError> {
        if self.inner.consensus.world_size() > 1 {
            self.inner.consensus.all_reduce_max(values)?;
        }
        Ok(())
    }

    /// The worst status of every rank and the smallest plan (`status` and `plan` as they are
    /// with one process: nothing to agree with).
    pub(super) fn agree_on(
        &self,
        status: Status,
        plan: BatchPlan,
        batch: usize,
    ) -> Result<(Status, BatchPlan), ConsensusError> {
        if self.inner.consensus.world_size() <= 1 {
            return Ok((status, plan));
        }
        let mut v = encode(status, &plan, batch);
        self.inner.consensus.all_reduce_max(&mut v)?;
        Ok((v[0], decode(&v, batch)))
    }
}

/// `[status, u64::MAX - micro_batch, rows dropped]`: the max over ranks is the worst status and
/// the smallest micro-batch and batch.
fn encode(status: u64, plan: &BatchPlan, batch: usize) -> [u64; 3] {
    [
        status,
        u64::MAX - plan.micro_batch() as u64,
        (batch - plan.batch()) as u64,
    ]
}

fn decode(v: &[u64; 3], batch: usize) -> BatchPlan {
    let micro = (u64::MAX - v[1]).max(1) as usize;
    let rows = batch.saturating_sub(v[2] as usize).max(1);
    BatchPlan::with_micro_batch(rows, micro).expect("rows >= 1 and micro >= 1")
}
