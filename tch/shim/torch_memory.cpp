// libtorch's CUDA caching allocator (c10::cuda::CUDACachingAllocator) behind a C ABI, for
// oomguard-tch's `LibtorchCudaSource` (src/libtorch_cuda_source.rs declares the same items).
//
// Rules of this ABI:
// - every function returns an `OomguardTchStatus` and never lets an exception out: each body
//   runs inside `guarded`, which catches everything and writes the message (without c10's
//   backtrace) into the caller's `err` buffer (NUL-terminated, truncated to `err_len`);
// - arguments are checked before any CUDA call, so the argument errors can be tested without a
//   device;
// - nothing reaches CUDA unless c10 counts at least one device: without a driver, every call
//   returns OOMGUARD_TCH_NO_CUDA.
// Built without CUDA headers (a CPU libtorch: build.rs defines OOMGUARD_TCH_WITHOUT_CUDA), every call
// that needs the device returns OOMGUARD_TCH_NO_CUDA saying so.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>

#include <c10/util/Exception.h>

#ifndef OOMGUARD_TCH_WITHOUT_CUDA
#include <ATen/Context.h>
#include <c10/core/AllocatorConfig.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/cuda/memory_snapshot.h>

// From ATen/cuda/CUDAContextLight.h (libtorch_cuda), declared here: that header includes
// cuBLAS / cuSPARSE headers, which need CUDA's CCCL headers that PyPI's wheels lack.
namespace at::cuda {
cudaDeviceProp* getDeviceProperties(c10::DeviceIndex device);
}
#endif

extern "C" {

enum OomguardTchStatus : int32_t {
  OOMGUARD_TCH_OK = 0,
  OOMGUARD_TCH_NO_CUDA = 1,
  OOMGUARD_TCH_BAD_DEVICE = 2,
  OOMGUARD_TCH_INVALID_ARGUMENT = 3,
  OOMGUARD_TCH_TORCH_ERROR = 4,
  OOMGUARD_TCH_OUT_OF_MEMORY = 5,
  OOMGUARD_TCH_OTHER_ERROR = 6,
};

// One of c10's `Stat`s.
struct OomguardTchStat {
  int64_t current;
  int64_t peak;
  int64_t allocated;
  int64_t freed;
};

// A c10 `StatArray`: [0] all pools, [1] the small pool, [2] the large pool.
struct OomguardTchStatArray {
  OomguardTchStat pools[3];
};

// c10::CachingDeviceAllocator::DeviceStats, flattened.
struct OomguardTchDeviceStats {
  OomguardTchStatArray allocation;
  OomguardTchStatArray segment;
  OomguardTchStatArray active;
  OomguardTchStatArray inactive_split;
  OomguardTchStatArray allocated_bytes;
  OomguardTchStatArray reserved_bytes;
  OomguardTchStatArray active_bytes;
  OomguardTchStatArray inactive_split_bytes;
  OomguardTchStatArray requested_bytes;
  int64_t num_alloc_retries;
  int64_t num_ooms;
  OomguardTchStat oversize_allocations;
  OomguardTchStat oversize_segments;
  int64_t num_sync_all_streams;
  int64_t num_device_alloc;
  int64_t num_device_free;
  int64_t max_split_size;
};

// What the allocator is and how it was configured (PYTORCH_ALLOC_CONF).
struct OomguardTchAllocatorInfo {
  char name[64];           // CUDAAllocator::name(): "native", "cudaMallocAsync", ...
  char settings[512];      // the allocator settings string libtorch last parsed
  int32_t expandable_segments;
  int32_t history_enabled;  // -1: the allocator cannot tell
};

typedef void (*OomguardTchSink)(void* ctx, const uint8_t* data, size_t len);

}  // extern "C"

