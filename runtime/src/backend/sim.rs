//! `SimDevice`: a simulated GPU for tests, CI and trace replay.
//!
//! It accounts memory exactly like a device (a capacity, segments, 2 MiB pages of growable
//! segments, 512-byte alignment) and is deterministic. In host-backed mode buffers hold real bytes,
//! backed lazily in 64 KiB chunks so untouched capacity costs no RAM; in address-only mode nothing
//! is backed at all (for replaying traces of tens of GiB). Faults can be injected at run time
//! through [`FaultPlan`].

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use super::{Backend, BackendError, BackendErrorKind, DevicePtr, EventId, MemInfo, StreamId};
use crate::backend::handle_runs::HandleRuns;
use crate::ByteSize;

/// Page size of the simulated device's growable segments (as on an H100), unless
/// [`SimDevice::with_page_size`] sets another.
pub const SIM_GRANULARITY: u64 = 2 << 20;
/// The smallest page size [`SimDevice::with_page_size`] accepts.
pub const SIM_MIN_PAGE: u64 = 4 << 10;
/// The largest page size [`SimDevice::with_page_size`] accepts.
pub const SIM_MAX_PAGE: u64 = 1 << 30;
/// Alignment of every simulated segment.
pub const SIM_ALIGNMENT: u64 = 512;
const CHUNK: u64 = 64 << 10;
// Addresses start high so that a null or small integer is never a valid device pointer.
const VA_START: u64 = 1 << 40;

/// Whether simulated memory holds data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SimMode {
    /// Buffers hold real bytes (lazily backed): data round-trips.
    HostBacked,
    /// Only addresses and accounting; copies are rejected. For replays of huge traces.
    AddressOnly,
}

/// Faults to inject into a [`SimDevice`]; shared, so a test can change it while the device runs.
///
/// Request faults act on every allocation request (cache hits included), so a test can make the
/// N-th allocation of a training step fail; capacity changes act on the device's physical memory.
#[derive(Debug, Default)]
pub struct FaultPlan {
    requests: AtomicU64,
    fail_at: AtomicU64,
    fail_above: AtomicU64,
    /// Calls seen and the call index to fail, per [`SimOp`].
    op_calls: [AtomicU64; 3],
    op_fail_at: [AtomicU64; 3],
    op_fail_from: [AtomicU64; 3],
}

/// A backend operation of the simulated device that a [`FaultPlan`] can make fail, so that a
/// test can inject out-of-memory where the allocator acts, not only before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SimOp {
    /// `alloc_segment` (fixed segments).
    AllocSegment = 0,
    /// `reserve` (address ranges of growable segments).
    Reserve = 1,
    /// `map` (pages of growable segments).
    Map = 2,
}

const NONE: u64 = u64::MAX;

impl FaultPlan {
    fn new() -> Self {
        Self {
            requests: AtomicU64::new(0),
            fail_at: AtomicU64::new(NONE),
            fail_above: AtomicU64::new(NONE),
            op_calls: Default::default(),
            op_fail_at: [
                AtomicU64::new(NONE),
                AtomicU64::new(NONE),
                AtomicU64::new(NONE),
            ],
            op_fail_from: [
                AtomicU64::new(NONE),
                AtomicU64::new(NONE),
                AtomicU64::new(NONE),
            ],
        }
    }
    /// Makes every call of `op` from index `n` on (0-based, counted from now) fail with
    /// out-of-memory, until [`FaultPlan::clear`].
    pub fn fail_ops_from(&self, op: SimOp, n: u64) {
        let i = op as usize;
        let base = self.op_calls[i].load(Ordering::SeqCst);
        self.op_fail_from[i].store(base.saturating_add(n), Ordering::SeqCst);
    }
    /// Makes the call of `op` with index `n` (0-based, counted from now) fail with
    /// out-of-memory, once.
    pub fn fail_nth_op(&self, op: SimOp, n: u64) {
        let i = op as usize;
        let base = self.op_calls[i].load(Ordering::SeqCst);
        self.op_fail_at[i].store(base.saturating_add(n), Ordering::SeqCst);
    }
    /// How many calls of `op` the device has seen (failed ones included).
    pub fn op_calls(&self, op: SimOp) -> u64 {
        self.op_calls[op as usize].load(Ordering::SeqCst)
    }
    fn check_op(&self, op: SimOp, name: &'static str) -> Result<(), BackendError> {
        let i = op as usize;
        let idx = self.op_calls[i].fetch_add(1, Ordering::SeqCst);
        if idx == self.op_fail_at[i].load(Ordering::SeqCst)
            || idx >= self.op_fail_from[i].load(Ordering::SeqCst)
        {
            return Err(BackendError::oom(
                name,
                format!("injected fault: {name} call #{idx} fails"),
            ));
        }
        Ok(())
    }
    /// Makes the allocation request with index `n` (0-based, counted from now) fail with
    /// out-of-memory, once.
    pub fn fail_nth_request(&self, n: u64) {
        let base = self.requests.load(Ordering::SeqCst);
        self.fail_at.store(base.saturating_add(n), Ordering::SeqCst);
    }
    /// Makes every allocation request larger than `bytes` fail with out-of-memory.
    pub fn fail_requests_above(&self, bytes: u64) {
        self.fail_above.store(bytes, Ordering::SeqCst);
    }
    /// Removes all faults.
    pub fn clear(&self) {
        self.fail_at.store(NONE, Ordering::SeqCst);
        self.fail_above.store(NONE, Ordering::SeqCst);
        for f in self.op_fail_at.iter().chain(&self.op_fail_from) {
            f.store(NONE, Ordering::SeqCst);
        }
    }
    /// How many allocation requests the device has seen.
    pub fn requests_seen(&self) -> u64 {
        self.requests.load(Ordering::SeqCst)
    }

