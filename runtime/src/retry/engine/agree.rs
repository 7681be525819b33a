//! The ranks' agreement on each attempt's status and plan (skipped with one process).

use crate::retry::consensus::ConsensusError;
use crate::retry::decision::Status;
use crate::retry_report::{BatchPlan, StopReason};

use super::config::RetryEngine;

/// What every rank sends after an attempt (see [`encode`]).
pub(super) type Vote = [u64; crate::retry::VOTE_WORDS];

/// The agreement on an attempt: the worst status, the smallest plan, and whether a rank that
/// keeps every row meets a plan that drops some.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Agreed {
    pub(super) status: Status,
    pub(super) plan: BatchPlan,
    /// [`StopReason::RanksDisagreeOnRows`] when the smallest plan drops rows while some rank's
    /// policy keeps every row: every rank stops.
    pub(super) rows_conflict: Option<StopReason>,
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
                rows_conflict: None,
            });
        }
        let keeps = self.inner.policy.keeps_rows();
        let mut v = encode(status, &plan, batch, keeps);
        self.inner.consensus.all_reduce_max(&mut v)?;
        let dropped = dropped_rows(v[2], batch);
        Ok(Agreed {
            status: v[0],
            plan: decode(&v, batch),
            rows_conflict: (v[3] == 1 && dropped > 0)
                .then_some(StopReason::RanksDisagreeOnRows { dropped }),
        })
    }
}

/// `[status, u64::MAX - micro_batch, share of the batch dropped, keeps every row]`: the max over
/// ranks is the worst status, the smallest micro-batch, the largest share of its batch a rank
/// drops (in 2^-32 units: ranks whose batches differ each drop that share of their own, not a
/// count — a 40-row rank beside a 100-row one that dropped 50 ran 1 row), and whether any rank
/// keeps every row.
fn encode(status: u64, plan: &BatchPlan, batch: usize, keeps_rows: bool) -> Vote {
    let dropped = (batch - plan.batch()) as u128;
    [
        status,
        u64::MAX - plan.micro_batch() as u64,
        ((dropped << 32) / batch.max(1) as u128) as u64,
        u64::from(keeps_rows),
    ]
}

/// The rows of its `batch` a rank drops for a share `share` (2^-32 units) of the batch: rounded
/// up, so that ranks with equal batches drop exactly what the rank that proposed it dropped.
fn dropped_rows(share: u64, batch: usize) -> usize {
    (((batch as u128) * (share as u128)).div_ceil(1 << 32)) as usize
}

fn decode(v: &Vote, batch: usize) -> BatchPlan {
    let micro = (u64::MAX - v[1]).max(1) as usize;
    let rows = batch.saturating_sub(dropped_rows(v[2], batch)).max(1);
    BatchPlan::with_micro_batch(rows, micro).expect("rows >= 1 and micro >= 1")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Equal batches: what one rank dropped, every rank drops (the share round-trips to the
    /// count); other batches drop the same share of theirs, rounded up.
    #[test]
    fn a_dropped_share_round_trips_and_scales() {
        for batch in [1usize, 2, 3, 7, 100, 1_000, 65_537, 4_000_000] {
            for kept in [1, batch / 3, batch / 2, batch - 1, batch] {
                let kept = kept.max(1);
                let plan = BatchPlan::whole(kept).unwrap();
                let v = encode(0, &plan, batch, false);
                assert_eq!(decode(&v, batch).batch(), kept, "{kept} of {batch}");
            }
        }
        let half = encode(0, &BatchPlan::whole(50).unwrap(), 100, false);
        assert_eq!(decode(&half, 40).batch(), 20);
        assert_eq!(decode(&half, 7).batch(), 3);
    }
}
