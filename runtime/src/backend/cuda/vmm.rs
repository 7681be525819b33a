//! Growable segments on the CUDA virtual memory management API: reserved address ranges, and
//! physical allocation handles keyed by their address: one per page, or larger ones where the
//! allocator asks for them (`map_handles`). Any run of whole handles can be unmapped regardless
//! of how it was mapped.

use std::collections::BTreeMap;
use std::sync::Mutex;

use cudarc::driver::sys;

use super::{driver_error, invalid, lock};
use crate::backend::{BackendError, DevicePtr};

fn check(op: &'static str, r: sys::CUresult) -> Result<(), BackendError> {
    r.result().map_err(|e| driver_error(op, e))
}

/// Whether `runs` (address, bytes), in address order, tile `[addr, end)` exactly: each starts
/// where the one before ended, the first at `addr`, the last ending at `end`.
fn tiles(runs: impl Iterator<Item = (DevicePtr, u64)>, addr: DevicePtr, end: DevicePtr) -> bool {
    let mut next = addr;
    for (a, n) in runs {
        if a != next || a + n > end {
            return false;
        }
        next = a + n;
    }
    next == end
}

/// Properties of a page: pinned device memory on `device`, no exportable handle. Built from
/// zero and by field, so that it compiles against every CUDA version's bindings (the struct
/// gained fields and a union across 12.x and 13.x).
fn alloc_prop(device: sys::CUdevice) -> sys::CUmemAllocationProp {
    // SAFETY: every field of CUmemAllocationProp (all CUDA versions) is an integer, a pointer or
    // an enum with a 0 variant (INVALID / NONE), so all-zero is a valid value, and the driver
    // documents zeroed flags as the defaults.
    let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    p.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
    p.location = device_location(device);
    p
}

/// The location "device `device`", for every CUDA version's bindings: the C struct is
/// `{ CUmemLocationType type; int id; }`, where 13.2+ puts `id` first in a union at the same
/// offset, so the id is written at byte offset 4.
pub(crate) fn device_location(device: sys::CUdevice) -> sys::CUmemLocation {
    const _: () = assert!(std::mem::size_of::<sys::CUmemLocation>() == 8);
    // SAFETY: all-zero is a valid CUmemLocation (type INVALID = 0, id 0) in every binding.
    let mut loc: sys::CUmemLocation = unsafe { std::mem::zeroed() };
    loc.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    // SAFETY: the struct is 8 bytes (checked above) with the 4-byte enum at offset 0, so the
    // `int id` (or the union starting with it) is the aligned i32 at offset 4, inside `loc`.
    unsafe {
        (&mut loc as *mut sys::CUmemLocation)
            .cast::<u8>()
            .add(4)
            .cast::<i32>()
            .write(device)
    };
    loc
}

/// The minimum page size of physical allocations on `device` (`cuMemGetAllocationGranularity`).
pub(super) fn granularity(device: sys::CUdevice) -> Result<u64, BackendError> {
    let prop = alloc_prop(device);
    let mut g: usize = 0;
    // SAFETY: both pointers are valid for the call; `prop` is fully initialised.
    let r = unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut g,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    };
    check("cuMemGetAllocationGranularity", r)?;
    if g == 0 {
        return Err(invalid(
            "cuMemGetAllocationGranularity",
            "the driver reported a granularity of 0",
        ));
    }
    Ok(g as u64)
}

#[derive(Debug, Default)]
struct Tables {
    /// Reserved address ranges: base -> size.
    ranges: BTreeMap<DevicePtr, u64>,
    /// Mapped handles: address -> (the allocation handle, its bytes).
    pages: BTreeMap<DevicePtr, (sys::CUmemGenericAllocationHandle, u64)>,
    /// Handles unmapped by `unmap_keep`, mapped nowhere, with their bytes: the next `map` uses
    /// those of the size it needs before it creates new ones.
    spare: Vec<(sys::CUmemGenericAllocationHandle, u64)>,
    /// Aliases (`map_alias`): address -> bytes, each one `cuMemMap` of part of a handle mapped
    /// in `pages`. They own nothing: unmapped with `cuMemUnmap` alone.
    aliases: BTreeMap<DevicePtr, (u64, sys::CUmemGenericAllocationHandle)>,
    /// Handles with aliases, and how many.
    aliased: std::collections::HashMap<sys::CUmemGenericAllocationHandle, u32>,
    /// Pages created (`cuMemCreate`) and pages mapped from spares, over the table's life (a
    /// handle counts its pages).
    created: u64,
    reused: u64,
}