    fn check(&self, bytes: u64) -> Result<(), BackendError> {
        let idx = self.requests.fetch_add(1, Ordering::SeqCst);
        if idx == self.fail_at.load(Ordering::SeqCst) {
            return Err(BackendError::oom(
                "alloc",
                format!("injected fault: allocation request #{idx} fails"),
            ));
        }
        if bytes > self.fail_above.load(Ordering::SeqCst) {
            return Err(BackendError::oom(
                "alloc",
                format!(
                    "injected fault: requests above {} fail",
                    ByteSize(self.fail_above.load(Ordering::SeqCst))
                ),
            ));
        }
        Ok(())
    }
}

/// Counts of backend calls made on a [`SimDevice`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimCallCounts {
    /// `alloc_segment` calls that succeeded.
    pub alloc_segment: u64,
    /// `free_segment` calls.
    pub free_segment: u64,
    /// `reserve` calls.
    pub reserve: u64,
    /// `release` calls.
    pub release: u64,
    /// `map` calls that succeeded.
    pub map: u64,
    /// `unmap` calls.
    pub unmap: u64,
    /// Backend calls that failed with out-of-memory.
    pub oom: u64,
    /// Pages created by `map` (a real device's `cuMemCreate`).
    pub pages_created: u64,
    /// Pages `map` backed with spares kept by `unmap_keep` (a remap, no create).
    pub pages_reused: u64,
    /// Pages freed (`unmap`, `release_spares`; a real device's `cuMemRelease`).
    pub pages_released: u64,
    /// `synchronize_streams` calls (one stream's work waited for, not the device's).
    pub stream_syncs: u64,
}

#[derive(Debug)]
struct Region {
    size: u64,
    growable: bool,
}

#[derive(Debug)]
struct SimState {
    capacity: u64,
    /// Page size of growable segments (and rounding of address ranges).
    granularity: u64,
    used: u64,
    /// Bytes of spare pages kept by `unmap_keep` (counted in `used`).
    spare: u64,
    next_va: u64,
    // base -> region: segments (fixed) and reserved ranges (growable)
    regions: BTreeMap<u64, Region>,
    // mapped pages of growable ranges, as disjoint runs: start -> end (page-aligned), so that
    // mapping a huge range costs one entry, not one per page
    mapped: BTreeMap<u64, u64>,
    /// Physical handles larger than a page (`map_handles`): start -> end. An unmap must take
    /// each one whole, as `cuMemUnmap` does.
    handles: HandleRuns,
    /// Aliases of mapped pages (`map_alias`): start -> (end, the address they alias). They
    /// hold no memory of their own; data written through one is read through the other.
    aliases: BTreeMap<u64, (u64, u64)>,
    chunks: HashMap<u64, Box<[u8]>>,
    calls: SimCallCounts,
    /// Events stay pending until their stream is synchronised (see
    /// [`SimDevice::with_pending_events`]); otherwise they complete at once.
    pending_events: bool,
    /// Recorded events: id -> (stream, completed).
    events: BTreeMap<EventId, (StreamId, bool)>,
    next_event: EventId,
}

/// A simulated GPU. Cheap to clone (shared state).
///
/// ```
/// use oomguard_runtime::{ByteSize, backend::{Backend, sim::SimDevice}};
/// let sim = SimDevice::new(ByteSize::gib(8));
/// let p = sim.alloc_segment(1 << 20, 0).unwrap();
/// sim.copy_to_device(p, &[1, 2, 3]).unwrap();
/// let mut out = [0u8; 3];
/// sim.copy_to_host(&mut out, p).unwrap();
/// assert_eq!(out, [1, 2, 3]);
/// ```
#[derive(Clone, Debug)]
pub struct SimDevice {
    mode: SimMode,
    ordinal: usize,
    faults: Arc<FaultPlan>,
    state: Arc<Mutex<SimState>>,
}

