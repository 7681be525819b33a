//! The ranks' agreement on each attempt's status and plan (skipped with one process).

use crate::retry::consensus::ConsensusError;
use crate::retry::decision::Status;
use crate::retry::memory::MemoryKey;
use crate::retry::VOTE_WORDS;
use crate::retry_report::{BatchPlan, StepMode, StopReason};

use super::config::RetryEngine;

/// What every rank sends after an attempt (see [`encode`]).
pub(super) type Vote = [u64; VOTE_WORDS];

/// A vote that only says "this rank fails" (a loop dropped, an empty batch): the other words
/// are 0, which changes nothing in a maximum.
pub(super) const FAILED_VOTE: Vote = {
    let mut v = [0; VOTE_WORDS];
    v[0] = crate::retry::decision::FATAL;
    v
};

/// The agreement on an attempt: the worst status, the smallest plan, and whether the ranks
/// cannot go on together.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Agreed {
    pub(super) status: Status,
    pub(super) plan: BatchPlan,
    /// Why every rank stops although none gave up: [`StopReason::RanksAtDifferentSteps`] when
    /// the ranks came from different steps; [`StopReason::RanksDisagreeOnRows`] when the
    /// smallest plan drops rows while some rank's policy keeps every row.
    pub(super) conflict: Option<StopReason>,
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
        key: &MemoryKey,
    ) -> Result<Agreed, ConsensusError> {
        if self.inner.consensus.world_size() <= 1 {
            return Ok(Agreed {
                status,
                plan,
                conflict: None,
            });
        }
        let keeps = self.inner.policy.keeps_rows();
        let sent = encode(status, &plan, batch, keeps, step_tag(&key.site, key.mode));
        let mut v = sent;
        self.inner.consensus.all_reduce_max(&mut v)?;
        if v.iter().zip(&sent).any(|(agreed, own)| agreed < own) {
            // a maximum over the ranks is never below this rank's own value: the ranks would go
            // different ways (one commits, another retries)
            return Err(ConsensusError(format!(
                "the consensus returned {v:?} for this rank's {sent:?}: a value below this \
                 rank's own, so it does not take the maximum over the ranks (a minimum, a sum \
                 that wrapped, a broadcast?); `Consensus::all_reduce_max` must; every rank stops"
            )));
        }
        let dropped = dropped_rows(v[2], batch);
        // max(tag) is !max(!tag) = min(tag) only when every rank sent the same tag
        let conflict = if v[4] != !v[5] {
            Some(StopReason::RanksAtDifferentSteps)
        } else if v[3] == 1 && dropped > 0 {
            Some(StopReason::RanksDisagreeOnRows { dropped })
        } else {
            None
        };
        Ok(Agreed {
            status: v[0],
            plan: decode(&v, batch),
            conflict,
        })
    }
}

/// `[status, u64::MAX - micro_batch, share of the batch dropped, keeps every row, tag, !tag]`:
/// the max over ranks is the worst status, the smallest micro-batch of a rank that splits its
/// rows (a plan of one pass sends 0: it limits no one, so a 7-row rank beside a 100-row one
/// split in 4 × 25 no longer made that one run 15 micro-batches of 7), the largest share of its
/// batch a rank drops (in 2^-32 units: ranks whose batches differ each drop that share of their
/// own, not a count — a 40-row rank beside a 100-row one that dropped 50 ran 1 row), whether any
/// rank keeps every row, and the largest and (complemented) smallest step tag.
fn encode(status: u64, plan: &BatchPlan, batch: usize, keeps_rows: bool, tag: u64) -> Vote {
    let dropped = (batch - plan.batch()) as u128;
    let micro = if plan.num_chunks() > 1 {
        u64::MAX - plan.micro_batch() as u64
    } else {
        0
    };
    [
        status,
        micro,
        ((dropped << 32) / batch.max(1) as u128) as u64,
        u64::from(keeps_rows),
        tag,
        !tag,
    ]
}

/// The step a vote comes from: its call site and mode, hashed (FNV-1a: the same on every rank
/// and every build of the same source, unlike `std`'s seeded hashers). Of the site's file only
/// its name counts: a dependency's path is where cargo put its source on that host (another
/// `CARGO_HOME` on each node of a job), and the line and column tell the sites apart. The
/// device is left out: each rank has its own.
fn step_tag(site: &str, mode: StepMode) -> u64 {
    let mode = [u8::from(mode == StepMode::Train)];
    let name = site.rsplit(['/', '\\']).next().unwrap_or(site);
    name.as_bytes()
        .iter()
        .chain(&mode)
        .fold(0xcbf2_9ce4_8422_2325, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
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
                let v = encode(0, &plan, batch, false, 7);
                assert_eq!(decode(&v, batch).batch(), kept, "{kept} of {batch}");
            }
        }
        let half = encode(0, &BatchPlan::whole(50).unwrap(), 100, false, 7);
        assert_eq!(decode(&half, 40).batch(), 20);
        assert_eq!(decode(&half, 7).batch(), 3);
    }

    /// Another site or mode is another tag; the same step gives the same tag.
    #[test]
    fn steps_differ_in_tag_by_site_and_mode() {
        let a = step_tag("src/main.rs:10:5", StepMode::Train);
        assert_eq!(a, step_tag("src/main.rs:10:5", StepMode::Train));
        assert_ne!(a, step_tag("src/main.rs:10:6", StepMode::Train));
        assert_ne!(a, step_tag("src/main.rs:10:5", StepMode::Eval));
        // a dependency built under another CARGO_HOME on another node: the same step
        let dep = |home: &str| format!("{home}/registry/src/index/trainer-1.0/src/step.rs:40:9");
        assert_eq!(
            step_tag(&dep("/home/a/.cargo"), StepMode::Train),
            step_tag(&dep("/opt/cargo"), StepMode::Train)
        );
        assert_eq!(
            step_tag("C:\\cargo\\trainer\\src\\step.rs:40:9", StepMode::Train),
            step_tag(&dep("/opt/cargo"), StepMode::Train)
        );
    }
}
