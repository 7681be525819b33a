//! libtorch's allocation history and its memory snapshot, as PyTorch's pickle.
//!
//! [`record_history`] is `torch.cuda.memory._record_memory_history`; [`snapshot_pickle`] is the
//! pickle `torch.cuda.memory._dump_snapshot` writes (libtorch's own
//! `torch::cuda::_memory_snapshot_pickled`): a dict with `segments`, `device_traces` (the
//! recorded actions: alloc, free_requested, free_completed, segment_alloc / free / map / unmap,
//! oom, snapshot) and `allocator_settings`. It opens in `oomguard view` and in PyTorch's
//! memory_viz (<https://pytorch.org/memory_viz>).

use std::ffi::{c_void, CString};
use std::path::Path;

use crate::shim::{self, call};

/// Which call stacks libtorch keeps with each recorded action.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum HistoryStacks {
    /// None: the actions alone (addresses, sizes, streams, times). Cheapest. (PyTorch's Python
    /// and TorchScript stacks have nothing to record in a tch program.)
    #[default]
    None,
    /// The C++ stack of each allocation (libtorch unwinds at every alloc, so every allocation
    /// costs more; the frames are symbolized when the snapshot is taken, which can take seconds).
    Cpp,
}

/// How to record the allocation history ([`record_history`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HistoryOptions {
    /// The most actions kept, per device (a ring: older actions are dropped). PyTorch's default
    /// is 100 000.
    pub max_entries: usize,
    /// Stacks kept with each action.
    pub stacks: HistoryStacks,
    /// Whether to drop what was recorded before.
    pub clear: bool,
}

impl Default for HistoryOptions {
    /// 100 000 actions, no stacks, nothing cleared.
    fn default() -> Self {
        Self {
            max_entries: 100_000,
            stacks: HistoryStacks::None,
            clear: false,
        }
    }
}

/// Starts recording libtorch's allocation history on every CUDA device (what
/// `torch.cuda.memory._record_memory_history(max_entries=...)` does), so that a later
/// [`snapshot_pickle`] holds `device_traces`. Refused: `max_entries` of 0. Without a CUDA device,
/// an `Unavailable` error. Recording stays on until [`stop_history`]; it is process-wide.
pub fn record_history(opts: HistoryOptions) -> oomguard::Result<()> {
    if opts.max_entries == 0 {
        return Err(oomguard::Error::InvalidArgument(
            "HistoryOptions::max_entries of 0: the history keeps at least one action".into(),
        ));
    }
    let (context, stacks) = match opts.stacks {
        HistoryStacks::None => (None, "python"),
        // "alloc": stacks for live blocks and for the alloc actions (not for frees).
        HistoryStacks::Cpp => (Some("alloc"), "all"),
    };
    raw_record_history(true, context, stacks, opts.max_entries as u64, opts.clear)
}

/// Stops recording (what was recorded stays, and is in the next snapshot).
pub fn stop_history() -> oomguard::Result<()> {
    raw_record_history(false, None, "python", 1, false)
}

/// The shim's `_record_memory_history` call, as is (its argument checks included).
pub(crate) fn raw_record_history(
    enabled: bool,
    context: Option<&str>,
    stacks: &str,
    max_entries: u64,
    clear: bool,
) -> oomguard::Result<()> {
    let invalid = |what: &str| oomguard::Error::InvalidArgument(format!("{what} holds a NUL byte"));
    let context = context
        .map(|c| CString::new(c).map_err(|_| invalid("context")))
        .transpose()?;
    let stacks = CString::new(stacks).map_err(|_| invalid("stacks"))?;
    // SAFETY: both strings are NUL-terminated and outlive the call (or context is null, which
    // the shim takes as "no context"); the buffer comes from `call`.
    call("torch::cuda::_record_memory_history", |err, len| unsafe {
        shim::oomguard_tch_record_history(
            i32::from(enabled),
            context.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()),
            stacks.as_ptr(),
            max_entries,
            i32::from(clear),
            err,
            len,
        )
    })
}

unsafe extern "C" fn collect(ctx: *mut c_void, data: *const u8, len: usize) {
    // SAFETY: `ctx` is the `&mut Vec<u8>` `snapshot_pickle` passed, alive for its call; `data`
    // points to `len` readable bytes (the shim's std::string) for the duration of this call.
    unsafe {
        let out = &mut *ctx.cast::<Vec<u8>>();
        out.extend_from_slice(std::slice::from_raw_parts(data, len));
    }
}

/// The memory snapshot of every CUDA device, as the pickle PyTorch's
/// `torch.cuda.memory._dump_snapshot` writes: segments and blocks now, and the recorded history
/// ([`record_history`]; without it `device_traces` holds empty lists, which `oomguard view`
/// refuses as a trace without events).
pub fn snapshot_pickle() -> oomguard::Result<Vec<u8>> {
    let mut out: Vec<u8> = Vec::new();
    // SAFETY: `collect` matches the sink signature and only copies `len` bytes into `out`,
    // which outlives the call; the shim calls it at most once, before returning.
    call("torch::cuda::_memory_snapshot_pickled", |err, len| unsafe {
        shim::oomguard_tch_snapshot_pickled(
            collect,
            (&mut out as *mut Vec<u8>).cast::<c_void>(),
            err,
            len,
        )
    })?;
    Ok(out)
}

/// Writes [`snapshot_pickle`] to `path` (open it with `oomguard view path`, or drop it on
/// PyTorch's memory_viz). libtorch's errors come back as `io::Error`s of kind `Other` holding
/// the [`oomguard::Error`]; a failed write names the path.
pub fn write_snapshot(path: impl AsRef<Path>) -> std::io::Result<()> {
    let path = path.as_ref();
    let data = snapshot_pickle().map_err(std::io::Error::other)?;
    std::fs::write(path, data).map_err(|e| {
        std::io::Error::new(
            e.kind(),
            format!("writing the memory snapshot to {}: {e}", path.display()),
        )
    })
}