impl SimDevice {
    /// A host-backed simulated device of `capacity`.
    pub fn new(capacity: ByteSize) -> Self {
        Self::with_mode(capacity, SimMode::HostBacked)
    }
    /// An address-only simulated device of `capacity` (no data, for replays).
    pub fn address_only(capacity: ByteSize) -> Self {
        Self::with_mode(capacity, SimMode::AddressOnly)
    }
    /// A simulated device of `capacity` in `mode`.
    pub fn with_mode(capacity: ByteSize, mode: SimMode) -> Self {
        Self {
            mode,
            ordinal: 0,
            faults: Arc::new(FaultPlan::new()),
            state: Arc::new(Mutex::new(SimState {
                capacity: capacity.0,
                granularity: SIM_GRANULARITY,
                used: 0,
                spare: 0,
                next_va: VA_START,
                regions: BTreeMap::new(),
                mapped: BTreeMap::new(),
                handles: HandleRuns::default(),
                aliases: BTreeMap::new(),
                chunks: HashMap::new(),
                calls: SimCallCounts::default(),
                pending_events: false,
                events: BTreeMap::new(),
                next_event: 1,
            })),
        }
    }
    /// Events recorded on a stream stay pending until that stream is synchronised
    /// ([`SimDevice::synchronize_stream`], [`Backend::synchronize`], or the allocator waiting
    /// for the event), as the work queued on a real stream would keep them; by default they
    /// complete at once. Lets tests observe delayed reuse after `record_stream`.
    pub fn with_pending_events(self) -> Self {
        self.lock().pending_events = true;
        self
    }
    /// Growable segments map pages of `bytes` instead of [`SIM_GRANULARITY`] (2 MiB, an H100's
    /// granularity): to see how much of a replay's reserved memory is page rounding. A power
    /// of two from [`SIM_MIN_PAGE`] (4 KiB) to [`SIM_MAX_PAGE`] (1 GiB), set before any segment
    /// or range exists; otherwise an `InvalidArgument` error that says which.
    ///
    /// ```
    /// use oomguard_runtime::{ByteSize, backend::{Backend, sim::SimDevice}};
    /// let sim = SimDevice::address_only(ByteSize::gib(1)).with_page_size(64 << 10).unwrap();
    /// assert_eq!(sim.granularity(), 64 << 10);
    /// assert!(SimDevice::new(ByteSize::gib(1)).with_page_size(3 << 20).is_err());
    /// ```
    pub fn with_page_size(self, bytes: u64) -> Result<Self, BackendError> {
        let invalid =
            |m: String| BackendError::new(BackendErrorKind::InvalidArgument, "with_page_size", m);
        if !bytes.is_power_of_two() || !(SIM_MIN_PAGE..=SIM_MAX_PAGE).contains(&bytes) {
            return Err(invalid(format!(
                "{bytes} bytes: the simulated device's page size must be a power of two from {} to {}",
                ByteSize(SIM_MIN_PAGE),
                ByteSize(SIM_MAX_PAGE)
            )));
        }
        {
            let mut st = self.lock();
            if !st.regions.is_empty() {
                return Err(invalid(
                    "the page size of a simulated device that already has segments cannot change"
                        .into(),
                ));
            }
            st.granularity = bytes;
        }
        Ok(self)
    }
    /// Completes the work queued on `stream` so far: its recorded events are done.
    pub fn synchronize_stream(&self, stream: StreamId) {
        for (s, done) in self.lock().events.values_mut() {
            if *s == stream {
                *done = true;
            }
        }
    }
    /// Recorded events not yet completed.
    pub fn pending_events(&self) -> usize {
        self.lock().events.values().filter(|(_, d)| !d).count()
    }
    /// Sets the ordinal shown in messages.
    pub fn with_ordinal(mut self, ordinal: usize) -> Self {
        self.ordinal = ordinal;
        self
    }
    /// The fault plan, to inject faults while the device runs.
    pub fn faults(&self) -> Arc<FaultPlan> {
        Arc::clone(&self.faults)
    }
    /// Changes the capacity at run time, as when another process takes memory. Memory already in
    /// use stays valid; new requests fail until usage drops below the new capacity.
    pub fn set_capacity(&self, capacity: ByteSize) {
        self.lock().capacity = capacity.0;
    }
    /// Unmaps whole mapped pages; `keep`: their memory stays as spares for the next `map`.
    fn unmap_pages(&self, addr: DevicePtr, bytes: u64, keep: bool) -> Result<(), BackendError> {
        let mut st = self.lock();
        let end = addr.checked_add(bytes).unwrap_or(0);
        let g = st.granularity;
        let all_mapped =
            addr % g == 0 && bytes % g == 0 && end > addr && covered(&st.mapped, addr, end);
        if !all_mapped {
            return Err(BackendError::new(
                BackendErrorKind::InvalidArgument,
                "unmap",
                format!("{bytes} bytes at {addr:#x} are not mapped pages"),
            ));
        }
        // pages another address aliases stay until that alias is unmapped
        let aliased = st
            .aliases
            .iter()
            .any(|(&a, &(e, src))| src < end && src + (e - a) > addr);
        if aliased {
            return Err(BackendError::new(
                BackendErrorKind::InvalidArgument,
                "unmap",
                format!("{bytes} bytes at {addr:#x} are aliased elsewhere (map_alias)"),
            ));
        }
        // a handle of `map_handles` is unmapped whole or not at all
        if st.handles.cuts(addr) || st.handles.cuts(end) {
            return Err(BackendError::new(
                BackendErrorKind::InvalidArgument,
                "unmap",
                format!("{bytes} bytes at {addr:#x} cut a physical handle"),
            ));
        }
        st.handles.remove(addr, end);
        // remove the runs overlapping [addr, end), keeping their parts outside it
        let runs: Vec<(u64, u64)> = st
            .mapped
            .range(..end)
            .rev()
            .take_while(|(_, &e)| e > addr)
            .map(|(&s, &e)| (s, e))
            .collect();
        for (s, e) in runs {
            st.mapped.remove(&s);
            if s < addr {
                st.mapped.insert(s, addr);
            }
            if e > end {
                st.mapped.insert(end, e);
            }
        }
        if keep {
            st.spare += bytes;
        } else {
            st.used -= bytes;
            st.calls.pages_released += bytes / g;
        }
        st.calls.unmap += 1;
        Self::drop_chunks(&mut st, addr, bytes);
        Ok(())
    }
    /// The physical handles larger than a page now mapped ([`Backend::map_handles`]), as runs
    /// of equal handles: `(start, end, bytes of each handle)`. An unmap takes each whole.
    pub fn handle_runs(&self) -> Vec<(u64, u64, u64)> {
        self.lock().handles.runs().collect()
    }
    /// Physical bytes in use (segments, mapped pages and spare pages).
    pub fn used(&self) -> u64 {
        self.lock().used
    }
    /// Backend call counts so far.
    pub fn calls(&self) -> SimCallCounts {
        self.lock().calls
    }
    /// The mode this device was made in.
    pub fn mode(&self) -> SimMode {
        self.mode
    }

