//! NCCL for data-parallel runs (feature `nccl`): [`NcclConsensus`] makes every rank's retry
//! engine agree on one plan (a `u64` max all-reduce of the engine's flags on the GPUs) and sums
//! gradients once per step ([`GradientSync`]).
//!
//! NCCL is loaded at run time by cudarc (the libnccl 2.28 API); every constructor first probes
//! that the library loads and has the entry points oomguard calls, so a machine without NCCL gets
//! an error (a [`BackendError`] of kind `Unavailable`), never a panic.
//!
//! Three ways to make the ranks:
//! - [`NcclConsensus::from_env`]: one process per GPU, started by a launcher (torchrun, srun).
//!   The launcher's variables are read by [`LaunchEnv`] (see [`launcher`] for every variable,
//!   oomguard's included); rank 0 makes the NCCL id and hands it to the others over TCP
//!   ([`rendezvous()`], at `MASTER_ADDR`, port `MASTER_PORT + 1` or
//!   `OOMGUARD_RENDEZVOUS_PORT`). Nothing assumes the ranks share a host or a filesystem. Each
//!   hello carries the job id ([`LaunchEnv::job_id`]): rank 0 refuses another job's ranks. For
//!   trusted networks only, as torchrun's store (see the trust model in [`mod@rendezvous`]).
//! - [`NcclConsensus::for_devices`]: one process, one thread per GPU.
//! - [`NcclConsensus::from_rank`]: you move the id ([`new_id`]) yourself.
//!
//! No rank waits forever: a collective is waited for by polling, at most the collective timeout
//! (`OOMGUARD_NCCL_TIMEOUT`, default 60 s), and, for ranks made by `from_env`, at most 2 s after
//! another rank is known to have left the group (its process died: the kernel closed its
//! rendezvous connection; or it dropped its communicator). Then the communicator is aborted
//! (`ncclCommAbort`) and the call returns an error saying which rank left and how.
//!
//! ```no_run
//! use oomguard_runtime::nccl::NcclConsensus;
//! use oomguard_runtime::retry::{advanced::GradientSync, RetryEngine};
//! # fn main() -> Result<(), oomguard_runtime::Error> {
//! // One process per GPU: torchrun --standalone --nproc-per-node 2 ./train
//! let rank = NcclConsensus::from_env()?; // drives GPU LOCAL_RANK
//! let dev = rank.device().clone();
//! let engine = RetryEngine::new().with_consensus(rank.clone());
//! // engine.run_step(&dev, local_batch, &mut step): the step's commit calls
//! // rank.sum_gradients(&mut grads) once, then updates the parameters.
//! # let _ = (engine, dev);
//! # Ok(()) }
//! ```
//!
//! ```no_run
//! use oomguard_runtime::nccl::NcclConsensus;
//! use oomguard_runtime::retry::RetryEngine;
//! use oomguard_runtime::Device;
//! # fn main() -> Result<(), oomguard_runtime::Error> {
//! // One process, one thread per GPU.
//! let devices = [Device::cuda(0)?, Device::cuda(1)?];
//! let ranks = NcclConsensus::for_devices(&devices)?; // one per device, in rank order
//! for (dev, rank) in devices.into_iter().zip(ranks) {
//!     std::thread::spawn(move || {
//!         let engine = RetryEngine::new().with_consensus(rank.clone());
//!         # let _ = (engine, dev);
//!     });
//! }
//! # Ok(()) }
//! ```
#![allow(unsafe_code)] // NCCL's C API (through cudarc's `result`/`sys`); each call says why it holds

pub mod launcher;
mod loader;
pub mod rendezvous;
mod wait;

use std::ffi::CStr;
use std::fmt;
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread;
use std::time::Duration;

use cudarc::driver::{CudaStream, DevicePtrMut};
use cudarc::nccl::{result, sys, NcclType};

use crate::backend::{BackendError, BackendErrorKind};
use crate::retry::advanced::Consensus;
use crate::retry::advanced::{ConsensusError, GradientSync};
use crate::{Device, DeviceBuffer, Error};

pub use launcher::{LaunchEnv, Launcher};
pub use rendezvous::{rendezvous, PeerLinks, Rendezvous, RendezvousConfig};

/// A unique id for [`NcclConsensus::from_rank`]: made on one rank ([`new_id`]) and sent to the
/// others (its bytes: `NcclId::internal`, rebuilt with `NcclId::uninit`).
pub use cudarc::nccl::safe::Id as NcclId;