namespace {

struct ShimError {
  OomguardTchStatus status;
  std::string message;
};

void write_message(char* err, size_t err_len, const std::string& m) {
  if (err == nullptr || err_len == 0) {
    return;
  }
  size_t n = m.size() < err_len - 1 ? m.size() : err_len - 1;
  std::memcpy(err, m.data(), n);
  err[n] = '\0';
}

// Runs `body`, turning every exception into a status and a message.
template <typename F>
int32_t guarded(char* err, size_t err_len, F&& body) {
  write_message(err, err_len, "");
  try {
    body();
    return OOMGUARD_TCH_OK;
  } catch (const ShimError& e) {
    write_message(err, err_len, e.message);
    return e.status;
  } catch (const c10::OutOfMemoryError& e) {
    write_message(err, err_len, e.what_without_backtrace());
    return OOMGUARD_TCH_OUT_OF_MEMORY;
  } catch (const c10::Error& e) {
    write_message(err, err_len, e.what_without_backtrace());
    return OOMGUARD_TCH_TORCH_ERROR;
  } catch (const std::exception& e) {
    write_message(err, err_len, e.what());
    return OOMGUARD_TCH_OTHER_ERROR;
  } catch (...) {
    write_message(err, err_len, "an unknown C++ exception");
    return OOMGUARD_TCH_OTHER_ERROR;
  }
}

void need(bool ok, OomguardTchStatus status, const std::string& message) {
  if (!ok) {
    throw ShimError{status, message};
  }
}

#ifdef OOMGUARD_TCH_WITHOUT_CUDA

int64_t cuda_device_count() {
  return 0;
}

[[noreturn]] void no_cuda() {
  throw ShimError{
      OOMGUARD_TCH_NO_CUDA,
      "oomguard-tch's shim was built against a libtorch without CUDA (no libtorch_cuda, or no "
      "CUDA headers found at build time): libtorch's CUDA allocator cannot be reached"};
}

#else

int64_t cuda_device_count() {
  // noexcept: 0 without a driver or a visible device.
  return static_cast<int64_t>(c10::cuda::device_count());
}

// Checks that `device` is a CUDA device of this process and initialises libtorch's CUDA state
// (the caching allocator is set up there), as the first CUDA tensor would.
c10::DeviceIndex cuda_device(int64_t device) {
  int64_t n = cuda_device_count();
  need(n > 0, OOMGUARD_TCH_NO_CUDA,
       "no CUDA device: libtorch counts 0 (no NVIDIA driver, or no visible device)");
  need(device >= 0 && device < n, OOMGUARD_TCH_BAD_DEVICE,
       "CUDA device " + std::to_string(device) + " does not exist: libtorch counts " +
           std::to_string(n) + " device(s)");
  at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
  return static_cast<c10::DeviceIndex>(device);
}

void copy_stat(OomguardTchStat& out, const c10::CachingAllocator::Stat& s) {
  out.current = s.current;
  out.peak = s.peak;
  out.allocated = s.allocated;
  out.freed = s.freed;
}

void copy_array(OomguardTchStatArray& out, const c10::CachingAllocator::StatArray& a) {
  for (size_t i = 0; i < 3; ++i) {
    copy_stat(out.pools[i], a[i]);
  }
}

void copy_cstr(char* dst, size_t cap, const std::string& s) {
  size_t n = s.size() < cap - 1 ? s.size() : cap - 1;
  std::memcpy(dst, s.data(), n);
  dst[n] = '\0';
}

#endif

}  // namespace