/// Reserved ranges and mapped pages of one device.
#[derive(Debug)]
pub(super) struct PageTable {
    device: sys::CUdevice,
    page: u64,
    tables: Mutex<Tables>,
}

impl PageTable {
    pub(super) fn new(device: sys::CUdevice, page: u64) -> Self {
        Self {
            device,
            page,
            tables: Mutex::new(Tables::default()),
        }
    }

    /// Pages (of the granularity) now mapped, whatever the handles' sizes.
    pub(super) fn mapped_pages(&self) -> usize {
        let bytes: u64 = lock(&self.tables).pages.values().map(|&(_, n)| n).sum();
        (bytes / self.page) as usize
    }

    fn whole_pages(&self, op: &'static str, addr: u64, bytes: u64) -> Result<(), BackendError> {
        let g = self.page;
        if bytes == 0 || addr % g != 0 || bytes % g != 0 || addr.checked_add(bytes).is_none() {
            return Err(invalid(
                op,
                format!("{bytes} bytes at {addr:#x} are not whole pages of {g} bytes"),
            ));
        }
        Ok(())
    }

    /// `cuMemAddressReserve` of `bytes` (a multiple of the page size).
    pub(super) fn reserve(&self, bytes: u64) -> Result<DevicePtr, BackendError> {
        if bytes == 0 || bytes % self.page != 0 {
            return Err(invalid(
                "cuMemAddressReserve",
                format!("size {bytes} is not a positive multiple of the page size"),
            ));
        }
        let size =
            usize::try_from(bytes).map_err(|_| invalid("cuMemAddressReserve", "too large"))?;
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: `base` is valid for the write; alignment 0 and address hint 0 let the driver
        // choose (aligned to the granularity).
        let r = unsafe { sys::cuMemAddressReserve(&mut base, size, 0, 0, 0) };
        check("cuMemAddressReserve", r)?;
        lock(&self.tables).ranges.insert(base, bytes);
        Ok(base)
    }

    /// `cuMemAddressFree` of a whole reserved range with no page mapped in it.
    pub(super) fn release(&self, base: DevicePtr, bytes: u64) -> Result<(), BackendError> {
        let mut t = lock(&self.tables);
        let end = base.saturating_add(bytes);
        let still_mapped = t.pages.range(base..end).next().is_some()
            || t.aliases.range(base..end).next().is_some();
        if t.ranges.get(&base) != Some(&bytes) || still_mapped {
            return Err(invalid(
                "cuMemAddressFree",
                format!("no fully unmapped reservation of {bytes} bytes at {base:#x}"),
            ));
        }
        // SAFETY: the range was reserved by `reserve` with exactly this size and has no mapping.
        let r = unsafe { sys::cuMemAddressFree(base, bytes as usize) };
        check("cuMemAddressFree", r)?;
        t.ranges.remove(&base);
        Ok(())
    }

    /// Maps fresh pages over `[addr, addr + bytes)`: a `cuMemCreate` + `cuMemMap` per page, then
    /// one `cuMemSetAccess` over the range. On any failure, undoes what it did and returns the
    /// error (out-of-memory from `cuMemCreate` included).
    pub(super) fn map(&self, addr: DevicePtr, bytes: u64) -> Result<(), BackendError> {
        self.map_handles(addr, bytes, self.page)
    }