/// How many `u64`s the retry engine exchanges per agreement.
const FLAGS: usize = crate::retry::VOTE_WORDS;

/// Checks that NCCL can be loaded with every entry point oomguard calls.
pub fn nccl_available() -> Result<(), Error> {
    Ok(loader::probe()?)
}

/// A new unique id for a group of ranks built with [`NcclConsensus::from_rank`].
pub fn new_id() -> Result<NcclId, Error> {
    loader::probe()?;
    NcclId::new().map_err(|e| nccl_err("ncclGetUniqueId", e))
}

/// NCCL's name and description of a result code, e.g. `ncclRemoteError (remote process exited
/// or there was a network error)`.
fn nccl_message(code: sys::ncclResult_t) -> String {
    // SAFETY: ncclGetErrorString takes any result code and returns a pointer to a static,
    // NUL-terminated string (or null, checked below); the library was probed before any
    // communicator existed, so the symbol is there.
    let text = unsafe { sys::ncclGetErrorString(code) };
    if text.is_null() {
        return format!("{code:?}");
    }
    // SAFETY: non-null, NUL-terminated and static (see above).
    let text = unsafe { CStr::from_ptr(text) }.to_string_lossy();
    format!("{code:?} ({text})")
}

fn nccl_err(op: &'static str, e: result::NcclError) -> Error {
    Error::Backend(BackendError::new(
        BackendErrorKind::Other,
        op,
        nccl_message(e.0),
    ))
}

fn driver_err(op: &'static str, e: impl fmt::Display) -> Error {
    Error::Backend(BackendError::new(
        BackendErrorKind::Other,
        op,
        e.to_string(),
    ))
}

/// The collective timeout from `OOMGUARD_NCCL_TIMEOUT`, else the default (60 s).
fn timeout_from_env() -> Result<Duration, Error> {
    match std::env::var("OOMGUARD_NCCL_TIMEOUT") {
        Err(_) => Ok(launcher::DEFAULT_COLLECTIVE_TIMEOUT),
        Ok(v) => launcher::parse_seconds(v.trim()).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "OOMGUARD_NCCL_TIMEOUT={v:?} is not a positive number of seconds"
            ))
        }),
    }
}

/// An NCCL communicator handle, aborted (`ncclCommAbort`) when dropped or when a collective
/// fails; null once aborted.
struct RawComm(sys::ncclComm_t);

// SAFETY: an NCCL communicator is a handle that any host thread may use, as long as no two threads
// call into it at the same time; `NcclConsensus` only touches it under its mutex, and
// `init_rank` hands it from the thread that made it to the caller before anyone else uses it.
unsafe impl Send for RawComm {}

/// A communicator handle on its way to the thread that aborts it.
#[derive(Clone, Copy)]
struct SendPtr(sys::ncclComm_t);

// SAFETY: see `RawComm`: the handle is moved out of its owner and used by one thread only.
unsafe impl Send for SendPtr {}

/// How long [`RawComm::abort`] waits for `ncclCommAbort` to return before going on without it.
const ABORT_WAIT: Duration = Duration::from_secs(10);

impl RawComm {
    /// Aborts the communicator (`ncclCommAbort`, which stops the kernels still waiting on it) on
    /// a helper thread, waiting at most [`ABORT_WAIT`] for it: an abort that hangs (a peer's
    /// death can leave NCCL's own threads stuck) costs a thread, not the caller.
    fn abort(&mut self) {
        if self.0.is_null() {
            return;
        }
        let comm = SendPtr(std::mem::replace(&mut self.0, std::ptr::null_mut()));
        let (tx, rx) = mpsc::channel::<()>();
        let spawned = thread::Builder::new()
            .name("oomguard-nccl-abort".into())
            .spawn(move || {
                let comm = comm;
                // SAFETY: a communicator from ncclCommInitRank/ncclCommInitAll, taken out of its
                // owner (which now holds null), so it is aborted once (here; the fallback below
                // runs only when this closure never ran) and used by no other thread.
                let _ = unsafe { result::comm_abort(comm.0) };
                let _ = tx.send(());
            });
        match spawned {
            Ok(_) => {
                if rx.recv_timeout(ABORT_WAIT).is_err() {
                    tracing::warn!(
                        "ncclCommAbort did not return within {} s; going on without it",
                        ABORT_WAIT.as_secs()
                    );
                }
            }
            Err(_) => {
                // SAFETY: as above; the thread was not started, so this is the only abort.
                let _ = unsafe { result::comm_abort(comm.0) };
            }
        }
    }
}