    fn lock(&self) -> MutexGuard<'_, SimState> {
        // A panic while holding this lock cannot leave the state half-updated (every update is
        // checked first, then applied), so a poisoned lock is safe to use.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Address space for `bytes`: past every range handed out so far while the 64-bit space
    /// lasts, then the first gap that ranges given back left (a process that reserves and
    /// releases forever, as `empty_cache` in a loop does, never runs out); none: an
    /// out-of-memory, as `cuMemAddressReserve` reports it.
    fn take_va(st: &mut SimState, bytes: u64) -> Result<u64, BackendError> {
        let g = st.granularity;
        let exhausted = || {
            BackendError::new(
                BackendErrorKind::OutOfMemory,
                "reserve",
                format!("no free range of {bytes} bytes of address space is left"),
            )
        };
        let span = bytes.checked_next_multiple_of(g).ok_or_else(exhausted)?;
        if let Some(end) = st.next_va.checked_add(span) {
            let base = st.next_va;
            st.next_va = end;
            return Ok(base);
        }
        let mut cursor = VA_START;
        for (&base, r) in &st.regions {
            if base >= cursor && base - cursor >= span {
                return Ok(cursor);
            }
            let end = base.saturating_add(r.size).checked_next_multiple_of(g);
            cursor = cursor.max(end.ok_or_else(exhausted)?);
        }
        cursor
            .checked_add(span)
            .map(|_| cursor)
            .ok_or_else(exhausted)
    }

    /// Checks that `[addr, addr+len)` lies in a live segment or in mapped pages.
    fn check_access(
        st: &SimState,
        op: &'static str,
        addr: u64,
        len: u64,
    ) -> Result<(), BackendError> {
        let bad = || {
            BackendError::new(
                BackendErrorKind::InvalidArgument,
                op,
                format!("{len} bytes at {addr:#x} are not device memory"),
            )
        };
        if len == 0 {
            return Ok(());
        }
        let end = addr.checked_add(len).ok_or_else(bad)?;
        let (&base, region) = st.regions.range(..=addr).next_back().ok_or_else(bad)?;
        if end > base + region.size {
            return Err(bad());
        }
        if region.growable && !covered_or_aliased(st, addr, end) {
            return Err(bad());
        }
        Ok(())
    }

    fn drop_chunks(st: &mut SimState, addr: u64, len: u64) {
        if st.chunks.is_empty() {
            return;
        }
        let (first, last) = (addr / CHUNK, addr.saturating_add(len).div_ceil(CHUNK));
        if last - first > st.chunks.len() as u64 {
            // a huge range: visit the chunks that exist rather than every chunk of the range
            st.chunks.retain(|&c, _| c < first || c >= last);
        } else {
            for c in first..last {
                st.chunks.remove(&c);
            }
        }
    }

    fn oom(st: &mut SimState, op: &'static str, bytes: u64) -> BackendError {
        st.calls.oom += 1;
        BackendError::oom(
            op,
            format!(
                "out of memory: {} requested, {} of {} free",
                ByteSize(bytes),
                ByteSize(st.capacity.saturating_sub(st.used)),
                ByteSize(st.capacity)
            ),
        )
    }

    fn require_data(&self, op: &'static str) -> Result<(), BackendError> {
        if self.mode == SimMode::AddressOnly {
            return Err(BackendError::new(
                BackendErrorKind::InvalidArgument,
                op,
                "this simulated device is address-only and holds no data",
            ));
        }
        Ok(())
    }
}

impl Backend for SimDevice {
    fn name(&self) -> String {
        match self.lock().granularity {
            SIM_GRANULARITY => "simulated device".to_string(),
            g => format!("simulated device (pages of {})", ByteSize(g)),
        }
    }
    fn ordinal(&self) -> usize {
        self.ordinal
    }
    fn mem_info(&self) -> Result<MemInfo, BackendError> {
        let st = self.lock();
        Ok(MemInfo {
            free: st.capacity.saturating_sub(st.used),
            total: st.capacity,
        })
    }
    fn granularity(&self) -> u64 {
        self.lock().granularity
    }
    fn supports_growable(&self) -> bool {
        true
    }

    fn alloc_segment(&self, bytes: u64, _stream: StreamId) -> Result<DevicePtr, BackendError> {
        if bytes == 0 || bytes % SIM_ALIGNMENT != 0 {
            return Err(BackendError::new(
                BackendErrorKind::InvalidArgument,
                "alloc_segment",
                format!("size {bytes} is not a positive multiple of {SIM_ALIGNMENT}"),
            ));
        }
        self.faults.check_op(SimOp::AllocSegment, "alloc_segment")?;
        let mut st = self.lock();
        if st.used.checked_add(bytes).is_none_or(|u| u > st.capacity) {
            return Err(Self::oom(&mut st, "alloc_segment", bytes));
        }
        let base = Self::take_va(&mut st, bytes)?;
        st.used += bytes;
        st.regions.insert(
            base,
            Region {
                size: bytes,
                growable: false,
            },
        );
        st.calls.alloc_segment += 1;
        Ok(base)
    }

    fn free_segment(&self, ptr: DevicePtr, bytes: u64) -> Result<(), BackendError> {
        let mut st = self.lock();
        match st.regions.get(&ptr) {
            Some(r) if !r.growable && r.size == bytes => {}
            _ => {
                return Err(BackendError::new(
                    BackendErrorKind::InvalidArgument,
                    "free_segment",
                    format!("no segment of {bytes} bytes at {ptr:#x}"),
                ))
            }
        }
        st.regions.remove(&ptr);
        st.used -= bytes;
        st.calls.free_segment += 1;
        Self::drop_chunks(&mut st, ptr, bytes);
        Ok(())
    }

    fn reserve(&self, bytes: u64) -> Result<DevicePtr, BackendError> {
        if bytes == 0 || bytes % self.granularity() != 0 {
            return Err(BackendError::new(
                BackendErrorKind::InvalidArgument,
                "reserve",
                format!("size {bytes} is not a positive multiple of the granularity"),
            ));
        }
        self.faults.check_op(SimOp::Reserve, "reserve")?;
        let mut st = self.lock();
        let base = Self::take_va(&mut st, bytes)?;
        st.regions.insert(
            base,
            Region {
                size: bytes,
                growable: true,
            },
        );
        st.calls.reserve += 1;
        Ok(base)
    }

