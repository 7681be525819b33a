//! Allocation history: a bounded ring of alloc/free/segment events, as PyTorch's
//! `_record_memory_history` keeps them, with the allocating source location when asked.

use std::collections::VecDeque;
use std::panic::Location;
use std::time::{SystemTime, UNIX_EPOCH};

use super::CachingAllocator;
use crate::backend::StreamId;

/// What happened, with PyTorch's action names (`alloc`, `free_requested`, …).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TraceAction {
    /// A block was handed out.
    Alloc,
    /// Its owner freed it.
    FreeRequested,
    /// It went back to the cache (after other streams' work, if it was used there).
    FreeCompleted,
    /// A fixed segment was obtained from the device.
    SegmentAlloc,
    /// A fixed segment was returned to the device.
    SegmentFree,
    /// Pages were mapped into a growable segment.
    SegmentMap,
    /// Pages were unmapped from a growable segment.
    SegmentUnmap,
    /// An allocation failed with out-of-memory (`addr` holds the device's free bytes, as in
    /// PyTorch).
    Oom,
}

impl TraceAction {
    /// PyTorch's name of the action.
    pub fn as_str(self) -> &'static str {
        match self {
            TraceAction::Alloc => "alloc",
            TraceAction::FreeRequested => "free_requested",
            TraceAction::FreeCompleted => "free_completed",
            TraceAction::SegmentAlloc => "segment_alloc",
            TraceAction::SegmentFree => "segment_free",
            TraceAction::SegmentMap => "segment_map",
            TraceAction::SegmentUnmap => "segment_unmap",
            TraceAction::Oom => "oom",
        }
    }
}

/// A source location that allocated a block.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Frame {
    /// Source file.
    pub filename: String,
    /// Line.
    pub line: u32,
    /// Column.
    pub column: u32,
}

impl From<&Location<'_>> for Frame {
    fn from(l: &Location<'_>) -> Self {
        Frame {
            filename: l.file().to_string(),
            line: l.line(),
            column: l.column(),
        }
    }
}

/// One recorded event.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TraceEntry {
    /// What happened.
    pub action: TraceAction,
    /// Device address (for `oom`: the device's free bytes).
    pub addr: u64,
    /// Bytes: for `alloc`, `free_requested` and `free_completed` the size the caller asked for
    /// (as PyTorch records it; the block's rounded size is in the snapshot), for segment events
    /// the segment's or mapping's size, for `oom` the request.
    pub size: u64,
    /// Stream.
    pub stream: StreamId,
    /// Microseconds since the Unix epoch.
    pub time_us: u64,
    /// Where the allocation was made (alloc events, when locations are recorded).
    pub frames: Vec<Frame>,
}

#[derive(Debug)]
pub(crate) struct History {
    ring: VecDeque<TraceEntry>,
    max: usize,
    locations: bool,
}

impl History {
    pub fn record(
        &mut self,
        action: TraceAction,
        addr: u64,
        size: u64,
        stream: StreamId,
        loc: Option<&'static Location<'static>>,
    ) {
        if self.ring.len() == self.max {
            self.ring.pop_front();
        }
        let time_us = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        let frames = match loc {
            Some(l) if self.locations => vec![Frame::from(l)],
            _ => Vec::new(),
        };
        self.ring.push_back(TraceEntry {
            action,
            addr,
            size,
            stream,
            time_us,
            frames,
        });
    }
}

impl CachingAllocator {
    /// Starts (or, with `max_entries == 0`, stops) recording the last `max_entries` allocator
    /// events; with `locations`, alloc events carry the caller's source location. Restarting
    /// clears what was recorded.
    ///
    /// ```
    /// use oomguard_runtime::{alloc::TraceAction, ByteSize, Device};
    /// let dev = Device::sim(ByteSize::gib(1));
    /// dev.allocator().record_history(100, true);
    /// drop(dev.alloc::<u8>(10).unwrap());
    /// let h = dev.allocator().history();
    /// assert_eq!(h[0].action, TraceAction::SegmentMap);
    /// assert_eq!(h[1].action, TraceAction::Alloc);
    /// assert_eq!(h[2].action, TraceAction::FreeRequested);
    /// ```
    pub fn record_history(&self, max_entries: usize, locations: bool) {
        let mut st = self.lock();
        st.history = (max_entries > 0).then(|| History {
            ring: VecDeque::with_capacity(max_entries.min(1 << 16)),
            max: max_entries,
            locations,
        });
    }

    /// The recorded events, oldest first (empty when not recording).
    pub fn history(&self) -> Vec<TraceEntry> {
        let st = self.lock();
        st.history
            .as_ref()
            .map(|h| h.ring.iter().cloned().collect())
            .unwrap_or_default()
    }
}