impl Drop for RawComm {
    fn drop(&mut self) {
        self.abort();
    }
}

/// Makes rank `rank` of `world` (`ncclCommInitRank`) on a helper thread, waiting at most
/// `timeout` for every rank to join, and no longer once `links` report a rank gone; the helper
/// aborts a communicator that comes too late.
fn init_rank(
    stream: &Arc<CudaStream>,
    rank: usize,
    world: usize,
    id: NcclId,
    timeout: Duration,
    links: Option<&PeerLinks>,
) -> Result<RawComm, Error> {
    let (Ok(nranks), Ok(rank_i)) = (i32::try_from(world), i32::try_from(rank)) else {
        return Err(Error::InvalidArgument(format!(
            "NCCL rank {rank} of a world of {world}"
        )));
    };
    let ctx = Arc::clone(stream.context());
    let (tx, rx) = mpsc::channel::<Result<RawComm, Error>>();
    let raw_id = sys::ncclUniqueId {
        internal: *id.internal(),
    };
    thread::Builder::new()
        .name(format!("oomguard-nccl-init-{rank}"))
        .spawn(move || {
            let made = ctx
                .bind_to_thread()
                .map_err(|e| driver_err("cuCtxSetCurrent", e))
                .and_then(|()| {
                    let mut comm: sys::ncclComm_t = std::ptr::null_mut();
                    // SAFETY: `comm` is a valid place for the new handle; the id is 128 bytes
                    // as NCCL made them; the device's context is current on this thread.
                    unsafe { result::comm_init_rank(&mut comm, nranks, raw_id, rank_i) }
                        .map_err(|e| nccl_err("ncclCommInitRank", e))?;
                    Ok(RawComm(comm))
                });
            // If the caller gave up, the communicator comes back here and is aborted.
            let _ = tx.send(made);
        })
        .map_err(|e| driver_err("spawn", e))?;
    let start = std::time::Instant::now();
    loop {
        let waited = start.elapsed();
        if waited >= timeout {
            return Err(driver_err(
                "ncclCommInitRank",
                format!(
                    "not every rank joined within {:.0} s (a rank failed or hung before joining)",
                    timeout.as_secs_f64()
                ),
            ));
        }
        match rx.recv_timeout((timeout - waited).min(Duration::from_millis(100))) {
            Ok(made) => return made,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if let Some(why) = links.and_then(PeerLinks::peer_failure) {
                    return Err(driver_err("ncclCommInitRank", format!("aborted: {why}")));
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err(driver_err(
                    "ncclCommInitRank",
                    "the init thread ended without an answer",
                ))
            }
        }
    }
}

struct State {
    comm: CommState,
    /// The engine's flags on the device, allocated up front so an agreement never allocates.
    flags: DeviceBuffer<u64>,
}

struct CommState {
    comm: RawComm,
    /// The stream collectives run on (the device's default stream).
    stream: Arc<CudaStream>,
    limits: wait::Limits,
    /// Why the communicator was aborted, once it was: every later call fails with it.
    failed: Option<String>,
}

struct Inner {
    device: Device,
    rank: usize,
    world: usize,
    state: Mutex<State>,
    /// The liveness links of a group met by [`rendezvous()`] (none for `for_devices`/`from_rank`).
    /// Dropped after the communicator: declared after `state`.
    links: Option<PeerLinks>,
}

