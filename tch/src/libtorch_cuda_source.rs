//! libtorch's CUDA caching allocator of one device as an oomguard [`MemorySource`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use oomguard::source::{MemorySource, MemoryUsage, SourceBudget, SourceInfo};
use oomguard::ByteSize;

use crate::cuda_allocator::{self, CudaDeviceInfo};
use crate::device_stats::DeviceStats;
use crate::memory_summary::format_memory_summary;

/// The memory of every tch tensor on one CUDA device: libtorch's own caching allocator
/// (`c10::cuda::CUDACachingAllocator`), read and steered through the crate's C++ shim. Cheap to
/// clone; all handles of a device are one source.
///
/// - usage: libtorch's `allocated_bytes` (used) and `reserved_bytes` (used plus cached), with
///   their peaks, exactly as `torch.cuda.memory_allocated` / `memory_reserved` and their `max_`
///   twins;
/// - `empty_cache`: `emptyCache` (every device's unused cached blocks go back to CUDA);
/// - `budget`: libtorch's per-process memory fraction, see [`MemorySource::budget`] below;
/// - `alloc_retries`: libtorch's `num_alloc_retries` (an allocation that failed in CUDA, released
///   the cache and retried), which the retry engine watches for thrashing;
/// - `memory_summary`: PyTorch's `memory_summary` table over libtorch's statistics.
///
/// With it, `oomguard::source::guards` (leak checks, peak scopes, empty-cache on drop),
/// `oomguard::retry::find_max_batch` and the retry engine work over tch's memory. Register it
/// ([`LibtorchCudaSource::register`]) so that the `#[oom_retry]` macros' retries empty its cache.
///
/// libtorch frees a tensor's block when the last tch `Tensor` handle to it drops; the block is
/// reused on its stream once the stream's work is done, so the counters are exact without a
/// synchronisation (tch runs on the device's default stream).
#[derive(Clone, Debug)]
pub struct LibtorchCudaSource {
    device: usize,
    name: String,
    total: u64,
}

impl LibtorchCudaSource {
    /// The source of CUDA device `device`. Errors, never panics: `Unavailable` without a CUDA
    /// device (no driver, none visible, or a shim built without CUDA), `InvalidArgument` for a
    /// device that does not exist. Initialises libtorch's CUDA state, as the first CUDA tensor
    /// would.
    pub fn new(device: usize) -> oomguard::Result<Self> {
        let CudaDeviceInfo {
            name, total_bytes, ..
        } = cuda_allocator::device_info(device)?;
        Ok(Self {
            device,
            name,
            total: total_bytes,
        })
    }

    /// The source of a tch device: `Device::Cuda(i)`; any other device is an `InvalidArgument`
    /// error naming it.
    pub fn of(device: tch::Device) -> oomguard::Result<Self> {
        match device {
            tch::Device::Cuda(i) => Self::new(i),
            other => Err(oomguard::Error::InvalidArgument(format!(
                "{other:?} is not a CUDA device: libtorch's CUDA caching allocator serves \
                 Device::Cuda(i) only"
            ))),
        }
    }

    /// This source as a shared, registered `MemorySource`: the attribute macros' retries (which
    /// hold no handle) empty its cache and watch its retries. Registered while the returned
    /// `Arc` lives.
    pub fn register(self) -> Arc<dyn MemorySource> {
        let s: Arc<dyn MemorySource> = Arc::new(self);
        oomguard::source::register(&s);
        s
    }

    /// The CUDA device ordinal.
    pub fn device(&self) -> usize {
        self.device
    }

    /// All of libtorch's statistics for the device ([`DeviceStats`]).
    pub fn stats(&self) -> oomguard::Result<DeviceStats> {
        cuda_allocator::device_stats(self.device)
    }

    /// Resets the accumulated totals of [`LibtorchCudaSource::stats`] (allocated / freed totals,
    /// `num_alloc_retries`, `num_ooms`).
    pub fn reset_accumulated_stats(&self) -> oomguard::Result<()> {
        cuda_allocator::reset_accumulated_stats(self.device)
    }

