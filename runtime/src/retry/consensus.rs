//! Consensus for data-parallel runs: every rank must run the same plan, or collectives hang.
//!
//! After each attempt the engine all-reduces (max) three numbers over the ranks: a status flag
//! (0 ok, 1 out-of-memory, 2 give up), the number of micro-batches proposed, and how many rows
//! the proposed batch drops. A rank that succeeded proposes its current plan; a rank that hit OOM
//! proposes its policy's next plan. If any rank hit OOM, all ranks discard the attempt (nothing
//! was committed) and run the agreed plan: the maximum of the proposals, so no rank runs a plan
//! larger than the one its own policy chose. The starting plan is agreed the same way.
//!
//! Implement [`Consensus`] over your collective library (an NCCL or Gloo all-reduce of three
//! `u64`s). [`SingleProcess`] is the one-rank case; [`LocalGroup`] runs ranks on threads of one
//! process, for tests.

use std::fmt;
use std::sync::{Arc, Barrier, Mutex};

/// A collective failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("consensus failed: {0}")]
pub struct ConsensusError(pub String);

/// The all-reduce the retry engine needs.
pub trait Consensus: Send + Sync + fmt::Debug {
    /// This rank's index.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// Replaces every element of `values` with its maximum over all ranks. Every rank calls it
    /// with the same number of values, in the same order of calls.
    fn all_reduce_max(&self, values: &mut [u64]) -> Result<(), ConsensusError>;
}

/// One process, one rank: nothing to agree on.
#[derive(Clone, Copy, Debug, Default)]
pub struct SingleProcess;

impl Consensus for SingleProcess {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_reduce_max(&self, _values: &mut [u64]) -> Result<(), ConsensusError> {
        Ok(())
    }
}

#[derive(Debug)]
struct Shared {
    barrier: Barrier,
    slots: Mutex<Vec<Vec<u64>>>,
    sums: Mutex<Vec<Vec<f32>>>,
}

/// In-process ranks that all-reduce through shared memory and a barrier: a fake transport to test
/// multi-rank logic with threads.
///
/// ```
/// use oomguard_runtime::retry::{Consensus, LocalGroup};
/// let ranks = LocalGroup::new(2);
/// let handles: Vec<_> = ranks.into_iter().map(|r| std::thread::spawn(move || {
///     let mut v = [r.rank() as u64, 10 - r.rank() as u64];
///     r.all_reduce_max(&mut v).unwrap();
///     v
/// })).collect();
/// for h in handles { assert_eq!(h.join().unwrap(), [1, 10]); }
/// ```
#[derive(Clone, Debug)]
pub struct LocalGroup {
    rank: usize,
    world: usize,
    shared: Arc<Shared>,
}

impl LocalGroup {
    /// `world` ranks (at least 1); hand one to each thread.
    pub fn new(world: usize) -> Vec<LocalGroup> {
        let world = world.max(1);
        let shared = Arc::new(Shared {
            barrier: Barrier::new(world),
            slots: Mutex::new(vec![Vec::new(); world]),
            sums: Mutex::new(vec![Vec::new(); world]),
        });
        (0..world)
            .map(|rank| LocalGroup {
                rank,
                world,
                shared: Arc::clone(&shared),
            })
            .collect()
    }
}

impl LocalGroup {
    /// Replaces every element of `values` with its sum over all ranks, added in rank order (so
    /// every rank gets the same bits). Every rank calls it with the same number of values.
    pub fn all_reduce_sum_f32(&self, values: &mut [f32]) -> Result<(), ConsensusError> {
        let lock = || self.shared.sums.lock().unwrap_or_else(|e| e.into_inner());
        lock()[self.rank] = values.to_vec();
        self.shared.barrier.wait();
        let result = {
            let sums = lock();
            if sums.iter().any(|s| s.len() != values.len()) {
                Err(ConsensusError(format!(
                    "ranks passed different numbers of values: {:?}",
                    sums.iter().map(Vec::len).collect::<Vec<_>>()
                )))
            } else {
                for (i, v) in values.iter_mut().enumerate() {
                    *v = sums.iter().fold(0.0, |acc, s| acc + s[i]);
                }
                Ok(())
            }
        };
        self.shared.barrier.wait();
        result
    }
}

impl Consensus for LocalGroup {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn all_reduce_max(&self, values: &mut [u64]) -> Result<(), ConsensusError> {
        let lock = || self.shared.slots.lock().unwrap_or_else(|e| e.into_inner());
        lock()[self.rank] = values.to_vec();
        self.shared.barrier.wait();
        let result = {
            let slots = lock();
            if slots.iter().any(|s| s.len() != values.len()) {
                Err(ConsensusError(format!(
                    "ranks passed different numbers of values: {:?}",
                    slots.iter().map(Vec::len).collect::<Vec<_>>()
                )))
            } else {
                for (i, v) in values.iter_mut().enumerate() {
                    *v = slots.iter().map(|s| s[i]).max().unwrap_or(*v);
                }
                Ok(())
            }
        };
        // Nobody writes the next round's values before everyone has read this round's.
        self.shared.barrier.wait();
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_over_three_ranks_several_rounds() {
        let handles: Vec<_> = LocalGroup::new(3)
            .into_iter()
            .map(|r| {
                std::thread::spawn(move || {
                    let mut out = vec![];
                    for round in 0..5u64 {
                        let mut v = [r.rank() as u64 * round, 7, round];
                        r.all_reduce_max(&mut v).unwrap();
                        out.push(v);
                    }
                    out
                })
            })
            .collect();
        for h in handles {
            let out = h.join().unwrap();
            for (round, v) in out.iter().enumerate() {
                let round = round as u64;
                assert_eq!(*v, [2 * round, 7, round]);
            }
        }
        let mut v = [3];
        SingleProcess.all_reduce_max(&mut v).unwrap();
        assert_eq!(v, [3]);
    }

    #[test]
    fn sums_in_rank_order_on_every_rank() {
        let handles: Vec<_> = LocalGroup::new(3)
            .into_iter()
            .map(|r| {
                std::thread::spawn(move || {
                    let mut v = [r.rank() as f32, 0.5, -(r.rank() as f32)];
                    r.all_reduce_sum_f32(&mut v).unwrap();
                    let mut bad = vec![1.0; r.rank() + 1];
                    (v, r.all_reduce_sum_f32(&mut bad).is_err())
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), ([3.0, 1.5, -3.0], true));
        }
    }

    #[test]
    fn mismatched_lengths_are_an_error_not_a_hang() {
        let handles: Vec<_> = LocalGroup::new(2)
            .into_iter()
            .map(|r| {
                std::thread::spawn(move || {
                    let mut v = vec![1; r.rank() + 1];
                    r.all_reduce_max(&mut v)
                })
            })
            .collect();
        for h in handles {
            assert!(h.join().unwrap().is_err());
        }
    }
}