/// One rank of an NCCL group: a [`Consensus`] for [`crate::RetryEngine::with_consensus`] and a
/// [`GradientSync`] for the step's commit. Cheap to clone (clones share the communicator).
///
/// Collectives run on the device's default stream and are waited for before a call returns, by
/// polling, never longer than the collective timeout (`OOMGUARD_NCCL_TIMEOUT`, default 60 s;
/// [`NcclConsensus::set_timeout`]), and, in a group made by [`NcclConsensus::from_env`], not
/// more than 2 s after another rank is known to have left the group. Then the communicator is
/// aborted (`ncclCommAbort`) and this call and every later one return an error saying why.
///
/// One call is not bounded this way: the enqueue (`ncclAllReduce` itself, before the wait). With
/// NCCL's lazy connection set-up (`NCCL_RUNTIME_CONNECT=1`, its default) the first collective of
/// each kind connects to the peers inside that call: a dead peer makes it fail, but a peer that is
/// alive and never calls the collective could hold it. `NCCL_RUNTIME_CONNECT=0` moves the
/// connections into the communicator's creation, whose wait is bounded.
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
        let timeout = timeout_from_env()?;
        let mut ordinals = Vec::with_capacity(devices.len());
        let mut streams = Vec::with_capacity(devices.len());
        for d in devices {
            streams.push(d.cuda_default_stream()?);
            if ordinals.contains(&(d.ordinal() as i32)) {
                return Err(Error::InvalidArgument(format!(
                    "NCCL group lists {} twice",
                    d.name()
                )));
            }
            ordinals.push(d.ordinal() as i32);
        }
        let n = i32::try_from(devices.len())
            .map_err(|_| Error::InvalidArgument("too many devices for NCCL".into()))?;
        let mut comms: Vec<sys::ncclComm_t> = vec![std::ptr::null_mut(); devices.len()];
        // SAFETY: `comms` has room for `n` handles and `ordinals` holds `n` distinct device
        // ordinals (checked above).
        unsafe { result::comm_init_all(comms.as_mut_ptr(), n, ordinals.as_ptr()) }
            .map_err(|e| nccl_err("ncclCommInitAll", e))?;
        // Own every handle before anything can fail, so none leaks.
        let comms: Vec<RawComm> = comms.into_iter().map(RawComm).collect();
        devices
            .iter()
            .zip(comms)
            .zip(streams)
            .enumerate()
            .map(|(rank, ((d, c), s))| Self::new(d, rank, devices.len(), c, s, timeout, None))
            .collect()
    }

    /// Rank `rank` of `world` ranks, one per process (or thread), joined by `id` from
    /// [`new_id`] (`ncclCommInitRank`: returns when every rank has joined, or an error after the
    /// collective timeout). [`NcclConsensus::from_env`] does the id exchange for you.
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
        let timeout = timeout_from_env()?;
        let stream = device.cuda_default_stream()?;
        let comm = init_rank(&stream, rank, world, id, timeout, None)?;
        Self::new(device, rank, world, comm, stream, timeout, None)
    }

    /// This process's rank of a group started by a launcher (torchrun, srun): reads
    /// [`LaunchEnv::from_env`], drives CUDA device `LOCAL_RANK` ([`LaunchEnv::device_ordinal`]),
    /// meets the other ranks at rank 0's host ([`rendezvous()`]) and joins the NCCL group. Every failure is an error naming its
    /// cause (a missing or inconsistent variable, a rank that never came, a wrong world size).
    ///
    /// ```no_run
    /// use oomguard_runtime::nccl::NcclConsensus;
    /// use oomguard_runtime::retry::RetryEngine;
    /// # fn main() -> Result<(), oomguard_runtime::Error> {
    /// // torchrun --standalone --nproc-per-node 2 ./train
    /// let rank = NcclConsensus::from_env()?;
    /// let dev = rank.device().clone();
    /// let engine = RetryEngine::new().with_consensus(rank.clone());
    /// # let _ = (engine, dev);
    /// # Ok(()) }
    /// ```
    pub fn from_env() -> Result<Self, Error> {
        let env = LaunchEnv::from_env()?;
        let device = Device::cuda(env.device_ordinal)?;
        Self::from_launch(&device, &env)
    }

    /// Like [`NcclConsensus::from_env`] on a device and launch description of your choosing.
    pub fn from_launch(device: &Device, env: &LaunchEnv) -> Result<Self, Error> {
        loader::probe()?;
        let stream = device.cuda_default_stream()?;
        let met = rendezvous(
            &RendezvousConfig {
                host: env.master_addr.clone(),
                port: env.rendezvous_port,
                rank: env.rank,
                world_size: env.world_size,
                timeout: env.rendezvous_timeout,
                job_id: env.job_id.clone(),
            },
            || {
                let id = new_id()?;
                Ok(id.internal().map(|c| c as u8))
            },
        )?;
        let id = NcclId::uninit(met.id.map(|b| b as std::ffi::c_char));
        let comm = init_rank(
            &stream,
            env.rank,
            env.world_size,
            id,
            env.rendezvous_timeout,
            Some(&met.links),
        )?;
        Self::new(
            device,
            env.rank,
            env.world_size,
            comm,
            stream,
            env.collective_timeout,
            Some(met.links),
        )
    }

    fn new(
        device: &Device,
        rank: usize,
        world: usize,
        comm: RawComm,
        stream: Arc<CudaStream>,
        timeout: Duration,
        links: Option<PeerLinks>,
    ) -> Result<Self, Error> {
        let flags = device.zeros::<u64>(FLAGS)?;
        Ok(Self {
            inner: Arc::new(Inner {
                device: device.clone(),
                rank,
                world,
                state: Mutex::new(State {
                    comm: CommState {
                        comm,
                        stream,
                        limits: wait::Limits::new(timeout),
                        failed: None,
                    },
                    flags,
                }),
                links,
            }),
        })
    }

    /// The device of this rank.
    pub fn device(&self) -> &Device {
        &self.inner.device
    }

    /// The longest a collective may wait for the other ranks before the communicator is aborted
    /// (applies to every clone). Must exceed the longest time one rank may reach a collective
    /// after another: about one attempt of a step. Waits for a collective of this rank in flight
    /// on another thread, like [`NcclConsensus::timeout`] and [`NcclConsensus::failure`].
    pub fn set_timeout(&self, timeout: Duration) -> Result<(), Error> {
        if timeout.is_zero() {
            return Err(Error::InvalidArgument("NCCL timeout of zero".into()));
        }
        self.lock().comm.limits = wait::Limits::new(timeout);
        Ok(())
    }

    /// The collective timeout.
    pub fn timeout(&self) -> Duration {
        self.lock().comm.limits.timeout
    }

    /// Why this rank's communicator was aborted, or, if it was not, why the group is broken: a
    /// rank known to have left it (groups made by [`NcclConsensus::from_env`] /
    /// [`NcclConsensus::from_launch`] only). `None` while all is well.
    pub fn failure(&self) -> Option<String> {
        if let Some(f) = self.lock().comm.failed.clone() {
            return Some(f);
        }
        self.inner.links.as_ref().and_then(PeerLinks::peer_failure)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.inner.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// In-place all-reduce of each buffer with `op`, then waits for it (see the type's docs);
    /// any failure aborts the communicator.
    fn all_reduce<T>(
        &self,
        state: &mut CommState,
        bufs: &mut [&mut DeviceBuffer<T>],
        op: sys::ncclRedOp_t,
    ) -> Result<(), Error>
    where
        T: bytemuck::Pod + NcclType,
    {
        const OP: &str = "ncclAllReduce";
        if let Some(f) = &state.failed {
            return Err(driver_err(
                OP,
                format!("the communicator was aborted earlier: {f}"),
            ));
        }
        let result = self.launch_and_wait(state, bufs, op);
        if let Err(m) = &result {
            state.comm.abort();
            state.failed = Some(m.clone());
        }
        result.map_err(|m| driver_err(OP, m))
    }

    fn launch_and_wait<T>(
        &self,
        state: &mut CommState,
        bufs: &mut [&mut DeviceBuffer<T>],
        op: sys::ncclRedOp_t,
    ) -> Result<(), String>
    where
        T: bytemuck::Pod + NcclType,
    {
        let comm = state.comm.0;
        let stream = Arc::clone(&state.stream);
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| format!("cuCtxSetCurrent: {e}"))?;
        for b in bufs.iter_mut() {
            let count = b.len();
            let mut view = b.cuda_view_mut().map_err(|e| e.to_string())?;
            let (ptr, _record) = view.device_ptr_mut(&stream);
            // SAFETY: `ptr` is `count` elements of `T` on this communicator's device, borrowed
            // mutably for this whole call; the call returns only after the collective completed
            // or the communicator was aborted (which stops its kernels), so NCCL never touches
            // the buffer after the borrow ends. `comm` is live (not aborted: `failed` is None)
            // and used by this thread only (the state's mutex is held).
            unsafe {
                result::all_reduce(
                    ptr as *const _,
                    ptr as *mut _,
                    count,
                    T::as_nccl_type(),
                    op,
                    comm,
                    stream.cu_stream() as sys::cudaStream_t,
                )
            }
            .map_err(|e| nccl_message(e.0))?;
        }
        let done = stream
            .record_event(None)
            .map_err(|e| format!("cuEventRecord: {e}"))?;
        let links = self.inner.links.as_ref();
        wait::wait_collective(
            state.limits,
            || {
                if done
                    .try_is_complete()
                    .map_err(|e| format!("cuEventQuery: {e}"))?
                {
                    return Ok(true);
                }
                let mut code = sys::ncclResult_t::ncclSuccess;
                // SAFETY: `comm` is live and used by this thread only (see above); `code` is a
                // valid place for the result.
                let asked = unsafe { sys::ncclCommGetAsyncError(comm, &mut code) };
                match (asked, code) {
                    (sys::ncclResult_t::ncclSuccess, sys::ncclResult_t::ncclSuccess)
                    | (sys::ncclResult_t::ncclSuccess, sys::ncclResult_t::ncclInProgress) => {
                        Ok(false)
                    }
                    (sys::ncclResult_t::ncclSuccess, c) => {
                        Err(format!("NCCL reported an error: {}", nccl_message(c)))
                    }
                    (a, _) => Err(format!("ncclCommGetAsyncError: {}", nccl_message(a))),
                }
            },
            || links.and_then(PeerLinks::peer_failure),
        )
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
        self.all_reduce(comm, &mut [&mut *buf], sys::ncclRedOp_t::ncclMax)
            .map_err(fail)?;
        buf.copy_to_slice(values).map_err(fail)
    }
}