    /// PyTorch's `memory_summary(abbreviated)` table for the device, with the allocator's
    /// configuration and the memory fraction in force below it.
    pub fn summary(&self, abbreviated: bool) -> oomguard::Result<String> {
        let stats = self.stats()?;
        let mut extra = Vec::new();
        match cuda_allocator::allocator_info() {
            Ok(a) => {
                extra.push(format!(
                    "allocator: {}; expandable segments: {}",
                    a.name,
                    if a.expandable_segments { "on" } else { "off" }
                ));
                if !a.settings.is_empty() {
                    extra.push(format!("PYTORCH_ALLOC_CONF: {}", a.settings));
                }
            }
            Err(e) => extra.push(format!("allocator: unavailable: {e}")),
        }
        match cuda_allocator::memory_fraction(self.device) {
            Ok(f) if f < 1.0 => extra.push(format!(
                "memory fraction: {f} of {} ({} reservable)",
                ByteSize(self.total),
                ByteSize((f * self.total as f64) as u64)
            )),
            Ok(_) => extra.push(format!(
                "memory fraction: none (device {})",
                ByteSize(self.total)
            )),
            Err(e) => extra.push(format!("memory fraction: unavailable: {e}")),
        }
        Ok(format_memory_summary(
            &stats,
            self.device,
            abbreviated,
            &extra,
        ))
    }
}

impl MemorySource for LibtorchCudaSource {
    fn info(&self) -> SourceInfo {
        SourceInfo {
            device_name: self.name.clone(),
            ordinal: self.device,
            total_bytes: self.total,
            kind: "libtorch caching allocator",
        }
    }

    fn usage(&self) -> oomguard::Result<MemoryUsage> {
        Ok(self.stats()?.usage())
    }

    /// The device's free memory plus what libtorch caches unused (it releases its cache before
    /// failing an allocation), capped by the memory fraction in force less what is allocated.
    fn available(&self) -> oomguard::Result<u64> {
        let free = cuda_allocator::device_info(self.device)?.free_bytes;
        let u = self.usage()?;
        let avail = free + u.reserved.saturating_sub(u.used);
        let f = cuda_allocator::memory_fraction(self.device)?;
        Ok(if f < 1.0 {
            avail.min(fraction_cap(f, self.total).saturating_sub(u.used))
        } else {
            avail
        })
    }

    fn reset_peak(&self) -> oomguard::Result<()> {
        cuda_allocator::reset_peak_stats(self.device)
    }

    fn empty_cache(&self) -> oomguard::Result<()> {
        cuda_allocator::empty_cache(self.device)
    }

    fn alloc_retries(&self) -> u64 {
        self.stats()
            .map(|s| u64::try_from(s.num_alloc_retries).unwrap_or(0))
            .unwrap_or(0)
    }

    fn memory_summary(&self) -> String {
        self.summary(false)
            .unwrap_or_else(|e| format!("libtorch CUDA memory summary unavailable: {e}\n"))
    }

    /// Caps libtorch's memory on the device at `limit` bytes through its per-process memory
    /// fraction (`torch.cuda.set_per_process_memory_fraction(limit / total)`), until the returned
    /// guard is dropped.
    ///
    /// What it is: libtorch refuses to *reserve* (segments from CUDA: `cudaMalloc`, or mapped
    /// pages of expandable segments) past `floor(limit / total × total)` bytes (`total`: the
    /// device's memory; the double arithmetic can land a few bytes under `limit`). An allocation
    /// that would pass it releases libtorch's cache, retries, then raises libtorch's own "CUDA
    /// out of memory. Tried to allocate ..." (with "... allowed;" in its text), which
    /// [`crate::tch_error_is_oom`], [`crate::catch_oom`] and the retry engine see as an
    /// out-of-memory (not as an oomguard budget's: `is_budget_exceeded` is false).
    ///
    /// What it is not:
    /// - not a cap on allocated bytes: the cache counts, and fragmentation inside libtorch's
    ///   segments can make it refuse with less than `limit` allocated;
    /// - not per thread or per scope: it is the device's state in this process (every thread,
    ///   every tch tensor on the device), and memory already reserved beyond it stays reserved
    ///   (empty the cache to give it back);
    /// - not a cap on memory taken outside libtorch's allocator (cuBLAS/cuDNN workspaces are
    ///   libtorch allocations and count; CUDA's context, other libraries and processes do not).
    ///
    /// Several budgets may live at once, on any handles of the device: the tightest live one is
    /// in force; when the last is dropped, the fraction in force before the first one (e.g. from
    /// `PYTORCH_ALLOC_CONF=per_process_memory_fraction:...`) is restored. A
    /// [`cuda_allocator::set_memory_fraction`] made while budgets live is overwritten when one of
    /// them is made or dropped.
    ///
    /// Refused: 0 (as on every source) and a limit above the device's total memory.
    fn budget(&self, limit: u64) -> oomguard::Result<SourceBudget> {
        if limit == 0 {
            return Err(oomguard::Error::InvalidArgument(
                "a budget of 0 bytes: libtorch's memory fraction must be above 0".into(),
            ));
        }
        if limit > self.total {
            return Err(oomguard::Error::InvalidArgument(format!(
                "a budget of {} on CUDA device {} ({}), which has {} in all",
                ByteSize(limit),
                self.device,
                self.name,
                ByteSize(self.total)
            )));
        }
        let lift = BudgetEntry::open(self.device, self.total, limit)?;
        Ok(SourceBudget::new(limit, self.info(), Box::new(lift)))
    }

