//! NCCL for data-parallel runs (feature `nccl`): [`NcclConsensus`] makes every rank's retry
//! engine agree on one plan (a `u64` max all-reduce of the engine's flags on the GPUs) and sums
//! gradients once per step ([`GradientSync`]).
//!
//! NCCL is loaded at run time by cudarc (the libnccl 2.28 API); every constructor first probes
//! that the library loads and has the entry points oomguard calls, so a machine without NCCL gets
//! an error (a [`BackendError`] of kind `Unavailable`), never a panic.
//!
//! ```no_run
//! use oomguard_runtime::nccl::NcclConsensus;
//! use oomguard_runtime::retry::{GradientSync, RetryEngine};
//! use oomguard_runtime::Device;
//! # fn main() -> Result<(), oomguard_runtime::Error> {
//! let devices = [Device::cuda(0)?, Device::cuda(1)?];
//! let ranks = NcclConsensus::for_devices(&devices)?; // one per device, in rank order
//! for (dev, rank) in devices.into_iter().zip(ranks) {
//!     std::thread::spawn(move || {
//!         let engine = RetryEngine::new().with_consensus(rank.clone());
//!         // engine.run_step(&dev, local_batch, &mut step): the step's commit calls
//!         // rank.sum_gradients(&mut grads) once, then updates the parameters.
//!         # let _ = (engine, dev);
//!     });
//! }
//! # Ok(()) }
//! ```
#![allow(unsafe_code)] // only to move a communicator between threads (see `SendComm`)

mod loader;

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::nccl::safe::{Comm, ReduceOp};

use crate::backend::{BackendError, BackendErrorKind};
use crate::retry::{Consensus, ConsensusError, GradientSync};
use crate::{Device, DeviceBuffer, Error};

/// A unique id for [`NcclConsensus::from_rank`]: made on one rank ([`new_id`]) and sent to the
/// others (its bytes: `NcclId::internal`, rebuilt with `NcclId::uninit`).
pub use cudarc::nccl::safe::Id as NcclId;

/// How many `u64`s the retry engine exchanges per agreement.
const FLAGS: usize = 3;

/// Checks that NCCL can be loaded with every entry point oomguard calls.
pub fn nccl_available() -> Result<(), Error> {
    Ok(loader::probe()?)
}

/// A new unique id for a group of ranks built with [`NcclConsensus::from_rank`].
pub fn new_id() -> Result<NcclId, Error> {
    loader::probe()?;
    NcclId::new().map_err(|e| nccl_err("ncclGetUniqueId", e))
}

fn nccl_err(op: &'static str, e: impl fmt::Debug) -> Error {
    Error::Backend(BackendError::new(
        BackendErrorKind::Other,
        op,
        format!("{e:?}"),
    ))
}

fn driver_err(op: &'static str, e: impl fmt::Display) -> Error {
    Error::Backend(BackendError::new(
        BackendErrorKind::Other,
        op,
        e.to_string(),
    ))
}

/// A communicator that may move to another thread.
struct SendComm(Comm);

// SAFETY: an NCCL communicator is a handle that any host thread may use, as long as no two threads
// call into it at the same time; `NcclConsensus` only touches it under its mutex, and cudarc's
// `Comm` holds nothing else that is tied to the creating thread (an `Arc<CudaStream>`, numbers).
unsafe impl Send for SendComm {}

struct State {
    comm: SendComm,
    /// The engine's flags on the device, allocated up front so an agreement never allocates.
    flags: DeviceBuffer<u64>,
}

struct Inner {
    device: Device,
    rank: usize,
    world: usize,
    state: Mutex<State>,
}

/// One rank of an NCCL group: a [`Consensus`] for [`crate::RetryEngine::with_consensus`] and a
/// [`GradientSync`] for the step's commit. Cheap to clone (clones share the communicator).
///
/// Collectives run on the device's default stream and are waited for before a call returns.
#[derive(Clone)]
pub struct NcclConsensus {
    inner: Arc<Inner>,
}

impl fmt::Debug for NcclConsensus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclConsensus")
            .field("rank", &self.inner.rank)
            .field("world", &self.inner.world)
            .field("device", &self.inner.device.name())
            .finish()
    }
}

impl NcclConsensus {
    /// One rank per device, all in this process (`ncclCommInitAll`), in the order given: hand
    /// each to the thread that drives its device. The devices must be distinct CUDA devices.
    pub fn for_devices(devices: &[Device]) -> Result<Vec<NcclConsensus>, Error> {
        loader::probe()?;
        if devices.is_empty() {
            return Err(Error::InvalidArgument("NCCL group of no devices".into()));
        }
        let mut ordinals = Vec::with_capacity(devices.len());
        let mut streams = Vec::with_capacity(devices.len());
        for d in devices {
            streams.push(d.cuda_default_stream()?);
            if ordinals.contains(&d.ordinal()) {
                return Err(Error::InvalidArgument(format!(
                    "NCCL group lists {} twice",
                    d.name()
                )));
            }
            ordinals.push(d.ordinal());
        }
        let comms = Comm::from_devices(streams).map_err(|e| nccl_err("ncclCommInitAll", e))?;
        devices
            .iter()
            .zip(comms)
            .map(|(d, c)| Self::from_comm(d, c))
            .collect()
    }

