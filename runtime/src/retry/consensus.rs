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
//! process, for tests (a rank that panics, leaves or does not come within a timeout makes the
//! others fail with an error naming it, never wait forever).

use std::fmt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

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

/// What a rank brought to the current round.
#[derive(Clone, Debug)]
enum Payload {
    Max(Vec<u64>),
    SumF32(Vec<f32>),
}

impl Payload {
    fn len(&self) -> usize {
        match self {
            Payload::Max(v) => v.len(),
            Payload::SumF32(v) => v.len(),
        }
    }

    /// What a rank called, as an error names it: "6 u64 (max)".
    fn describe(&self) -> String {
        match self {
            Payload::Max(v) => format!("{} u64 (max)", v.len()),
            Payload::SumF32(v) => format!("{} f32 (sum)", v.len()),
        }
    }
}

/// The round's inputs, reduced by the last rank to arrive.
fn reduce(inputs: &[Option<Payload>]) -> Result<Payload, ConsensusError> {
    let ranked: Vec<(usize, &Payload)> = inputs
        .iter()
        .enumerate()
        .filter_map(|(rank, p)| p.as_ref().map(|p| (rank, p)))
        .collect();
    let same_call = ranked.windows(2).all(|w| {
        w[0].1.len() == w[1].1.len()
            && std::mem::discriminant(w[0].1) == std::mem::discriminant(w[1].1)
    });
    if !same_call {
        // Name what each rank called (at most 8): the rank whose call differs is the one that
        // ran a collective the others did not (a commit that failed before its own, a step
        // one rank skipped).
        let mut calls: Vec<String> = ranked
            .iter()
            .take(8)
            .map(|(rank, p)| format!("rank {rank}: {}", p.describe()))
            .collect();
        if ranked.len() > 8 {
            calls.push(format!("{} more", ranked.len() - 8));
        }
        return Err(ConsensusError(format!(
            "ranks made different calls in one round ({}): a rank ran a collective the others \
             did not (a step or a commit that one rank skipped or failed before its own); every \
             rank stops",
            calls.join(", ")
        )));
    }
    let inputs: Vec<&Payload> = ranked.iter().map(|&(_, p)| p).collect();
    let n = inputs.first().map_or(0, |p| p.len());
    match inputs.first() {
        Some(Payload::Max(_)) => {
            let mut out = vec![0u64; n];
            for p in &inputs {
                let Payload::Max(v) = p else {
                    return Err(ConsensusError(
                        "ranks called different collectives (max and sum) in one round".into(),
                    ));
                };
                for (o, x) in out.iter_mut().zip(v) {
                    *o = (*o).max(*x);
                }
            }
            Ok(Payload::Max(out))
        }
        Some(Payload::SumF32(_)) => {
            let mut out = vec![0.0f32; n];
            // in rank order: every rank gets the same bits
            for p in &inputs {
                let Payload::SumF32(v) = p else {
                    return Err(ConsensusError(
                        "ranks called different collectives (max and sum) in one round".into(),
                    ));
                };
                for (o, x) in out.iter_mut().zip(v) {
                    *o += *x;
                }
            }
            Ok(Payload::SumF32(out))
        }
        None => Ok(Payload::Max(Vec::new())),
    }
}