    fn release(&self, base: DevicePtr, bytes: u64) -> Result<(), BackendError> {
        let mut st = self.lock();
        let ok = matches!(st.regions.get(&base), Some(r) if r.growable && r.size == bytes);
        let still_mapped = overlaps(&st.mapped, base, base.saturating_add(bytes))
            || overlaps_alias(&st.aliases, base, base.saturating_add(bytes));
        if !ok || still_mapped {
            return Err(BackendError::new(
                BackendErrorKind::InvalidArgument,
                "release",
                format!("no fully unmapped reservation of {bytes} bytes at {base:#x}"),
            ));
        }
        st.regions.remove(&base);
        st.calls.release += 1;
        Ok(())
    }

    fn map(&self, addr: DevicePtr, bytes: u64) -> Result<(), BackendError> {
        self.faults.check_op(SimOp::Map, "map")?;
        let mut st = self.lock();
        let invalid = |m: String| BackendError::new(BackendErrorKind::InvalidArgument, "map", m);
        let g = st.granularity;
        if bytes == 0 || addr % g != 0 || bytes % g != 0 {
            return Err(invalid(format!(
                "{bytes} bytes at {addr:#x} are not whole pages"
            )));
        }
        let Some(end) = addr.checked_add(bytes) else {
            return Err(invalid(format!("{bytes} bytes at {addr:#x} overflow")));
        };
        let inside = st
            .regions
            .range(..=addr)
            .next_back()
            .is_some_and(|(&b, r)| r.growable && end <= b + r.size);
        if !inside {
            return Err(invalid(format!(
                "{bytes} bytes at {addr:#x} are not in a reserved range"
            )));
        }
        if overlaps(&st.mapped, addr, end) || overlaps_alias(&st.aliases, addr, end) {
            return Err(invalid(format!(
                "a page in {addr:#x}+{bytes} is already mapped"
            )));
        }
        // spare pages (kept by unmap_keep) back the range first; only the rest is new memory
        let reused = st.spare.min(bytes);
        let fresh = bytes - reused;
        if st.used.checked_add(fresh).is_none_or(|u| u > st.capacity) {
            return Err(Self::oom(&mut st, "map", fresh));
        }
        st.mapped.insert(addr, end);
        st.spare -= reused;
        st.used += fresh;
        st.calls.map += 1;
        st.calls.pages_reused += reused / g;
        st.calls.pages_created += fresh / g;
        Ok(())
    }

    fn map_handles(&self, addr: DevicePtr, bytes: u64, handle: u64) -> Result<(), BackendError> {
        let g = self.granularity();
        if handle == 0 || handle % g != 0 {
            return Err(BackendError::new(
                BackendErrorKind::InvalidArgument,
                "map",
                format!(
                    "a handle of {handle} bytes is not a positive multiple of the page size {g}"
                ),
            ));
        }
        self.map(addr, bytes)?;
        if handle > g {
            self.lock().handles.insert(addr, bytes, handle);
        }
        Ok(())
    }

    fn unmap(&self, addr: DevicePtr, bytes: u64) -> Result<(), BackendError> {
        self.unmap_pages(addr, bytes, false)
    }

    fn unmap_keep(&self, addr: DevicePtr, bytes: u64) -> Result<(), BackendError> {
        self.unmap_pages(addr, bytes, true)
    }

    fn release_spares(&self) -> Result<u64, BackendError> {
        let mut st = self.lock();
        let n = std::mem::take(&mut st.spare);
        st.used -= n;
        st.calls.pages_released += n / st.granularity;
        Ok(n)
    }

    fn supports_alias(&self) -> bool {
        true
    }

    fn map_alias(&self, addr: DevicePtr, src: DevicePtr, bytes: u64) -> Result<(), BackendError> {
        self.faults.check_op(SimOp::Map, "map_alias")?;
        let mut st = self.lock();
        let invalid =
            |m: String| BackendError::new(BackendErrorKind::InvalidArgument, "map_alias", m);
        let g = st.granularity;
        let (Some(end), Some(src_end)) = (addr.checked_add(bytes), src.checked_add(bytes)) else {
            return Err(invalid(format!("{bytes} bytes overflow")));
        };
        if bytes == 0 || addr % g != 0 || src % g != 0 || bytes % g != 0 {
            return Err(invalid(format!(
                "{bytes} bytes at {addr:#x} (of {src:#x}) are not whole pages"
            )));
        }
        let inside = st
            .regions
            .range(..=addr)
            .next_back()
            .is_some_and(|(&b, r)| r.growable && end <= b + r.size);
        if !inside || overlaps(&st.mapped, addr, end) || overlaps_alias(&st.aliases, addr, end) {
            return Err(invalid(format!(
                "{bytes} bytes at {addr:#x} are not unmapped pages of a reserved range"
            )));
        }
        if !covered(&st.mapped, src, src_end) {
            return Err(invalid(format!(
                "{bytes} bytes at {src:#x} are not mapped pages"
            )));
        }
        // as the driver: a handle is mapped at a second address only whole, from its start
        if st.handles.cuts(src) || st.handles.cuts(src_end) {
            return Err(invalid(format!(
                "{bytes} bytes at {src:#x} are part of a handle larger than a page: an alias maps \
                 whole handles"
            )));
        }
        st.aliases.insert(addr, (end, src));
        st.calls.map += 1;
        Ok(())
    }

