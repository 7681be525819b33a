//! The event model every trace reader produces: allocations and frees, in program order.

use serde::Serialize;

/// What an event does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    /// An allocation of `bytes` that gets the id `id`.
    Alloc,
    /// The free of the allocation `id`.
    Free,
}

/// One allocation or free.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct Event {
    /// Allocation or free.
    pub op: Op,
    /// The allocation's id: unique among allocations of a trace; a free names the id it frees.
    pub id: u64,
    /// Bytes asked for (for a free: the bytes of the allocation it frees).
    pub bytes: u64,
    /// The stream the allocation belongs to (0: the default stream).
    pub stream: u64,
    /// The recording process's thread that made the call (0: unknown, or a trace of one
    /// thread): the CSV's `thread` column as written, RMM's thread ids numbered 1, 2, … in
    /// order of appearance. `oomguard replay --threads` replays each thread's events on a
    /// thread of its own.
    pub thread: u64,
}

impl Event {
    /// An allocation.
    pub fn alloc(id: u64, bytes: u64, stream: u64) -> Self {
        Self {
            op: Op::Alloc,
            id,
            bytes,
            stream,
            thread: 0,
        }
    }
    /// A free.
    pub fn free(id: u64, bytes: u64, stream: u64) -> Self {
        Self {
            op: Op::Free,
            id,
            bytes,
            stream,
            thread: 0,
        }
    }
    /// This event, made by thread `thread` of the recording process.
    ///
    /// ```
    /// use oomguard_cli::Event;
    /// assert_eq!(Event::alloc(0, 512, 0).on_thread(2).thread, 2);
    /// ```
    pub fn on_thread(self, thread: u64) -> Self {
        Self { thread, ..self }
    }
}

/// The formats a trace can come in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TraceFormat {
    /// `op,id,bytes,stream` CSV (the format of the shared traces and of `oomguard gen`).
    Csv,
    /// A PyTorch memory snapshot pickle (`torch.cuda.memory._snapshot()`).
    PytorchSnapshot,
    /// RMM's `logging_resource_adaptor` log (`Thread,Time,Action,Pointer,Size,Stream`).
    RmmLog,
}

impl std::fmt::Display for TraceFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TraceFormat::Csv => "csv",
            TraceFormat::PytorchSnapshot => "pytorch-snapshot",
            TraceFormat::RmmLog => "rmm-log",
        })
    }
}

/// A trace: its events in order, where it came from, and anything the reader had to skip.
#[derive(Clone, Debug, PartialEq)]
pub struct Trace {
    /// The format it was read from.
    pub format: TraceFormat,
    /// The events, in program order. Every free names an earlier, still live allocation.
    pub events: Vec<Event>,
    /// What the reader skipped or assumed (e.g. frees of memory allocated before recording began).
    pub notes: Vec<String>,
    /// Allocation sites (a snapshot's stack frames, innermost first, one per line), each once.
    pub sites: Vec<String>,
    /// The site of each allocation id that has one (an index into `sites`).
    pub alloc_site: std::collections::HashMap<u64, u32>,
}

impl Trace {
    /// A trace of `events` read from `format`, with no notes.
    pub fn new(format: TraceFormat, events: Vec<Event>) -> Self {
        Self {
            format,
            events,
            notes: Vec::new(),
            sites: Vec::new(),
            alloc_site: std::collections::HashMap::new(),
        }
    }

    /// The most bytes live at once (requested sizes): the floor of any allocator's peak. It
    /// stops at `u64::MAX`; a trace read from a file never gets there (reading refuses one
    /// with more live at once, [`crate::ReadError::TooMuchLive`]).
    ///
    /// ```
    /// use oomguard_cli::{Event, Trace, TraceFormat};
    /// let t = Trace::new(TraceFormat::Csv, vec![
    ///     Event::alloc(0, 100, 0), Event::alloc(1, 50, 0), Event::free(0, 100, 0), Event::alloc(2, 10, 0),
    /// ]);
    /// assert_eq!(t.peak_live_bytes(), 150);
    /// ```
    pub fn peak_live_bytes(&self) -> u64 {
        self.checked_peak_live().unwrap_or(u64::MAX)
    }

    /// [`Trace::peak_live_bytes`], or the 1-based index of the allocation at which more than
    /// `u64::MAX` bytes are live.
    pub(crate) fn checked_peak_live(&self) -> Result<u64, usize> {
        let mut live = 0u64;
        let mut peak = 0u64;
        for (i, e) in self.events.iter().enumerate() {
            match e.op {
                Op::Alloc => {
                    live = live.checked_add(e.bytes).ok_or(i + 1)?;
                    peak = peak.max(live);
                }
                Op::Free => live = live.saturating_sub(e.bytes),
            }
        }
        Ok(peak)
    }

    /// Allocations never freed, and their bytes.
    pub fn live_at_end(&self) -> (usize, u64) {
        let mut live: std::collections::HashMap<u64, u64> = std::collections::HashMap::new();
        for e in &self.events {
            match e.op {
                Op::Alloc => {
                    live.insert(e.id, e.bytes);
                }
                Op::Free => {
                    live.remove(&e.id);
                }
            }
        }
        (
            live.len(),
            live.values().fold(0u64, |a, b| a.saturating_add(*b)),
        )
    }

    /// Adds a note on what is still live at the end. A trace file cut short at a line boundary
    /// reads as a valid shorter trace; what it leaves live (half a training step's activations)
    /// is the sign, so the note puts it beside the peak for the reader to judge.
    pub fn note_live_at_end(&mut self) {
        let (n, bytes) = self.live_at_end();
        if n == 0 {
            return;
        }
        let peak = self.peak_live_bytes().max(1);
        self.notes.push(format!(
            "{n} allocations ({}, {:.1}% of peak live) are still live at the end: the program's \
             state when recording stopped, or a file cut short",
            oomguard_runtime::ByteSize(bytes),
            100.0 * bytes as f64 / peak as f64
        ));
    }

    /// Number of allocations.
    pub fn allocs(&self) -> usize {
        self.events.iter().filter(|e| e.op == Op::Alloc).count()
    }
}