#[derive(Debug)]
struct State {
    /// Rounds completed.
    round: u64,
    /// This round's input of each rank (`None`: not arrived yet).
    inputs: Vec<Option<Payload>>,
    /// The last completed round's result.
    result: Result<Payload, ConsensusError>,
    /// Live handles of each rank (0: the rank left the group).
    handles: Vec<usize>,
    /// Why the group can no longer agree (a rank panicked, timed out): every call fails.
    poisoned: Option<String>,
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    timeout: Duration,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Brings `rank`'s `input` to the current round and waits for every other rank's; the
    /// reduced result, or why the round cannot complete.
    fn exchange(&self, rank: usize, input: Payload) -> Result<Payload, ConsensusError> {
        let mut st = self.lock();
        if let Some(why) = &st.poisoned {
            return Err(ConsensusError(why.clone()));
        }
        if st.inputs[rank].is_some() {
            // Two threads with handles of one rank in one round (two loops sharing a group):
            // one's values would silently replace the other's.
            let why = format!(
                "rank {rank} took part twice in round {} (two threads with handles of one rank: \
                 give each loop a group of its own)",
                st.round
            );
            st.poisoned = Some(why.clone());
            self.changed.notify_all();
            return Err(ConsensusError(why));
        }
        st.inputs[rank] = Some(input);
        if st.inputs.iter().all(Option::is_some) {
            st.result = reduce(&st.inputs);
            st.inputs.iter_mut().for_each(|i| *i = None);
            st.round += 1;
            self.changed.notify_all();
            return st.result.clone();
        }
        let round = st.round;
        let deadline = Instant::now() + self.timeout;
        loop {
            if st.round != round {
                // completed (and read before any rank can start the next round's reduction:
                // that one needs this rank too)
                return st.result.clone();
            }
            if let Some(why) = &st.poisoned {
                return Err(ConsensusError(why.clone()));
            }
            let missing: Vec<usize> = (0..st.inputs.len())
                .filter(|&r| st.inputs[r].is_none())
                .collect();
            let left: Vec<usize> = missing
                .iter()
                .copied()
                .filter(|&r| st.handles[r] == 0)
                .collect();
            let why = if !left.is_empty() {
                Some(format!(
                    "rank {} left the group (every handle dropped) without taking part in \
                     round {round}: it cannot agree any more",
                    list(&left)
                ))
            } else if Instant::now() >= deadline {
                Some(format!(
                    "rank {} did not reach round {round} within {:?} (rank {rank} waited; \
                     LocalGroup::with_timeout sets the limit)",
                    list(&missing),
                    self.timeout
                ))
            } else {
                None
            };
            if let Some(why) = why {
                st.poisoned = Some(why.clone());
                self.changed.notify_all();
                return Err(ConsensusError(why));
            }
            let wait = deadline.saturating_duration_since(Instant::now());
            st = self
                .changed
                .wait_timeout(st, wait)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

fn list(ranks: &[usize]) -> String {
    ranks
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// In-process ranks that all-reduce through shared memory: a fake transport to test multi-rank
/// logic with threads.
///
/// No rank waits forever for one that will not come:
/// - a handle dropped while its thread panics (a panic in the step, or in user code between
///   steps) poisons the group: every rank waiting or arriving later gets an error naming the
///   rank that panicked;
/// - a rank whose every handle was dropped has left: ranks waiting for it get an error naming
///   it;
/// - a rank that holds its handle but does not come (stuck, or leaked) is given up after
///   [`LocalGroup::DEFAULT_TIMEOUT`] (or the [`LocalGroup::with_timeout`] limit): the ranks
///   waiting get an error naming it, and the group is poisoned.
///
/// ```
/// use oomguard_runtime::retry::advanced::{Consensus, LocalGroup};
/// let ranks = LocalGroup::new(2);
/// let handles: Vec<_> = ranks.into_iter().map(|r| std::thread::spawn(move || {
///     let mut v = [r.rank() as u64, 10 - r.rank() as u64];
///     r.all_reduce_max(&mut v).unwrap();
///     v
/// })).collect();
/// for h in handles { assert_eq!(h.join().unwrap(), [1, 10]); }
/// ```
#[derive(Debug)]
pub struct LocalGroup {
    rank: usize,
    world: usize,
    shared: Arc<Shared>,
}

impl LocalGroup {
    /// How long a rank waits for the others in one collective by default: 60 s.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

    /// `world` ranks (at least 1); hand one to each thread. Waits at most
    /// [`LocalGroup::DEFAULT_TIMEOUT`] for the others in a collective.
    pub fn new(world: usize) -> Vec<LocalGroup> {
        Self::with_timeout(world, Self::DEFAULT_TIMEOUT)
    }

    /// [`LocalGroup::new`] whose ranks wait at most `timeout` for the others in a collective;
    /// then they return an error naming the ranks that did not come, and the group is poisoned
    /// (every later collective fails).
    pub fn with_timeout(world: usize, timeout: Duration) -> Vec<LocalGroup> {
        let world = world.max(1);
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                round: 0,
                inputs: vec![None; world],
                result: Ok(Payload::Max(Vec::new())),
                handles: vec![1; world],
                poisoned: None,
            }),
            changed: Condvar::new(),
            timeout,
        });
        (0..world)
            .map(|rank| LocalGroup {
                rank,
                world,
                shared: Arc::clone(&shared),
            })
            .collect()
    }