    /// Rank `rank` of `world` ranks, one per process (or thread), joined by `id` from
    /// [`new_id`] (`ncclCommInitRank`: returns when every rank has joined).
    pub fn from_rank(
        device: &Device,
        rank: usize,
        world: usize,
        id: NcclId,
    ) -> Result<Self, Error> {
        loader::probe()?;
        if world == 0 || rank >= world {
            return Err(Error::InvalidArgument(format!(
                "NCCL rank {rank} of a world of {world}"
            )));
        }
        let stream = device.cuda_default_stream()?;
        let comm = Comm::from_rank(stream, rank, world, id)
            .map_err(|e| nccl_err("ncclCommInitRank", e))?;
        Self::from_comm(device, comm)
    }

    fn from_comm(device: &Device, comm: Comm) -> Result<Self, Error> {
        let flags = device.zeros::<u64>(FLAGS)?;
        Ok(Self {
            inner: Arc::new(Inner {
                device: device.clone(),
                rank: comm.rank(),
                world: comm.world_size(),
                state: Mutex::new(State {
                    comm: SendComm(comm),
                    flags,
                }),
            }),
        })
    }

    /// The device of this rank.
    pub fn device(&self) -> &Device {
        &self.inner.device
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.inner.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// In-place all-reduce of each buffer with `op`, then waits for the stream.
    fn all_reduce<T>(
        comm: &Comm,
        bufs: &mut [&mut DeviceBuffer<T>],
        op: ReduceOp,
    ) -> Result<(), Error>
    where
        T: bytemuck::Pod + cudarc::nccl::safe::NcclType,
    {
        comm.context()
            .bind_to_thread()
            .map_err(|e| driver_err("cuCtxSetCurrent", e))?;
        for b in bufs.iter_mut() {
            let mut view = b.cuda_view_mut()?;
            comm.all_reduce_in_place(&mut view, &op)
                .map_err(|e| nccl_err("ncclAllReduce", e))?;
        }
        comm.stream()
            .synchronize()
            .map_err(|e| driver_err("cuStreamSynchronize", e))
    }
}

impl Consensus for NcclConsensus {
    fn rank(&self) -> usize {
        self.inner.rank
    }
    fn world_size(&self) -> usize {
        self.inner.world
    }
    /// A `u64` max all-reduce (`ncclUint64`, `ncclMax`) through a device buffer.
    fn all_reduce_max(&self, values: &mut [u64]) -> Result<(), ConsensusError> {
        let fail = |e: Error| ConsensusError(e.to_string());
        let mut state = self.lock();
        let State { comm, flags } = &mut *state;
        let mut spare;
        let buf = if values.len() == flags.len() {
            flags
        } else {
            spare = self.inner.device.zeros::<u64>(values.len()).map_err(fail)?;
            &mut spare
        };
        buf.copy_from_slice(values).map_err(fail)?;
        Self::all_reduce(&comm.0, &mut [&mut *buf], ReduceOp::Max).map_err(fail)?;
        buf.copy_to_slice(values).map_err(fail)
    }
}

impl GradientSync for NcclConsensus {
    /// One `ncclFloat32` sum all-reduce per buffer, in place, then a stream synchronisation.
    fn sum_gradients(&self, grads: &mut [&mut DeviceBuffer<f32>]) -> Result<(), Error> {
        let state = self.lock();
        Self::all_reduce(&state.comm.0, grads, ReduceOp::Sum)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ByteSize;

    #[test]
    fn without_nccl_or_a_cuda_device_constructors_are_errors_not_panics() {
        let sim = Device::sim(ByteSize::mib(16));
        // Without libnccl: the probe's error; with it: a simulated device is not a CUDA device.
        let e = NcclConsensus::for_devices(std::slice::from_ref(&sim)).unwrap_err();
        assert!(!e.to_string().contains('\n'), "one line: {e}");
        assert!(NcclConsensus::for_devices(&[]).is_err());
        if nccl_available().is_ok() {
            assert!(e.to_string().contains("not a CUDA device"), "{e}");
            let id = new_id().unwrap();
            let e = NcclConsensus::from_rank(&sim, 2, 2, id).unwrap_err();
            assert!(e.to_string().contains("rank 2 of a world of 2"), "{e}");
        } else {
            assert!(e.to_string().contains("NCCL"), "{e}");
            assert!(new_id().is_err());
        }
    }
}
