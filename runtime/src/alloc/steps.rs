//! The data of step plans (`step_plan`): step marks, the recording of the current step and
//! the installed plan, held in the allocator's state. Kept apart from the operations on the
//! state that use them, so that the state names its fields' types without naming those
//! operations.

use rustc_hash::FxHashMap;

use super::block::{BlockId, SegId};
use crate::backend::StreamId;

/// No segment: no plan is installed.
pub(crate) const NO_SEG: SegId = SegId::MAX;

/// One large request of the recorded step.
#[derive(Clone, Copy, Debug)]
pub(super) struct Request {
    pub(super) size: u64,
    pub(super) stream: StreamId,
    /// The step's clock (large allocations and frees so far) at the allocation.
    pub(super) start: usize,
    /// At the free (`usize::MAX`: still live at the step's end).
    pub(super) end: usize,
}

/// The installed plan: one mapped address range and an offset for each planned request.
///
/// A request is matched by its size, stream and occurrence: the j-th request of a size in a
/// step takes the offset of the j-th request of that size in the recorded step. Requests of
/// other sizes that one step has and another lacks (gradients and optimizer state made in the
/// first step) then shift nothing.
#[derive(Debug)]
pub(super) struct Plan {
    pub(super) seg: SegId,
    pub(super) base: u64,
    /// By (size, stream): each occurrence's offset, `None` for one served as before.
    pub(super) slots: FxHashMap<(u64, StreamId), Vec<Option<u64>>>,
    /// A plan shared at page granularity: its pages (`shared_plan`); `None`: one contiguous
    /// layout.
    pub(super) shared: Option<SharedPages>,
}

/// The pages behind a shared plan (`shared_plan`).
#[derive(Debug)]
pub(super) struct SharedPages {
    /// The home range: the pool's pages, mapped once.
    pub(super) home: u64,
    /// Its bytes (the memory the plan holds). The slots' address range is the segment
    /// `State::planned_seg`, whose blocks are the slots' allocations.
    pub(super) home_bytes: u64,
    /// Each slot by its offset in the range: its bytes (whole pages) and its pool pages, as
    /// runs `(first page, pages)`.
    pub(super) slots: FxHashMap<u64, (u64, Vec<(u32, u32)>)>,
    /// Live blocks on each pool page (0 or 1).
    pub(super) users: Vec<u8>,
    /// Live blocks served from a slot: block -> the slot's offset.
    pub(super) live: FxHashMap<BlockId, u64>,
}

impl SharedPages {
    /// What giving the plan back would return now: its pool once no block of it is live.
    pub(super) fn releasable(&self) -> u64 {
        if self.live.is_empty() {
            self.home_bytes
        } else {
            0
        }
    }
}

/// Step marks, the recording of the current step and the installed plan.
#[derive(Debug, Default)]
pub(crate) struct Steps {
    /// Steps are marked and a plan is possible: large requests are recorded.
    pub(super) on: bool,
    pub(super) requests: Vec<Request>,
    /// Live recorded blocks: their request index.
    pub(super) open: FxHashMap<BlockId, u32>,
    /// The previous step's large requests (size, stream), in order.
    pub(super) previous: Vec<(u64, StreamId)>,
    /// Steps in a row that repeated the one before (0: the last step differed).
    pub(super) repeated: u32,
    /// The last request was served at its planned offset.
    pub(super) hit: bool,
    /// Requests of each (size, stream) recorded so far in this step.
    pub(super) seen: FxHashMap<(u64, StreamId), u32>,
    pub(super) clock: usize,
    /// `unmapped_bytes_total` and `num_alloc_retries` at the step's start, or after the last
    /// `empty_cache` (whose unmaps are not the step's moves).
    pub(super) moved_at: (u64, u64),
    /// The step moved pages or retried before the last `empty_cache`.
    pub(super) moved_before_empty: bool,
    pub(super) plan: Option<Plan>,
    /// A dropped shared plan whose blocks are not all released yet: its memory goes when they
    /// are (`release_drained_plan`); no plan is installed meanwhile.
    pub(super) draining: Option<SharedPages>,
    pub(super) misses: u64,
    pub(super) missed_steps: u32,
    /// The step sequence that repeats now was laid out for room (a step with room to spare,
    /// nothing moved) and found not worth a plan: not laid out again until the steps change.
    pub(super) room_checked: bool,
    /// A plan was dropped for its misses: no more plans for room alone (a loop whose steps
    /// vary would move its pages at every new plan).
    pub(super) room_refused: bool,
    /// The step sequence that repeats now was laid out and its plan could not be mapped (the
    /// layout is taller than the memory the step's pages can give): not tried again until the
    /// steps change or `empty_cache` runs. Each try gives every free page back, and the next
    /// step maps them again: at the edge of memory that moved more than the card every step.
    pub(super) plan_unfit: bool,
}