extern "C" {

// Number of CUDA devices libtorch sees (0 without a driver). Never touches a device.
int32_t oomguard_tch_cuda_device_count(int64_t* out, char* err, size_t err_len) {
  return guarded(err, err_len, [&] {
    need(out != nullptr, OOMGUARD_TCH_INVALID_ARGUMENT, "out is null");
    *out = cuda_device_count();
  });
}

// Whether the shim was built with CUDA (1) or against a CPU-only libtorch (0).
int32_t oomguard_tch_built_with_cuda() {
#ifdef OOMGUARD_TCH_WITHOUT_CUDA
  return 0;
#else
  return 1;
#endif
}

// The device's free and total memory (cudaMemGetInfo, through the allocator's getMemoryInfo) and
// its name (at most name_len bytes, NUL-terminated).
int32_t oomguard_tch_device_info(int64_t device, uint64_t* free_bytes, uint64_t* total_bytes,
                                 char* name, size_t name_len, char* err, size_t err_len) {
  return guarded(err, err_len, [&] {
    need(free_bytes != nullptr && total_bytes != nullptr, OOMGUARD_TCH_INVALID_ARGUMENT,
         "free_bytes or total_bytes is null");
    need(name == nullptr || name_len > 0, OOMGUARD_TCH_INVALID_ARGUMENT,
         "a name buffer of 0 bytes");
#ifdef OOMGUARD_TCH_WITHOUT_CUDA
    no_cuda();
#else
    auto d = cuda_device(device);
    auto info = c10::cuda::CUDACachingAllocator::get()->getMemoryInfo(d);
    *free_bytes = info.first;
    *total_bytes = info.second;
    if (name != nullptr) {
      copy_cstr(name, name_len, at::cuda::getDeviceProperties(d)->name);
    }
#endif
  });
}

int32_t oomguard_tch_device_stats(int64_t device, OomguardTchDeviceStats* out, char* err,
                                  size_t err_len) {
  return guarded(err, err_len, [&] {
    need(out != nullptr, OOMGUARD_TCH_INVALID_ARGUMENT, "out is null");
#ifdef OOMGUARD_TCH_WITHOUT_CUDA
    no_cuda();
#else
    auto s = c10::cuda::CUDACachingAllocator::getDeviceStats(cuda_device(device));
    copy_array(out->allocation, s.allocation);
    copy_array(out->segment, s.segment);
    copy_array(out->active, s.active);
    copy_array(out->inactive_split, s.inactive_split);
    copy_array(out->allocated_bytes, s.allocated_bytes);
    copy_array(out->reserved_bytes, s.reserved_bytes);
    copy_array(out->active_bytes, s.active_bytes);
    copy_array(out->inactive_split_bytes, s.inactive_split_bytes);
    copy_array(out->requested_bytes, s.requested_bytes);
    out->num_alloc_retries = s.num_alloc_retries;
    out->num_ooms = s.num_ooms;
    copy_stat(out->oversize_allocations, s.oversize_allocations);
    copy_stat(out->oversize_segments, s.oversize_segments);
    out->num_sync_all_streams = s.num_sync_all_streams;
    out->num_device_alloc = s.num_device_alloc;
    out->num_device_free = s.num_device_free;
    out->max_split_size = s.max_split_size;
#endif
  });
}

int32_t oomguard_tch_reset_peak_stats(int64_t device, char* err, size_t err_len) {
  return guarded(err, err_len, [&] {
#ifdef OOMGUARD_TCH_WITHOUT_CUDA
    no_cuda();
#else
    c10::cuda::CUDACachingAllocator::resetPeakStats(cuda_device(device));
#endif
  });
}

int32_t oomguard_tch_reset_accumulated_stats(int64_t device, char* err, size_t err_len) {
  return guarded(err, err_len, [&] {
#ifdef OOMGUARD_TCH_WITHOUT_CUDA
    no_cuda();
#else
    c10::cuda::CUDACachingAllocator::resetAccumulatedStats(cuda_device(device));
#endif
  });
}

// Releases every unused cached block of the default pools of every device
// (CUDACachingAllocator::emptyCache, what torch.cuda.empty_cache calls). `device` is checked
// only so that nothing reaches CUDA without one.
int32_t oomguard_tch_empty_cache(int64_t device, char* err, size_t err_len) {
  return guarded(err, err_len, [&] {
#ifdef OOMGUARD_TCH_WITHOUT_CUDA
    no_cuda();
#else
    cuda_device(device);
    c10::cuda::CUDACachingAllocator::emptyCache();
#endif
  });
}

int32_t oomguard_tch_get_memory_fraction(int64_t device, double* out, char* err, size_t err_len) {
  return guarded(err, err_len, [&] {
    need(out != nullptr, OOMGUARD_TCH_INVALID_ARGUMENT, "out is null");
#ifdef OOMGUARD_TCH_WITHOUT_CUDA
    no_cuda();
#else
    *out = c10::cuda::CUDACachingAllocator::getMemoryFraction(cuda_device(device));
#endif
  });
}

// The per-process memory fraction (torch.cuda.set_per_process_memory_fraction): the allocator
// refuses to reserve past fraction × the device's total memory. 1.0 lifts the cap.
int32_t oomguard_tch_set_memory_fraction(int64_t device, double fraction, char* err,
                                         size_t err_len) {
  return guarded(err, err_len, [&] {
    need(std::isfinite(fraction) && fraction > 0.0 && fraction <= 1.0,
         OOMGUARD_TCH_INVALID_ARGUMENT,
         "a memory fraction of " + std::to_string(fraction) + ": it must be in (0, 1]");
#ifdef OOMGUARD_TCH_WITHOUT_CUDA
    no_cuda();
#else
    c10::cuda::CUDACachingAllocator::setMemoryFraction(fraction, cuda_device(device));
#endif
  });
}

// torch::cuda::_record_memory_history (torch.cuda.memory._record_memory_history).
// enabled: 0 stops recording (and keeps what was recorded), 1 records. context: nullptr (no
// stacks), "state", "alloc" or "all"; stacks: "python" (Python and TorchScript frames only:
// none in a tch program) or "all" (adds C++ frames). max_entries: the ring's size.
int32_t oomguard_tch_record_history(int32_t enabled, const char* context, const char* stacks,
                                    uint64_t max_entries, int32_t clear_history, char* err,
                                    size_t err_len) {
  return guarded(err, err_len, [&] {
    need(enabled == 0 || enabled == 1, OOMGUARD_TCH_INVALID_ARGUMENT, "enabled must be 0 or 1");
    need(stacks != nullptr, OOMGUARD_TCH_INVALID_ARGUMENT, "stacks is null");
    std::string st(stacks);
    need(st == "python" || st == "all", OOMGUARD_TCH_INVALID_ARGUMENT,
         "stacks \"" + st + "\": expected \"python\" or \"all\"");
    std::string ctx = context == nullptr ? "" : context;
    need(context == nullptr || ctx == "state" || ctx == "alloc" || ctx == "all",
         OOMGUARD_TCH_INVALID_ARGUMENT,
         "context \"" + ctx + "\": expected null, \"state\", \"alloc\" or \"all\"");
    need(max_entries > 0, OOMGUARD_TCH_INVALID_ARGUMENT, "max_entries must be at least 1");
#ifdef OOMGUARD_TCH_WITHOUT_CUDA
    no_cuda();
#else
    cuda_device(0);
    std::optional<std::string> en;
    if (enabled) {
      en = "all";
    }
    std::optional<std::string> cx;
    if (context != nullptr) {
      cx = ctx;
    }
    torch::cuda::_record_memory_history(en, cx, st, static_cast<size_t>(max_entries),
                                        clear_history != 0);
#endif
  });
}

// torch::cuda::_memory_snapshot_pickled(): the snapshot of every device as the pickle
// torch.cuda.memory._dump_snapshot writes; handed to `sink` (called once, on success only).
int32_t oomguard_tch_snapshot_pickled(OomguardTchSink sink, void* ctx, char* err, size_t err_len) {
  return guarded(err, err_len, [&] {
    need(sink != nullptr, OOMGUARD_TCH_INVALID_ARGUMENT, "sink is null");
#ifdef OOMGUARD_TCH_WITHOUT_CUDA
    no_cuda();
#else
    cuda_device(0);
    std::string p = torch::cuda::_memory_snapshot_pickled();
    sink(ctx, reinterpret_cast<const uint8_t*>(p.data()), p.size());
#endif
  });
}

int32_t oomguard_tch_allocator_info(OomguardTchAllocatorInfo* out, char* err, size_t err_len) {
  return guarded(err, err_len, [&] {
    need(out != nullptr, OOMGUARD_TCH_INVALID_ARGUMENT, "out is null");
#ifdef OOMGUARD_TCH_WITHOUT_CUDA
    no_cuda();
#else
    cuda_device(0);
    auto* a = c10::cuda::CUDACachingAllocator::get();
    need(a != nullptr, OOMGUARD_TCH_OTHER_ERROR, "libtorch has no CUDA allocator installed");
    copy_cstr(out->name, sizeof(out->name), a->name());
    copy_cstr(out->settings, sizeof(out->settings),
              c10::CachingAllocator::AcceleratorAllocatorConfig::last_allocator_settings());
    out->expandable_segments =
        c10::CachingAllocator::AcceleratorAllocatorConfig::use_expandable_segments() ? 1 : 0;
    out->history_enabled = -1;
    try {
      out->history_enabled = a->isHistoryEnabled() ? 1 : 0;
    } catch (const c10::Error&) {
      // an allocator that cannot tell (a pluggable one): -1
    }
#endif
  });
}

}  // extern "C"