impl GradientSync for NcclConsensus {
    /// One `ncclFloat32` sum all-reduce per buffer, in place, then a wait (see the type's docs).
    fn sum_gradients(&self, grads: &mut [&mut DeviceBuffer<f32>]) -> Result<(), Error> {
        let mut state = self.lock();
        self.all_reduce(&mut state.comm, grads, sys::ncclRedOp_t::ncclSum)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ByteSize;
    use std::time::Instant;

    /// The collective's wait as `NcclConsensus` runs it (liveness links of a real rendezvous on
    /// 127.0.0.1, a fake collective that never completes): rank 1 leaving ends rank 0's wait
    /// after the grace, far before the timeout.
    #[test]
    fn a_rank_leaving_ends_a_pending_collective_after_the_grace() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let cfg = move |rank| RendezvousConfig {
            host: "127.0.0.1".into(),
            port,
            rank,
            world_size: 2,
            timeout: Duration::from_secs(10),
            job_id: String::new(),
        };
        let one = thread::spawn(move || rendezvous(&cfg(1), || unreachable!()).unwrap());
        let zero = rendezvous(&cfg(0), || Ok([7; rendezvous::ID_BYTES])).unwrap();
        let one = one.join().unwrap();
        assert_eq!(one.id, [7; rendezvous::ID_BYTES]);
        let limits = wait::Limits {
            timeout: Duration::from_secs(600),
            grace: Duration::from_millis(300),
        };
        let t0 = Instant::now();
        let leaver = thread::spawn(move || {
            thread::sleep(Duration::from_millis(200));
            drop(one);
        });
        let m =
            wait::wait_collective(limits, || Ok(false), || zero.links.peer_failure()).unwrap_err();
        leaver.join().unwrap();
        let took = t0.elapsed();
        assert!(m.contains("rank 1 left the group"), "{m}");
        assert!(took >= Duration::from_millis(500), "{took:?}");
        // after the grace, not the 600 s timeout (a bound a loaded machine cannot reach)
        assert!(took < Duration::from_secs(120), "{took:?}");
    }

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
        // The launcher path: an error before any rendezvous (nothing listens, nothing waits).
        let env = LaunchEnv::from_vars(|k| {
            let v = match k {
                "RANK" | "LOCAL_RANK" => "0",
                "WORLD_SIZE" => "2",
                "MASTER_ADDR" => "127.0.0.1",
                "MASTER_PORT" => "1",
                _ => return None,
            };
            Some(v.to_string())
        })
        .unwrap();
        let t0 = std::time::Instant::now();
        let e = NcclConsensus::from_launch(&sim, &env).unwrap_err();
        // no rendezvous waited out (its default timeout is 120 s): a hang guard below it
        assert!(t0.elapsed() < std::time::Duration::from_secs(100));
        assert!(!e.to_string().contains('\n'), "one line: {e}");
        assert!(
            e.to_string().contains("NCCL") || e.to_string().contains("not a CUDA device"),
            "{e}"
        );
    }
}
