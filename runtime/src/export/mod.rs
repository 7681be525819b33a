//! Exporting the allocator's state: a [`MemorySnapshot`] (segments, blocks, recorded history) as
//! JSON, or as a pickle in the format of PyTorch's `torch.cuda.memory._snapshot()`, which
//! PyTorch's own viewer reads (`python -m torch.cuda._memory_viz trace_plot FILE -o out.html`).

pub mod pickle;

use crate::alloc::{BlockStatus, PoolKind, SegmentInfo, TraceEntry};
use crate::device::Device;
use pickle::{pydict, to_pickle, PyValue};

/// The largest device ordinal a snapshot is read with (CUDA numbers a host's devices from 0).
pub const MAX_ORDINAL: usize = 1023;

/// Segments, blocks and recorded events of one device at one moment.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MemorySnapshot {
    /// Device ordinal.
    pub device: usize,
    /// The allocator configuration, in `OOMGUARD_ALLOC_CONF` syntax.
    pub config: String,
    /// Segments in address order.
    pub segments: Vec<SegmentInfo>,
    /// Recorded events, oldest first (see [`crate::CachingAllocator::record_history`]).
    pub device_traces: Vec<TraceEntry>,
}

impl Device {
    /// A snapshot of the allocator with the recorded history.
    ///
    /// ```
    /// use oomguard_runtime::{ByteSize, Device};
    /// let dev = Device::sim(ByteSize::gib(1));
    /// dev.allocator().record_history(1000, false);
    /// let _b = dev.alloc::<f32>(1000).unwrap();
    /// let snap = dev.memory_snapshot();
    /// assert_eq!(snap.segments.len(), 1);
    /// assert!(snap.to_json().unwrap().contains("\"action\":\"alloc\""));
    /// let pkl = snap.to_pytorch_pickle();
    /// assert_eq!(&pkl[..2], &[0x80, 2]);
    /// ```
    pub fn memory_snapshot(&self) -> MemorySnapshot {
        MemorySnapshot {
            device: self.ordinal(),
            config: self.allocator().config().to_string(),
            segments: self.snapshot(),
            device_traces: self.allocator().history(),
        }
    }
}

impl MemorySnapshot {
    /// The snapshot as JSON.
    pub fn to_json(&self) -> Result<String, serde_json::Error> {
        serde_json::to_string(self)
    }

    /// Reads a snapshot written by [`MemorySnapshot::to_json`].
    /// Refused: a device ordinal above [`MAX_ORDINAL`], a segment with no block, and a segment
    /// whose blocks' sizes add up past 2^64 bytes (no snapshot of a device has them).
    pub fn from_json(s: &str) -> Result<Self, serde_json::Error> {
        let snap: Self = serde_json::from_str(s)?;
        let bad = |m: String| Err(<serde_json::Error as serde::de::Error>::custom(m));
        if snap.device > MAX_ORDINAL {
            return bad(format!(
                "device ordinal {} is above {MAX_ORDINAL}",
                snap.device
            ));
        }
        for (i, seg) in snap.segments.iter().enumerate() {
            if seg.blocks.is_empty() {
                return bad(format!("segment {i} has no block"));
            }
            let total = seg
                .blocks
                .iter()
                .try_fold(0u64, |t, b| t.checked_add(b.size));
            if total.is_none() {
                return bad(format!(
                    "segment {i}'s blocks add up to more than 2^64 bytes"
                ));
            }
        }
        Ok(snap)
    }

    /// The snapshot as a pickle in PyTorch's `_snapshot()` format: `segments` (with `blocks`),
    /// `device_traces` (one list per device) and `allocator_settings`. A growable segment is
    /// written as one segment per run of mapped memory, as PyTorch shows expandable segments.
    /// `device_traces` has one list per ordinal up to this device's; a `device` above
    /// [`MAX_ORDINAL`] (set by hand: [`from_json`](Self::from_json) refuses it) has its events
    /// in the list of [`MAX_ORDINAL`], and sizes that add up past 2^64 bytes are written as
    /// 2^64 − 1.
    pub fn to_pytorch_pickle(&self) -> Vec<u8> {
        let mut segments = Vec::new();
        for s in &self.segments {
            for run in mapped_runs(s) {
                segments.push(segment_value(self.device, s, run));
            }
        }
        let slot = self.device.min(MAX_ORDINAL);
        let mut traces = vec![PyValue::List(Vec::new()); slot + 1];
        traces[slot] = PyValue::List(self.device_traces.iter().map(trace_value).collect());
        let expandable = self.config.contains("expandable_segments:True");
        let root = pydict! {
            "segments" => PyValue::List(segments),
            "device_traces" => PyValue::List(traces),
            "allocator_settings" => pydict! {
                "PYTORCH_CUDA_ALLOC_CONF" => self.config.clone(),
                "expandable_segments" => expandable,
            },
        };
        to_pickle(&root)
    }
}

/// Maximal runs of mapped blocks of a segment (the whole segment when fixed).
fn mapped_runs(s: &SegmentInfo) -> Vec<&[crate::alloc::BlockInfo]> {
    s.blocks
        .split(|b| b.status == BlockStatus::Unmapped)
        .filter(|r| !r.is_empty())
        .collect()
}

fn segment_value(device: usize, s: &SegmentInfo, blocks: &[crate::alloc::BlockInfo]) -> PyValue {
    let sum = |f: &dyn Fn(&crate::alloc::BlockInfo) -> bool, req: bool| -> u64 {
        blocks
            .iter()
            .filter(|b| f(b))
            .map(|b| if req { b.requested } else { b.size })
            .fold(0u64, u64::saturating_add)
    };
    let allocated = sum(&|b| b.status == BlockStatus::Allocated, false);
    let active = sum(&|b| b.status != BlockStatus::Free, false);
    let requested = sum(&|b| b.status == BlockStatus::Allocated, true);
    let pool = match s.pool {
        PoolKind::Small => "small",
        PoolKind::Large => "large",
    };
    let block_values = blocks
        .iter()
        .map(|b| {
            let state = match b.status {
                BlockStatus::Allocated => "active_allocated",
                BlockStatus::PendingFree => "active_pending_free",
                BlockStatus::Free | BlockStatus::Unmapped => "inactive",
            };
            pydict! {
                "address" => b.addr,
                "size" => b.size,
                "requested_size" => b.requested,
                "state" => state,
                "frames" => PyValue::List(Vec::new()),
            }
        })
        .collect();
    pydict! {
        "device" => device as u64,
        "address" => blocks[0].addr,
        "total_size" => blocks.iter().map(|b| b.size).fold(0u64, u64::saturating_add),
        "allocated_size" => allocated,
        "active_size" => active,
        "requested_size" => requested,
        "stream" => s.stream,
        "segment_type" => pool,
        "segment_pool_id" => PyValue::Tuple(vec![PyValue::Int(0), PyValue::Int(0)]),
        "is_expandable" => s.growable,
        "frames" => PyValue::List(Vec::new()),
        "blocks" => PyValue::List(block_values),
    }
}

fn trace_value(e: &TraceEntry) -> PyValue {
    let frames = e
        .frames
        .iter()
        .map(|f| {
            pydict! {
                "filename" => f.filename.clone(),
                "line" => f.line as u64,
                "name" => "",
            }
        })
        .collect();
    pydict! {
        "action" => e.action.as_str(),
        "addr" => e.addr,
        "size" => e.size,
        "stream" => e.stream,
        "time_us" => e.time_us,
        "compile_context" => "N/A",
        "user_metadata" => e.user_metadata.clone(),
        "frames" => PyValue::List(frames),
    }
}