    /// [`PageTable::map`] with the first `bytes / handle * handle` bytes in handles of `handle`
    /// bytes (a multiple of the page size), the rest in pages.
    pub(super) fn map_handles(
        &self,
        addr: DevicePtr,
        bytes: u64,
        handle: u64,
    ) -> Result<(), BackendError> {
        self.whole_pages("cuMemMap", addr, bytes)?;
        let g = self.page;
        if handle == 0 || handle % g != 0 {
            return Err(invalid(
                "cuMemMap",
                format!(
                    "a handle of {handle} bytes is not a positive multiple of the page size {g}"
                ),
            ));
        }
        let mut t = lock(&self.tables);
        let inside = t
            .ranges
            .range(..=addr)
            .next_back()
            .is_some_and(|(&b, &s)| addr + bytes <= b + s);
        if !inside {
            return Err(invalid(
                "cuMemMap",
                format!("{addr:#x}+{bytes} is not in a reserved range"),
            ));
        }
        let reaching_in = t
            .pages
            .range(..addr)
            .next_back()
            .is_some_and(|(&a, &(_, n))| a + n > addr);
        if reaching_in || t.pages.range(addr..addr + bytes).next().is_some() {
            return Err(invalid(
                "cuMemMap",
                format!("a page in {addr:#x}+{bytes} is already mapped"),
            ));
        }
        let prop = alloc_prop(self.device);
        let large_end = addr + bytes / handle * handle;
        let mut done: Vec<(DevicePtr, (sys::CUmemGenericAllocationHandle, u64))> = Vec::new();
        let mut at = addr;
        while at < addr + bytes {
            let size = if at < large_end { handle } else { g };
            let spare = t
                .spare
                .iter()
                .rposition(|&(_, n)| n == size)
                .map(|i| t.spare.swap_remove(i).0);
            let mut r = self.map_handle(&prop, at, size, spare);
            if r.as_ref().is_err_and(BackendError::is_oom) && !t.spare.is_empty() {
                // The spares are of the other size and hold the memory this handle needs: a
                // move of 2 MiB pages to where 20 MiB handles go (or back) frees them first.
                let others = std::mem::take(&mut t.spare);
                self.release_handles(others);
                r = self.map_handle(&prop, at, size, None);
            }
            match r {
                Ok(h) => {
                    done.push((at, (h, size)));
                    let pages = size / g;
                    if spare.is_some() {
                        t.reused += pages;
                    } else {
                        t.created += pages;
                    }
                }
                Err(e) => {
                    // the spare (if any) was released by map_handle; the handles mapped so far
                    // go back as spares, so a failed move loses none
                    self.undo(&done, &mut t.spare);
                    return Err(e);
                }
            }
            at += size;
        }
        if let Err(e) = self.set_access(addr, bytes) {
            self.undo(&done, &mut t.spare);
            return Err(e);
        }
        t.pages.extend(done);
        Ok(())
    }