    fn unmap_alias(&self, addr: DevicePtr, bytes: u64) -> Result<(), BackendError> {
        let mut st = self.lock();
        let end = addr.saturating_add(bytes);
        let runs: Vec<(u64, u64)> = st
            .aliases
            .range(addr..end)
            .map(|(&a, &(e, _))| (a, e))
            .collect();
        let mut next = addr;
        let whole = runs.iter().all(|&(a, e)| {
            let fits = a == next && e <= end;
            next = e;
            fits
        }) && next == end
            && bytes > 0;
        if !whole {
            return Err(BackendError::new(
                BackendErrorKind::InvalidArgument,
                "unmap_alias",
                format!("{bytes} bytes at {addr:#x} are not whole aliases"),
            ));
        }
        for (a, _) in runs {
            st.aliases.remove(&a);
        }
        st.calls.unmap += 1;
        Ok(())
    }

    fn copy_to_device(&self, dst: DevicePtr, src: &[u8]) -> Result<(), BackendError> {
        self.require_data("copy_to_device")?;
        let mut st = self.lock();
        Self::check_access(&st, "copy_to_device", dst, src.len() as u64)?;
        let mut done = 0usize;
        while done < src.len() {
            let (a, left) = resolve(&st, dst + done as u64);
            let (c, off) = (a / CHUNK, (a % CHUNK) as usize);
            let n = (CHUNK as usize - off).min(src.len() - done).min(left);
            let chunk = st
                .chunks
                .entry(c)
                .or_insert_with(|| vec![0u8; CHUNK as usize].into_boxed_slice());
            chunk[off..off + n].copy_from_slice(&src[done..done + n]);
            done += n;
        }
        Ok(())
    }

    fn copy_to_host(&self, dst: &mut [u8], src: DevicePtr) -> Result<(), BackendError> {
        self.require_data("copy_to_host")?;
        let st = self.lock();
        Self::check_access(&st, "copy_to_host", src, dst.len() as u64)?;
        let mut done = 0usize;
        while done < dst.len() {
            let (a, left) = resolve(&st, src + done as u64);
            let (c, off) = (a / CHUNK, (a % CHUNK) as usize);
            let n = (CHUNK as usize - off).min(dst.len() - done).min(left);
            match st.chunks.get(&c) {
                Some(chunk) => dst[done..done + n].copy_from_slice(&chunk[off..off + n]),
                None => dst[done..done + n].fill(0),
            }
            done += n;
        }
        Ok(())
    }

    fn memset_zero(&self, dst: DevicePtr, bytes: u64) -> Result<(), BackendError> {
        self.require_data("memset_zero")?;
        let mut st = self.lock();
        Self::check_access(&st, "memset_zero", dst, bytes)?;
        let mut at = dst;
        let end = dst + bytes;
        while at < end {
            let (a, left) = resolve(&st, at);
            let (c, off) = (a / CHUNK, a % CHUNK);
            let n = (CHUNK - off).min(end - at).min(left as u64);
            if let Some(chunk) = st.chunks.get_mut(&c) {
                if off == 0 && n == CHUNK {
                    st.chunks.remove(&c);
                } else {
                    chunk[off as usize..(off + n) as usize].fill(0);
                }
            }
            at += n;
        }
        Ok(())
    }

    fn check_request(&self, bytes: u64) -> Result<(), BackendError> {
        self.faults.check(bytes)
    }

    fn record_event(&self, stream: StreamId) -> Result<EventId, BackendError> {
        let mut st = self.lock();
        if !st.pending_events {
            return Ok(0);
        }
        let id = st.next_event;
        st.next_event += 1;
        st.events.insert(id, (stream, false));
        Ok(id)
    }

    fn event_done(&self, event: EventId) -> Result<bool, BackendError> {
        let mut st = self.lock();
        if !st.pending_events {
            return Ok(true);
        }
        match st.events.get(&event) {
            Some(&(_, true)) => {
                st.events.remove(&event);
                Ok(true)
            }
            Some(_) => Ok(false),
            None => Err(BackendError::new(
                BackendErrorKind::InvalidArgument,
                "event_done",
                format!("no event {event}"),
            )),
        }
    }

    fn wait_event(&self, event: EventId) -> Result<(), BackendError> {
        let stream = {
            let st = self.lock();
            if !st.pending_events {
                return Ok(());
            }
            match st.events.get(&event) {
                Some(&(s, _)) => s,
                None => {
                    return Err(BackendError::new(
                        BackendErrorKind::InvalidArgument,
                        "wait_event",
                        format!("no event {event}"),
                    ))
                }
            }
        };
        // waiting lets the stream's queued work finish
        self.synchronize_stream(stream);
        self.lock().events.remove(&event);
        Ok(())
    }

    fn synchronize(&self) -> Result<(), BackendError> {
        for (_, done) in self.lock().events.values_mut() {
            *done = true;
        }
        Ok(())
    }

    fn synchronize_streams(
        &self,
        streams: &[StreamId],
        _calling: StreamId,
    ) -> Result<bool, BackendError> {
        for &s in streams {
            self.synchronize_stream(s);
        }
        self.lock().calls.stream_syncs += 1;
        Ok(false)
    }
}

/// Whether every byte of `[addr, end)` lies in the mapped runs.
fn covered(mapped: &BTreeMap<u64, u64>, addr: u64, end: u64) -> bool {
    let mut pos = addr;
    while pos < end {
        match mapped.range(..=pos).next_back() {
            Some((_, &e)) if e > pos => pos = e,
            _ => return false,
        }
    }
    true
}

/// Whether any mapped run overlaps `[addr, end)` (runs are disjoint and sorted: the last one
/// starting before `end` reaches furthest).
fn overlaps(mapped: &BTreeMap<u64, u64>, addr: u64, end: u64) -> bool {
    mapped
        .range(..end)
        .next_back()
        .is_some_and(|(_, &e)| e > addr)
}

