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
    /// The thread that caused the event: a number unique in the process (threads are numbered
    /// 1, 2, … in the order they first touched an allocator), so that a trace can be replayed
    /// with each event on its own thread (libtorch's autograd engine frees the forward's
    /// tensors on its own thread). 0: unknown (a thread that was exiting).
    #[serde(default)]
    pub thread: u64,
    /// Where the allocation was made (alloc events) or freed (free_requested events), when the
    /// history's [`HistoryContext`] asks for it: the caller of the allocator or device method.
    pub frames: Vec<Frame>,
    /// The metadata set with [`CachingAllocator::set_history_metadata`] when the event was
    /// recorded (PyTorch's `user_metadata`); empty when none.
    #[serde(default)]
    pub user_metadata: String,
    /// The full backtrace of an alloc or free_requested event, when [`HistoryOptions::stacks`]
    /// asked for it (PyTorch's `stacks="all"`): it names the code that dropped a buffer, which
    /// `frames` cannot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backtrace: Option<String>,
}

/// Which events carry the source location of their caller (PyTorch's `context` argument of
/// `_record_memory_history`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum HistoryContext {
    /// None (PyTorch's `context=None` / `"state"`).
    None,
    /// Alloc events (`"alloc"`).
    Alloc,
    /// Alloc and free events (`"all"`, PyTorch's default).
    #[default]
    All,
}

/// What [`CachingAllocator::record_history_with`] records, as PyTorch's
/// `torch.cuda.memory._record_memory_history` options.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HistoryOptions {
    /// The most events kept (the oldest go first); 0 stops recording.
    pub max_entries: usize,
    /// Which events carry their caller's location.
    pub context: HistoryContext,
    /// Actions not recorded at all (PyTorch's `skip_actions`).
    pub skip_actions: Vec<TraceAction>,
    /// Also capture a full backtrace for the events that carry a location (slow).
    pub stacks: bool,
    /// Drop what was recorded so far (PyTorch's `clear_history`); otherwise it is kept, and
    /// only what is captured from now on changes.
    pub clear: bool,
}

impl Default for HistoryOptions {
    fn default() -> Self {
        Self {
            max_entries: 100_000,
            context: HistoryContext::All,
            skip_actions: Vec::new(),
            stacks: false,
            clear: false,
        }
    }
}

#[derive(Debug)]
pub(crate) struct History {
    ring: VecDeque<TraceEntry>,
    max: usize,
    context: HistoryContext,
    skip: Vec<TraceAction>,
    stacks: bool,
    metadata: String,
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
        if self.skip.contains(&action) {
            return;
        }
        if self.ring.len() >= self.max {
            self.ring.pop_front();
        }
        let time_us = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        let located = match action {
            TraceAction::Alloc => self.context != HistoryContext::None,
            TraceAction::FreeRequested => self.context == HistoryContext::All,
            _ => false,
        };
        let frames = match loc {
            Some(l) if located => vec![Frame::from(l)],
            _ => Vec::new(),
        };
        let backtrace = (located && self.stacks)
            .then(|| std::backtrace::Backtrace::force_capture().to_string());
        self.ring.push_back(TraceEntry {
            action,
            addr,
            size,
            stream,
            time_us,
            thread: super::thread_cache::thread_token(),
            frames,
            user_metadata: self.metadata.clone(),
            backtrace,
        });
    }
}

impl CachingAllocator {
    /// Starts (or, with `max_entries == 0`, stops) recording the last `max_entries` allocator
    /// events; with `locations`, alloc events carry the caller's source location. Restarting
    /// clears what was recorded ([`CachingAllocator::record_history_with`] can keep it).
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
        self.record_history_with(HistoryOptions {
            max_entries,
            context: if locations {
                HistoryContext::Alloc
            } else {
                HistoryContext::None
            },
            skip_actions: Vec::new(),
            stacks: false,
            clear: true,
        });
    }

    /// Starts, reconfigures or (with `max_entries == 0`) stops recording, as PyTorch's
    /// `_record_memory_history`: which events carry where they were allocated or freed, which
    /// actions are skipped, full backtraces. Unless `clear`, what was recorded stays (the
    /// oldest events go if the new `max_entries` is smaller) and only what is captured from
    /// now on changes.
    pub fn record_history_with(&self, opts: HistoryOptions) {
        let mut st = self.lock();
        if opts.max_entries == 0 {
            st.history = None;
            self.update_caching(&mut st);
            return;
        }
        let (mut ring, metadata) = match st.history.take() {
            Some(h) if !opts.clear => (h.ring, h.metadata),
            Some(h) => (VecDeque::new(), h.metadata),
            None => (VecDeque::new(), String::new()),
        };
        while ring.len() > opts.max_entries {
            ring.pop_front();
        }
        ring.reserve(opts.max_entries.min(1 << 16).saturating_sub(ring.len()));
        st.history = Some(History {
            ring,
            max: opts.max_entries,
            context: opts.context,
            skip: opts.skip_actions,
            stacks: opts.stacks,
            metadata,
        });
        self.update_caching(&mut st);
    }

    /// Metadata recorded with every following event (`None`: none), as PyTorch's
    /// `torch._C._cuda_setMemoryMetadata`, e.g. the training step. Kept while recording.
    pub fn set_history_metadata(&self, metadata: Option<String>) {
        if let Some(h) = &mut self.lock().history {
            h.metadata = metadata.unwrap_or_default();
        }
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