    /// Makes `[addr, addr + bytes)`, every byte of it mapped, readable and writable from this
    /// device (`cuMemSetAccess`).
    fn set_access(&self, addr: DevicePtr, bytes: u64) -> Result<(), BackendError> {
        let access = sys::CUmemAccessDesc {
            location: device_location(self.device),
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the caller mapped the whole range under the table's lock, which it still
        // holds; `access` is one valid descriptor.
        let r = unsafe { sys::cuMemSetAccess(addr, bytes as usize, &access, 1) };
        check("cuMemSetAccess", r)
    }

    /// Maps one handle of `size` bytes at `at`: the `spare` handle (of that size) when given,
    /// else a new one.
    fn map_handle(
        &self,
        prop: &sys::CUmemAllocationProp,
        at: DevicePtr,
        size: u64,
        spare: Option<sys::CUmemGenericAllocationHandle>,
    ) -> Result<sys::CUmemGenericAllocationHandle, BackendError> {
        let n = size as usize;
        let h = match spare {
            Some(h) => h,
            None => {
                let mut h: sys::CUmemGenericAllocationHandle = 0;
                // SAFETY: `h` is valid for the write; `prop` is fully initialised; the size is
                // a multiple of the granularity.
                check("cuMemCreate", unsafe {
                    sys::cuMemCreate(&mut h, n, prop, 0)
                })?;
                h
            }
        };
        // SAFETY: `[at, at + size)` lies in a reserved range and nothing is mapped there
        // (checked by the caller under the lock); `h` is a handle of exactly `size` bytes (new,
        // or a spare of this table's kept with its size) mapped nowhere.
        if let Err(e) = check("cuMemMap", unsafe { sys::cuMemMap(at, n, 0, h, 0) }) {
            // SAFETY: `h` is mapped nowhere and owned here (a spare was taken off the list).
            let _ = unsafe { sys::cuMemRelease(h) };
            return Err(e);
        }
        Ok(h)
    }

    /// Unmaps handles mapped during a failed `map`, keeping them as spares; errors are only
    /// logged.
    fn undo(
        &self,
        done: &[(DevicePtr, (sys::CUmemGenericAllocationHandle, u64))],
        spare: &mut Vec<(sys::CUmemGenericAllocationHandle, u64)>,
    ) {
        for &(at, (h, n)) in done {
            match self.unmap_only(at, n) {
                Ok(()) => spare.push((h, n)),
                Err(e) => tracing::warn!(error = %e, at, "undoing a partial map failed"),
            }
        }
    }

    /// Unmaps the one handle of `n` bytes at `at`, leaving it alive.
    fn unmap_only(&self, at: DevicePtr, n: u64) -> Result<(), BackendError> {
        // SAFETY: `at` is mapped with exactly one handle of `n` bytes (by `map_handle`); the
        // caller guarantees that no work uses it any more (the allocator waits for the streams
        // that used it before unmapping; a failed `map` undoes pages nothing has used yet).
        check("cuMemUnmap", unsafe { sys::cuMemUnmap(at, n as usize) })
    }

    fn unmap_handle(
        &self,
        at: DevicePtr,
        (h, n): (sys::CUmemGenericAllocationHandle, u64),
    ) -> Result<(), BackendError> {
        self.unmap_only(at, n)?;
        // SAFETY: `h` is no longer mapped; releasing it frees the physical memory.
        check("cuMemRelease", unsafe { sys::cuMemRelease(h) })
    }

    /// Releases spare handles (`cuMemRelease`); returns the bytes freed. Errors are logged.
    fn release_handles(&self, spare: Vec<(sys::CUmemGenericAllocationHandle, u64)>) -> u64 {
        let mut freed = 0;
        for (h, n) in spare {
            // SAFETY: a spare handle is mapped nowhere and owned by this table alone.
            match check("cuMemRelease", unsafe { sys::cuMemRelease(h) }) {
                Ok(()) => freed += n,
                Err(e) => tracing::warn!(error = %e, "releasing a spare page failed"),
            }
        }
        freed
    }

    /// Unmaps every handle of `[addr, addr + bytes)`; the range must be whole mapped handles.
    /// `keep`: the handles become spares for the next `map`; otherwise they are released (the
    /// memory freed).
    pub(super) fn unmap(
        &self,
        addr: DevicePtr,
        bytes: u64,
        keep: bool,
    ) -> Result<(), BackendError> {
        self.whole_pages("cuMemUnmap", addr, bytes)?;
        let end = addr + bytes;
        let mut t = lock(&self.tables);
        let handles: Vec<(DevicePtr, (sys::CUmemGenericAllocationHandle, u64))> =
            t.pages.range(addr..end).map(|(&a, &h)| (a, h)).collect();
        // a handle another address aliases stays until that alias is unmapped (as a spare it
        // could be mapped for another block while the alias still reads it)
        if handles.iter().any(|(_, (h, _))| t.aliased.contains_key(h)) {
            return Err(invalid(
                "cuMemUnmap",
                format!("{bytes} bytes at {addr:#x} are aliased elsewhere (map_alias)"),
            ));
        }
        if !tiles(handles.iter().map(|&(a, (_, n))| (a, n)), addr, end) {
            return Err(invalid(
                "cuMemUnmap",
                format!("{bytes} bytes at {addr:#x} are not whole mapped handles"),
            ));
        }
        let mut first_err = None;
        for (at, h) in handles {
            let r = if keep {
                self.unmap_only(at, h.1).map(|()| t.spare.push(h))
            } else {
                self.unmap_handle(at, h)
            };
            match r {
                Ok(()) => {
                    t.pages.remove(&at);
                }
                Err(e) => {
                    tracing::warn!(error = %e, at, "unmapping a handle failed");
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Times mapping `bytes` of new memory in handles of `handle` bytes (a multiple of the
    /// page size) into an address range of its own, then unmapping it: `(map, unmap)` wall
    /// times, each ending with a context synchronisation. Touches nothing of the page table.
    pub(super) fn time_handles(
        &self,
        bytes: u64,
        handle: u64,
    ) -> Result<(std::time::Duration, std::time::Duration), BackendError> {
        if handle == 0 || handle % self.page != 0 || bytes == 0 || bytes % handle != 0 {
            return Err(invalid(
                "measure_map_cost",
                format!(
                    "{bytes} bytes in handles of {handle}: both must be positive multiples of the page size ({}), bytes of the handle",
                    self.page
                ),
            ));
        }
        let size = usize::try_from(bytes).map_err(|_| invalid("measure_map_cost", "too large"))?;
        let h = handle as usize;
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: `base` is valid for the write; the driver chooses the address.
        check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut base, size, 0, 0, 0)
        })?;
        let prop = alloc_prop(self.device);
        let access = sys::CUmemAccessDesc {
            location: device_location(self.device),
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        let mut handles = Vec::with_capacity(size / h);
        let t0 = std::time::Instant::now();
        let mut result = Ok(());
        for i in 0..size / h {
            let mut handle: sys::CUmemGenericAllocationHandle = 0;
            // SAFETY: `handle` is valid for the write; `prop` is fully initialised.
            result = check("cuMemCreate", unsafe {
                sys::cuMemCreate(&mut handle, h, &prop, 0)
            });
            if result.is_err() {
                break;
            }
            // SAFETY: the target lies inside the range reserved above and is not mapped.
            result = check("cuMemMap", unsafe {
                sys::cuMemMap(base + (i * h) as u64, h, 0, handle, 0)
            });
            handles.push(handle);
            if result.is_err() {
                break;
            }
        }
        if result.is_ok() {
            // SAFETY: the whole range is mapped; `access` is one valid descriptor.
            result = check("cuMemSetAccess", unsafe {
                sys::cuMemSetAccess(base, size, &access, 1)
            });
        }
        // SAFETY: plain context synchronisation.
        let _ = unsafe { sys::cuCtxSynchronize() };
        let map = t0.elapsed();
        let t1 = std::time::Instant::now();
        for (i, &handle) in handles.iter().enumerate() {
            // SAFETY: each handle was mapped at its slot above (a failed map is unmapped in
            // vain, which the driver refuses without effect); nothing uses the memory.
            unsafe {
                let _ = sys::cuMemUnmap(base + (i * h) as u64, h);
                let _ = sys::cuMemRelease(handle);
            }
        }
        // SAFETY: plain context synchronisation.
        let _ = unsafe { sys::cuCtxSynchronize() };
        let unmap = t1.elapsed();
        // SAFETY: the range was reserved above and nothing is mapped in it any more.
        let _ = unsafe { sys::cuMemAddressFree(base, size) };
        result.map(|()| (map, unmap))
    }

    /// Releases every spare handle (`cuMemRelease`); returns the bytes freed.
    pub(super) fn release_spares(&self) -> u64 {
        let spare = std::mem::take(&mut lock(&self.tables).spare);
        self.release_handles(spare)
    }

    /// Pages created and pages mapped from spares so far (a handle counts its pages).
    pub(super) fn page_counts(&self) -> (u64, u64) {
        let t = lock(&self.tables);
        (t.created, t.reused)
    }

    /// Maps `[addr, addr + bytes)` to the handles mapped at `[src, src + bytes)`: one
    /// `cuMemMap` per handle (part) it reaches, at that part's offset in the handle, then one
    /// `cuMemSetAccess`. On failure, undoes what it mapped.
    pub(super) fn map_alias(
        &self,
        addr: DevicePtr,
        src: DevicePtr,
        bytes: u64,
    ) -> Result<(), BackendError> {
        self.whole_pages("cuMemMap", addr, bytes)?;
        self.whole_pages("cuMemMap", src, bytes)?;
        let mut t = lock(&self.tables);
        let end = addr + bytes;
        let inside = t
            .ranges
            .range(..=addr)
            .next_back()
            .is_some_and(|(&b, &s)| end <= b + s);
        let alias_taken = t
            .aliases
            .range(..end)
            .next_back()
            .is_some_and(|(&a, &(n, _))| a + n > addr);
        let page_taken = t
            .pages
            .range(..end)
            .next_back()
            .is_some_and(|(&a, &(_, n))| a + n > addr);
        if !inside || page_taken || alias_taken {
            return Err(invalid(
                "cuMemMap",
                format!("{bytes} bytes at {addr:#x} are not unmapped pages of a reserved range"),
            ));
        }
        let mut done: Vec<(DevicePtr, (u64, sys::CUmemGenericAllocationHandle))> = Vec::new();
        let mut at = 0u64;
        while at < bytes {
            let from = src + at;
            let Some((&base, &(h, n))) = t.pages.range(..=from).next_back() else {
                self.undo_aliases(&done);
                return Err(invalid("cuMemMap", format!("{from:#x} is not mapped")));
            };
            if base + n <= from {
                self.undo_aliases(&done);
                return Err(invalid("cuMemMap", format!("{from:#x} is not mapped")));
            }
            let offset = from - base;
            let len = (base + n - from).min(bytes - at);
            if offset != 0 || len != n {
                // cuMemMap maps a handle from offset 0 only ("currently must be zero")
                self.undo_aliases(&done);
                return Err(invalid(
                    "cuMemMap",
                    format!(
                        "{from:#x} is inside a handle of {n} bytes: an alias maps whole handles"
                    ),
                ));
            }
            // SAFETY: `[addr + at, + len)` lies in a reserved range with nothing mapped there
            // (checked above under the lock); `h` is a live handle of `n` bytes mapped at
            // `base` (the table holds it), and `offset + len <= n`. Mapping a handle at a
            // second address is what cuMemMap allows; the alias is unmapped before the handle's
            // own mapping (the allocator's order, and `release_all`'s).
            let r = unsafe { sys::cuMemMap(addr + at, len as usize, offset as usize, h, 0) };
            if let Err(e) = check("cuMemMap", r) {
                self.undo_aliases(&done);
                return Err(e);
            }
            done.push((addr + at, (len, h)));
            at += len;
        }
        if let Err(e) = self.set_access(addr, bytes) {
            self.undo_aliases(&done);
            return Err(e);
        }
        for &(_, (_, h)) in &done {
            *t.aliased.entry(h).or_default() += 1;
        }
        t.aliases.extend(done);
        Ok(())
    }

    fn undo_aliases(&self, done: &[(DevicePtr, (u64, sys::CUmemGenericAllocationHandle))]) {
        for &(at, (n, _)) in done {
            if let Err(e) = self.unmap_only(at, n) {
                tracing::warn!(error = %e, at, "undoing a partial alias failed");
            }
        }
    }

    /// Unmaps the aliases covering exactly `[addr, addr + bytes)`.
    pub(super) fn unmap_alias(&self, addr: DevicePtr, bytes: u64) -> Result<(), BackendError> {
        self.whole_pages("cuMemUnmap", addr, bytes)?;
        let end = addr + bytes;
        let mut t = lock(&self.tables);
        let runs: Vec<(DevicePtr, u64)> = t
            .aliases
            .range(addr..end)
            .map(|(&a, &(n, _))| (a, n))
            .collect();
        if !tiles(runs.iter().copied(), addr, end) {
            return Err(invalid(
                "cuMemUnmap",
                format!("{bytes} bytes at {addr:#x} are not whole aliases"),
            ));
        }
        for (at, n) in runs {
            self.unmap_only(at, n)?;
            if let Some((_, h)) = t.aliases.remove(&at) {
                if let Some(c) = t.aliased.get_mut(&h) {
                    *c -= 1;
                    if *c == 0 {
                        t.aliased.remove(&h);
                    }
                }
            }
        }
        Ok(())
    }

    /// Runs `f` when every page of `[addr, end)` is mapped (`None` otherwise), holding the page
    /// table's lock so that none is unmapped until `f` returns.
    pub(super) fn while_mapped<R>(&self, addr: u64, end: u64, f: impl FnOnce() -> R) -> Option<R> {
        let t = lock(&self.tables);
        // walk the handles (or aliases) from the one holding `addr`: mapped when they cover up
        // to `end`
        let holding = |at: u64| {
            let page = t.pages.range(..=at).next_back().map(|(&a, &(_, n))| (a, n));
            let alias = t
                .aliases
                .range(..=at)
                .next_back()
                .map(|(&a, &(n, _))| (a, n));
            page.into_iter()
                .chain(alias)
                .map(|(a, n)| a + n)
                .filter(|&e| e > at)
                .max()
        };
        let mut covered = addr;
        while covered < end {
            match holding(covered) {
                Some(e) => covered = e,
                None => break,
            }
        }
        (end > addr && covered >= end).then(f)
    }

    /// Unmaps every page and frees every range (on drop); errors are only logged.
    pub(super) fn release_all(&self) {
        let mut t = lock(&self.tables);
        t.aliased.clear();
        for (at, (n, _)) in std::mem::take(&mut t.aliases) {
            if let Err(e) = self.unmap_only(at, n) {
                tracing::warn!(error = %e, at, "unmapping an alias on drop failed");
            }
        }
        for (page, h) in std::mem::take(&mut t.pages) {
            if let Err(e) = self.unmap_handle(page, h) {
                tracing::warn!(error = %e, page, "unmapping a page on drop failed");
            }
        }
        self.release_handles(std::mem::take(&mut t.spare));
        for (base, size) in std::mem::take(&mut t.ranges) {
            // SAFETY: the range was reserved with this size; its pages were just unmapped.
            let r = unsafe { sys::cuMemAddressFree(base, size as usize) };
            if let Err(e) = check("cuMemAddressFree", r) {
                tracing::warn!(error = %e, base, "freeing an address range on drop failed");
            }
        }
    }
}
