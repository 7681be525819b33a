//! The ranks' agreement on each attempt's status and plan (skipped with one process).

use crate::retry::consensus::ConsensusError;
use crate::retry::decision::Status;
use crate::retry_report::BatchPlan;

use super::config::RetryEngine;

/// What every rank sends after an attempt (see [`encode`]).
pub(super) type Vote = [u64; crate::retry::VOTE_WORDS];

/// The agreement on an attempt: the worst status, the smallest plan, and whether a rank that
/// keeps every row meets a plan that drops some.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Agreed {
    pub(super) status: Status,
    pub(super) plan: BatchPlan,
    /// Rows the smallest plan drops while some rank's policy keeps every row (`0`: none).
    pub(super) rows_conflict: usize,
}

impl RetryEngine {
    pub(super) fn agree(&self, values: &mut Vote) -> Result<(), ConsensusError> {
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
    ) -> Result<Agreed, ConsensusError> {
        if self.inner.consensus.world_size() <= 1 {
            return Ok(Agreed {
                status,
                plan,
                rows_conflict: 0,
            });
        }
        let keeps = self.inner.policy.keeps_rows();
        let mut v = encode(status, &plan, batch, keeps);
        self.inner.consensus.all_reduce_max(&mut v)?;
        let dropped = v[2] as usize;
        Ok(Agreed {
            status: v[0],
            plan: decode(&v, batch),
            rows_conflict: if v[3] == 1 { dropped } else { 0 },
        })
    }
}

/// `[status, u64::MAX - micro_batch, rows dropped, keeps every row]`: the max over ranks is the
/// worst status, the smallest micro-batch and batch, and whether any rank keeps every row.
fn encode(status: u64, plan: &BatchPlan, batch: usize, keeps_rows: bool) -> Vote {
    [
        status,
        u64::MAX - plan.micro_batch() as u64,
        (batch - plan.batch()) as u64,
        u64::from(keeps_rows),
    ]
}

fn decode(v: &Vote, batch: usize) -> BatchPlan {
    let micro = (u64::MAX - v[1]).max(1) as usize;
    let rows = batch.saturating_sub(v[2] as usize).max(1);
    BatchPlan::with_micro_batch(rows, micro).expect("rows >= 1 and micro >= 1")
}