    /// Why the group can no longer agree, if it cannot (a rank panicked, left or timed out).
    pub fn poisoned(&self) -> Option<String> {
        self.shared.lock().poisoned.clone()
    }

    /// Replaces every element of `values` with its sum over all ranks, added in rank order (so
    /// every rank gets the same bits). Every rank calls it with the same number of values.
    pub fn all_reduce_sum_f32(&self, values: &mut [f32]) -> Result<(), ConsensusError> {
        match self
            .shared
            .exchange(self.rank, Payload::SumF32(values.to_vec()))?
        {
            Payload::SumF32(sum) => {
                values.copy_from_slice(&sum);
                Ok(())
            }
            Payload::Max(_) => Err(ConsensusError(
                "ranks called different collectives (max and sum) in one round".into(),
            )),
        }
    }
}

/// Another handle of the same rank (e.g. for the engine and the gradient sync of one thread).
/// Its rounds are the rank's: two threads taking part with handles of one rank in one round is
/// an error for every rank (the group is poisoned), not two inputs of which one is lost.
impl Clone for LocalGroup {
    fn clone(&self) -> Self {
        self.shared.lock().handles[self.rank] += 1;
        Self {
            rank: self.rank,
            world: self.world,
            shared: Arc::clone(&self.shared),
        }
    }
}

/// Dropped while the thread panics: the group is poisoned (the rank will not come to the next
/// collective). The rank's last handle dropped: the rank has left, and ranks waiting for it
/// stop.
impl Drop for LocalGroup {
    fn drop(&mut self) {
        let mut st = self.shared.lock();
        st.handles[self.rank] = st.handles[self.rank].saturating_sub(1);
        if std::thread::panicking() && st.poisoned.is_none() {
            st.poisoned = Some(format!(
                "rank {} panicked (its LocalGroup handle was dropped while unwinding): the group cannot agree any more",
                self.rank
            ));
        }
        drop(st);
        self.shared.changed.notify_all();
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
        match self
            .shared
            .exchange(self.rank, Payload::Max(values.to_vec()))?
        {
            Payload::Max(max) => {
                values.copy_from_slice(&max);
                Ok(())
            }
            Payload::SumF32(_) => Err(ConsensusError(
                "ranks called different collectives (max and sum) in one round".into(),
            )),
        }
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
            let e = h.join().unwrap().unwrap_err().to_string();
            // each rank's call named, so that the odd one is found
            assert!(
                e.contains("rank 0: 1 u64 (max), rank 1: 2 u64 (max)"),
                "{e}"
            );
        }
    }

    /// A rank summing gradients (a commit) while the other agrees on a step: both named.
    #[test]
    fn a_sum_beside_a_max_names_both_calls() {
        let handles: Vec<_> = LocalGroup::new(2)
            .into_iter()
            .map(|r| {
                std::thread::spawn(move || {
                    if r.rank() == 0 {
                        let mut v = [0u64; 6];
                        r.all_reduce_max(&mut v).map_err(|e| e.to_string())
                    } else {
                        let mut g = [1.0f32; 6];
                        r.all_reduce_sum_f32(&mut g).map_err(|e| e.to_string())
                    }
                })
            })
            .collect();
        for h in handles {
            let e = h.join().unwrap().unwrap_err();
            assert!(
                e.contains("rank 0: 6 u64 (max), rank 1: 6 f32 (sum)"),
                "{e}"
            );
        }
    }
}
