//! The gradient all-reduce of a data-parallel step, and the rule that keeps it from hanging.
//! See [`GradientSync`] for the rule.

use super::consensus::{Consensus, LocalGroup, SingleProcess};
use crate::{DeviceBuffer, Error};

/// Sums gradient buffers over all ranks, in place: after the call every rank holds the same sum.
///
/// # The rule: one gradient collective per step, after the agreement
///
/// Every rank must issue the same collectives in the same order, or the run deadlocks. An
/// out-of-memory retry changes how many micro-batches a rank runs, so:
///
/// 1. **No collective inside the micro-batch loop.** Each micro-batch only adds its weighted
///    gradients to the rank's local accumulator (an attempt has no lasting effect, see
///    [the contract](crate::retry#the-contract)).
/// 2. **The flag exchange comes first.** After each attempt the [`RetryEngine`](super::RetryEngine)
///    all-reduces `[status, u64::MAX - micro, rows dropped]` through [`Consensus`]; if any rank
///    hit out-of-memory, every rank discards the attempt and reruns the agreed plan.
/// 3. **Then reduce gradients once**, in the commit ([`Step::commit`](super::Step::commit), or
///    the commit closure of [`RetryEngine::run`](super::RetryEngine::run)), which runs on every
///    rank exactly once, only after every rank's attempt succeeded:
///    [`GradientSync::sum_gradients`], then the optimizer update.
///
/// For the summed gradient to be the global batch's, each rank scales its micro-batch losses by
/// `chunk.len() / global_batch` (not by its local batch): the sum over ranks of their shares is
/// then exactly the mean over the global batch, whatever micro-batches each rank ran.
///
/// [`LocalGroup`] sums on the host (tests, the simulated device); with the `nccl` feature,
/// `nccl::NcclConsensus` sums on the GPUs.
pub trait GradientSync: Consensus {
    /// Replaces every buffer in `grads` with its element-wise sum over all ranks. Every rank
    /// passes the same number of buffers with the same lengths, in the same order.
    fn sum_gradients(&self, grads: &mut [&mut DeviceBuffer<f32>]) -> Result<(), Error>;
}

impl GradientSync for SingleProcess {
    fn sum_gradients(&self, _grads: &mut [&mut DeviceBuffer<f32>]) -> Result<(), Error> {
        Ok(())
    }
}

impl GradientSync for LocalGroup {
    /// Through host copies, summed in rank order (the same bits on every rank).
    fn sum_gradients(&self, grads: &mut [&mut DeviceBuffer<f32>]) -> Result<(), Error> {
        let mut flat = Vec::new();
        for g in grads.iter() {
            flat.extend(g.to_vec()?);
        }
        self.all_reduce_sum_f32(&mut flat)
            .map_err(|e| Error::InvalidArgument(e.to_string()))?;
        let mut rest = flat.as_slice();
        for g in grads.iter_mut() {
            let (mine, tail) = rest.split_at(g.len());
            g.copy_from_slice(mine)?;
            rest = tail;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ByteSize, Device};

    #[test]
    fn local_group_sums_buffers_of_every_rank() {
        let handles: Vec<_> = LocalGroup::new(2)
            .into_iter()
            .map(|r| {
                std::thread::spawn(move || {
                    let dev = Device::sim(ByteSize::mib(16));
                    let k = r.rank() as f32 + 1.0;
                    let mut a = dev.from_slice(&[k, 2.0 * k]).unwrap();
                    let mut b = dev.from_slice(&[10.0 * k]).unwrap();
                    r.sum_gradients(&mut [&mut a, &mut b]).unwrap();
                    (a.to_vec().unwrap(), b.to_vec().unwrap())
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), (vec![3.0, 6.0], vec![30.0]));
        }
        let dev = Device::sim(ByteSize::mib(16));
        let mut a = dev.from_slice(&[1.5f32]).unwrap();
        SingleProcess.sum_gradients(&mut [&mut a]).unwrap();
        assert_eq!(a.to_vec().unwrap(), [1.5]);
    }
}