/// Whether any alias overlaps `[addr, end)`.
fn overlaps_alias(aliases: &BTreeMap<u64, (u64, u64)>, addr: u64, end: u64) -> bool {
    aliases
        .range(..end)
        .next_back()
        .is_some_and(|(_, &(e, _))| e > addr)
}

/// Whether every byte of `[addr, end)` lies in mapped pages or aliases of them.
fn covered_or_aliased(st: &SimState, addr: u64, end: u64) -> bool {
    let mut pos = addr;
    while pos < end {
        let mapped = st.mapped.range(..=pos).next_back().map(|(_, &e)| e);
        let alias = st.aliases.range(..=pos).next_back().map(|(_, &(e, _))| e);
        match mapped.into_iter().chain(alias).filter(|&e| e > pos).max() {
            Some(e) => pos = e,
            None => return false,
        }
    }
    true
}

/// The address whose bytes `addr` reads and writes (its alias's source, or itself), and the
/// bytes up to the end of that alias (`usize::MAX` outside one).
fn resolve(st: &SimState, addr: u64) -> (u64, usize) {
    match st.aliases.range(..=addr).next_back() {
        Some((&a, &(e, src))) if e > addr => (src + (addr - a), (e - addr) as usize),
        _ => (addr, usize::MAX),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_alias_reads_and_writes_the_pages_it_aliases_and_holds_no_memory() {
        let g = 2u64 << 20;
        let sim = SimDevice::new(ByteSize::mib(64));
        let home = sim.reserve(4 * g).unwrap();
        sim.map(home, 4 * g).unwrap();
        let used = sim.used();
        let other = sim.reserve(2 * g).unwrap();
        // the home's pages 2 and 3 at `other`
        sim.map_alias(other, home + 2 * g, 2 * g).unwrap();
        assert_eq!(sim.used(), used, "an alias holds no memory of its own");
        sim.copy_to_device(other + g + 5, &[7, 8, 9]).unwrap();
        let mut out = [0u8; 3];
        sim.copy_to_host(&mut out, home + 3 * g + 5).unwrap();
        assert_eq!(out, [7, 8, 9]);
        // a write across the alias's end is refused (past it nothing is mapped)
        assert!(sim.copy_to_device(other + 2 * g - 1, &[1, 2]).is_err());
        // the aliased pages stay while the alias does; the range is not released under it
        assert!(sim.unmap(home + 2 * g, g).is_err());
        assert!(sim.release(other, 2 * g).is_err());
        assert!(sim.map_alias(other, home, g).is_err(), "mapped already");
        assert!(sim.unmap_alias(other, g).is_err(), "not a whole alias");
        sim.unmap_alias(other, 2 * g).unwrap();
        sim.release(other, 2 * g).unwrap();
        sim.unmap(home, 4 * g).unwrap();
        sim.release(home, 4 * g).unwrap();
        assert_eq!(sim.used(), 0);
        // a handle of two pages is aliased whole or not at all, as the driver maps it
        let home = sim.reserve(4 * g).unwrap();
        sim.map_handles(home, 4 * g, 2 * g).unwrap();
        let other = sim.reserve(2 * g).unwrap();
        assert!(sim.map_alias(other, home + g, g).is_err(), "half a handle");
        assert!(
            sim.map_alias(other, home + g, 2 * g).is_err(),
            "parts of two"
        );
        sim.map_alias(other, home + 2 * g, 2 * g).unwrap();
        sim.unmap_alias(other, 2 * g).unwrap();
    }

    #[test]
    fn an_unmap_that_cuts_a_handle_is_refused_and_whole_ones_go() {
        let m = 1u64 << 20;
        let sim = SimDevice::address_only(ByteSize::gib(1));
        let base = sim.reserve(64 * m).unwrap();
        // two 20 MiB handles, then 6 MiB of pages
        sim.map_handles(base, 46 * m, 20 * m).unwrap();
        assert_eq!(sim.handle_runs(), vec![(base, base + 40 * m, 20 * m)]);
        let e = sim.unmap(base + 10 * m, 10 * m).unwrap_err();
        assert_eq!(e.kind, BackendErrorKind::InvalidArgument);
        assert!(e.to_string().contains("cut a physical handle"), "{e}");
        assert_eq!(sim.used(), 46 * m, "nothing unmapped");
        let e = sim.map_handles(base + 46 * m, 4 * m, 3 * m).unwrap_err();
        assert_eq!(e.kind, BackendErrorKind::InvalidArgument, "{e}");
        sim.unmap(base + 20 * m, 26 * m).unwrap();
        assert_eq!(sim.handle_runs(), vec![(base, base + 20 * m, 20 * m)]);
        sim.unmap(base, 20 * m).unwrap();
        assert!(sim.handle_runs().is_empty());
        assert_eq!(sim.used(), 0);
        sim.release(base, 64 * m).unwrap();
    }

    #[test]
    fn segments_account_capacity() {
        let sim = SimDevice::new(ByteSize::mib(4));
        let a = sim.alloc_segment(2 << 20, 0).unwrap();
        let b = sim.alloc_segment(2 << 20, 0).unwrap();
        let e = sim.alloc_segment(512, 0).unwrap_err();
        assert!(e.is_oom());
        assert_eq!(sim.mem_info().unwrap().free, 0);
        sim.free_segment(a, 2 << 20).unwrap();
        assert_eq!(sim.mem_info().unwrap().free, 2 << 20);
        assert!(
            sim.free_segment(a, 2 << 20).is_err(),
            "double free is rejected"
        );
        sim.free_segment(b, 2 << 20).unwrap();
        assert_eq!(sim.used(), 0);
    }

    #[test]
    fn data_round_trips_lazily() {
        let sim = SimDevice::new(ByteSize::gib(64));
        let p = sim.alloc_segment(1 << 30, 0).unwrap();
        let data: Vec<u8> = (0..200_000u32).map(|i| i as u8).collect();
        sim.copy_to_device(p + 12345, &data).unwrap();
        let mut out = vec![0u8; data.len()];
        sim.copy_to_host(&mut out, p + 12345).unwrap();
        assert_eq!(out, data);
        // only the touched chunks are backed
        assert!(sim.lock().chunks.len() <= 5);
        sim.memset_zero(p, 1 << 30).unwrap();
        sim.copy_to_host(&mut out, p + 12345).unwrap();
        assert!(out.iter().all(|&b| b == 0));
        assert!(
            sim.copy_to_host(&mut out, p + (1 << 30) - 10).is_err(),
            "out of bounds"
        );
    }

    #[test]
    fn growable_ranges_map_pages() {
        let sim = SimDevice::new(ByteSize::mib(6));
        let base = sim.reserve(64 << 20).unwrap();
        sim.map(base, 4 << 20).unwrap();
        assert!(
            sim.map(base + (2 << 20), 2 << 20).is_err(),
            "already mapped"
        );
        assert!(sim.map(base + (4 << 20), 4 << 20).unwrap_err().is_oom());
        sim.copy_to_device(base + (4 << 20) - 2, &[1, 2]).unwrap();
        assert!(
            sim.copy_to_device(base + (4 << 20), &[1]).is_err(),
            "unmapped page"
        );
        assert!(sim.release(base, 64 << 20).is_err(), "still mapped");
        sim.unmap(base, 4 << 20).unwrap();
        sim.release(base, 64 << 20).unwrap();
        assert_eq!(sim.used(), 0);
        assert_eq!(sim.calls().map, 1);
    }

    #[test]
    fn page_size_is_checked_and_used() {
        let sim = SimDevice::address_only(ByteSize::gib(1));
        for bad in [0, 3 << 20, 1 << 10, 2 << 30, (64 << 10) + 1] {
            let e = sim.clone().with_page_size(bad).unwrap_err();
            assert_eq!(e.kind, BackendErrorKind::InvalidArgument, "{bad}: {e}");
            assert!(e.to_string().contains("power of two"), "{bad}: {e}");
        }
        let sim = sim.with_page_size(64 << 10).unwrap();
        assert_eq!(sim.granularity(), 64 << 10);
        assert!(sim.name().contains("pages of 64.00 KiB"), "{}", sim.name());
        let base = sim.reserve(256 << 10).unwrap();
        sim.map(base, 64 << 10).unwrap();
        assert!(sim.map(base + (64 << 10), 32 << 10).is_err(), "half a page");
        let e = sim.clone().with_page_size(2 << 20).unwrap_err();
        assert!(e.to_string().contains("already has segments"), "{e}");
    }

    #[test]
    fn mapped_runs_split_and_join() {
        let g = SIM_GRANULARITY;
        let sim = SimDevice::new(ByteSize::gib(1));
        let base = sim.reserve(16 * g).unwrap();
        sim.map(base, 8 * g).unwrap();
        sim.unmap(base + 2 * g, 2 * g).unwrap(); // [0,2) and [4,8) stay
        assert!(sim.copy_to_device(base + g, &[1; 16]).is_ok());
        assert!(
            sim.copy_to_device(base + 2 * g, &[1]).is_err(),
            "unmapped hole"
        );
        assert!(
            sim.copy_to_device(base + 2 * g - 1, &[1, 2]).is_err(),
            "spans the hole"
        );
        assert!(sim.unmap(base + g, 4 * g).is_err(), "not all mapped");
        assert!(sim.map(base + g, 2 * g).is_err(), "overlaps a mapped page");
        sim.map(base + 2 * g, 2 * g).unwrap(); // fill the hole: [0,2) [2,4) [4,8)
        let mut out = [0u8; 4];
        sim.copy_to_device(base + 2 * g - 2, &[1, 2, 3, 4]).unwrap();
        sim.copy_to_host(&mut out, base + 2 * g - 2).unwrap();
        assert_eq!(out, [1, 2, 3, 4], "across adjacent runs");
        sim.unmap(base + g, 6 * g).unwrap(); // across three runs
        assert_eq!(sim.used(), 2 * g);
        assert!(sim.release(base, 16 * g).is_err(), "still mapped");
        sim.unmap(base, g).unwrap();
        sim.unmap(base + 7 * g, g).unwrap();
        sim.release(base, 16 * g).unwrap();
        assert_eq!(sim.used(), 0);
        // a huge mapping is one run, not one entry per page
        let sim = SimDevice::address_only(ByteSize(u64::MAX));
        let big = sim.reserve(1 << 62).unwrap();
        sim.map(big, 1 << 62).unwrap();
        sim.unmap(big, 1 << 62).unwrap();
    }

    #[test]
    fn faults_and_shrinking() {
        let sim = SimDevice::new(ByteSize::gib(1));
        let f = sim.faults();
        f.fail_nth_request(2);
        assert!(sim.check_request(1).is_ok());
        assert!(sim.check_request(1).is_ok());
        assert!(sim.check_request(1).unwrap_err().is_oom());
        assert!(sim.check_request(1).is_ok(), "fails once");
        f.fail_requests_above(1000);
        assert!(sim.check_request(1001).is_err());
        assert!(sim.check_request(1000).is_ok());
        f.clear();
        sim.set_capacity(ByteSize::mib(1));
        assert!(sim.alloc_segment(2 << 20, 0).unwrap_err().is_oom());
    }

    #[test]
    fn address_only_rejects_data() {
        let sim = SimDevice::address_only(ByteSize::gib(80));
        let p = sim.alloc_segment(70 << 30, 0).unwrap();
        assert!(sim.copy_to_device(p, &[1]).is_err());
        assert_eq!(sim.mode(), SimMode::AddressOnly);
    }
}