    fn source_id(&self) -> usize {
        // Distinct from oomguard's devices, driver pools (by context) and burn's 0x2000_0000 + i.
        0x3000_0000 + self.device
    }
}

/// libtorch's cap for `fraction` of `total`: `static_cast<size_t>(fraction * total)`.
fn fraction_cap(fraction: f64, total: u64) -> u64 {
    (fraction * total as f64) as u64
}

/// The fraction that caps `total` at `limit` (1.0 lifts the cap).
fn fraction_for(limit: u64, total: u64) -> f64 {
    if limit >= total {
        1.0
    } else {
        limit as f64 / total as f64
    }
}

/// The live budgets of a device and the fraction in force before the first.
#[derive(Debug)]
struct DeviceBudgets {
    before: f64,
    total: u64,
    live: Vec<(u64, u64)>, // (budget id, limit)
}

static BUDGETS: Mutex<Option<HashMap<usize, DeviceBudgets>>> = Mutex::new(None);
static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

fn budgets() -> MutexGuard<'static, Option<HashMap<usize, DeviceBudgets>>> {
    // Entries change only under the lock and stay consistent if a holder panicked.
    BUDGETS.lock().unwrap_or_else(|e| e.into_inner())
}

/// One live budget; dropping it puts the tightest remaining budget (or the fraction from before
/// the first) in force.
#[derive(Debug)]
struct BudgetEntry {
    device: usize,
    id: u64,
}

impl BudgetEntry {
    fn open(device: usize, total: u64, limit: u64) -> oomguard::Result<Self> {
        let mut all = budgets();
        let map = all.get_or_insert_with(HashMap::new);
        if let std::collections::hash_map::Entry::Vacant(v) = map.entry(device) {
            // the fraction to restore when the last budget of the device is dropped
            let before = cuda_allocator::memory_fraction(device)?;
            v.insert(DeviceBudgets {
                before,
                total,
                live: Vec::new(),
            });
        }
        let id = NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let entry = map.get_mut(&device).expect("inserted above");
        let tightest = entry.live.iter().map(|&(_, l)| l).fold(limit, u64::min);
        match cuda_allocator::set_memory_fraction(device, fraction_for(tightest, total)) {
            Ok(()) => entry.live.push((id, limit)),
            Err(e) => {
                if entry.live.is_empty() {
                    map.remove(&device);
                }
                return Err(e);
            }
        }
        Ok(Self { device, id })
    }
}

impl Drop for BudgetEntry {
    fn drop(&mut self) {
        let mut all = budgets();
        let Some(map) = all.as_mut() else { return };
        let Some(entry) = map.get_mut(&self.device) else {
            return;
        };
        entry.live.retain(|&(id, _)| id != self.id);
        let fraction = match entry.live.iter().map(|&(_, l)| l).min() {
            Some(l) => fraction_for(l, entry.total),
            None => entry.before,
        };
        if entry.live.is_empty() {
            map.remove(&self.device);
        }
        if let Err(e) = cuda_allocator::set_memory_fraction(self.device, fraction) {
            // A drop cannot return the error; it is logged (the device had answered when the
            // budget was made, so this means CUDA itself failed since).
            eprintln!(
                "oomguard-tch: restoring libtorch's memory fraction {fraction} on CUDA device {} \
                 failed: {e}",
                self.device
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fraction_round_trips_to_the_limit_within_bytes() {
        let total = 85_045_870_592u64; // an H100 80GB's cudaMemGetInfo total
        for limit in [1u64, 1 << 20, 3 << 30, 40_000_000_007, total - 1] {
            let cap = fraction_cap(fraction_for(limit, total), total);
            assert!(cap <= limit && limit - cap <= 16, "{limit} -> {cap}");
        }
        assert_eq!(fraction_for(total, total), 1.0);
    }
}
