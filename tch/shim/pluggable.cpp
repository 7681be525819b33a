// oomguard's allocator under libtorch: a CUDAPluggableAllocator (libtorch_cuda's
// torch::cuda::CUDAPluggableAllocator, the interface behind PyTorch's
// torch.cuda.memory.change_current_allocator) whose calls go to callbacks given by Rust
// (tch/src/allocator/ffi.rs). C ABI only: every C++ exception is caught here and returned as a
// code and a message; the callbacks never unwind (Rust catches its panics).
//
// Codes returned by the oomguard_tch_pluggable_* functions:
//   0 done; 1 too late: libtorch's CUDA allocator is initialised already (a CUDA tensor was made,
//   or CUDA initialised); 2 another libtorch error (message); 3 built without CUDA;
//   4 installed already (by this shim).
// Codes the alloc callback returns: 0 served; 1 out of memory (thrown as c10::OutOfMemoryError,
// what libtorch's own allocator throws); 2 another failure (thrown as c10::Error).

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>

#ifndef OOMGUARD_TCH_WITHOUT_CUDA
#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#endif

extern "C" {
// What Rust serves. Messages are written NUL-terminated into msg (cap bytes).
struct oomguard_tch_callbacks {
  int32_t (*alloc)(size_t size, int32_t device, void* stream, void** out,
                   char* msg, size_t cap);
  // Never fails towards libtorch: it runs in tensor destructors (noexcept).
  void (*free)(void* ptr, size_t size, int32_t device, void* stream);
  int32_t (*record_stream)(void* ptr, void* stream, char* msg, size_t cap);
  int32_t (*empty_cache)(char* msg, size_t cap);
  int32_t (*memory_fraction)(double fraction, int32_t device, char* msg,
                             size_t cap);
};
}

namespace {

constexpr size_t kMsg = 4096;

void copy_message(const char* text, char* out, size_t cap) {
  if (out == nullptr || cap == 0) {
    return;
  }
  size_t n = std::strlen(text);
  if (n >= cap) {
    n = cap - 1;
  }
  std::memcpy(out, text, n);
  out[n] = '\0';
}

#ifndef OOMGUARD_TCH_WITHOUT_CUDA
// Runs `body`, which returns the function's code, turning every exception into a code and its
// message: `oom_code` for c10::OutOfMemoryError, 2 for any other (c10's errors without their
// backtrace).
template <typename F>
int32_t guarded(char* err, size_t cap, F&& body, int32_t oom_code = 2) {
  try {
    return body();
  } catch (const c10::OutOfMemoryError& e) {
    copy_message(e.what_without_backtrace(), err, cap);
    return oom_code;
  } catch (const c10::Error& e) {
    copy_message(e.what_without_backtrace(), err, cap);
    return 2;
  } catch (const std::exception& e) {
    copy_message(e.what(), err, cap);
    return 2;
  } catch (...) {
    copy_message("unknown C++ exception", err, cap);
    return 2;
  }
}

// The message and code of a call that needs oomguard's allocator installed.
int32_t not_installed(char* err, size_t cap) {
  copy_message("oomguard's allocator is not installed", err, cap);
  return 2;
}
#endif

#ifndef OOMGUARD_TCH_WITHOUT_CUDA
namespace cca = c10::cuda::CUDACachingAllocator;
namespace plug = torch::cuda::CUDAPluggableAllocator;

// The installed allocator (kept for the process: libtorch's DataPtrs point at it) and what it
// replaced, for putting libtorch's back when install's proof fails.
std::shared_ptr<cca::CUDAAllocator> g_ours;
cca::CUDAAllocator* g_previous = nullptr;
c10::Allocator* g_previous_registered = nullptr;

// Throws what a callback's failure means to libtorch (called from inside libtorch's calls).
[[noreturn]] void throw_failure(int32_t code, const char* msg) {
  if (code == 1) {
    TORCH_CHECK_WITH(OutOfMemoryError, false, msg);
  }
  TORCH_CHECK(false, msg);
  std::terminate();  // unreachable: TORCH_CHECK(false) throws
}
#endif

}  // namespace

extern "C" {

// Whether libtorch's current CUDA allocator is initialised (1) or not (0), with its name
// ("native", "cudaMallocAsync", "pluggable") in name; -1 and the message without CUDA.
int32_t oomguard_tch_cuda_allocator_state(char* name, size_t cap) {
#ifdef OOMGUARD_TCH_WITHOUT_CUDA
  copy_message("oomguard-tch was built without CUDA (OOMGUARD_TCH_CUDA_INCLUDE=none or a "
               "libtorch without libtorch_cuda)",
               name, cap);
  return -1;
#else
  try {
    cca::CUDAAllocator* current = cca::allocator.load();
    if (current == nullptr) {
      copy_message("libtorch has no CUDA allocator", name, cap);
      return -1;
    }
    copy_message(current->name().c_str(), name, cap);
    return current->initialized() ? 1 : 0;
  } catch (const std::exception& e) {
    copy_message(e.what(), name, cap);
    return -1;
  } catch (...) {
    copy_message("unknown C++ exception", name, cap);
    return -1;
  }
#endif
}

// Installs a CUDAPluggableAllocator served by cb as libtorch's CUDA allocator: both
// c10::cuda::CUDACachingAllocator's current allocator (what CUDA tensors are allocated from)
// and c10's registered allocator for the CUDA device type (what at::accelerator's memory calls
// and c10::GetAllocator(kCUDA) reach; changeCurrentAllocator does not change it).
int32_t oomguard_tch_pluggable_install(const oomguard_tch_callbacks* cb,
                                       char* err, size_t cap) {
#ifdef OOMGUARD_TCH_WITHOUT_CUDA
  (void)cb;
  copy_message("oomguard-tch was built without CUDA (OOMGUARD_TCH_CUDA_INCLUDE=none or a "
               "libtorch without libtorch_cuda)",
               err, cap);
  return 3;
#else
  return guarded(err, cap, [&]() -> int32_t {
    if (g_ours) {
      copy_message("oomguard's allocator is libtorch's CUDA allocator already", err, cap);
      return 4;
    }
    cca::CUDAAllocator* current = cca::allocator.load();
    if (current == nullptr) {
      copy_message("libtorch has no CUDA allocator", err, cap);
      return 2;
    }
    if (current->initialized()) {
      copy_message(("libtorch's CUDA allocator (\"" + current->name() +
                    "\") is initialised already: it cannot be replaced once CUDA has been "
                    "initialised (a CUDA tensor made, a CUDA seed set, ...)")
                       .c_str(),
                   err, cap);
      return 1;
    }
    const oomguard_tch_callbacks c = *cb;
    auto ours = plug::createCustomAllocator(
        [c](size_t size, int device, cudaStream_t stream) -> void* {
          void* out = nullptr;
          char msg[kMsg] = {0};
          int32_t code = c.alloc(size, device, static_cast<void*>(stream), &out, msg, kMsg);
          if (code != 0) {
            throw_failure(code, msg);
          }
          return out;
        },
        [c](void* ptr, size_t size, int device, cudaStream_t stream) {
          c.free(ptr, size, device, static_cast<void*>(stream));
        });
    auto* p = static_cast<plug::CUDAPluggableAllocator*>(ours.get());
    p->set_record_stream_fn([c](void* ptr, cudaStream_t stream) {
      char msg[kMsg] = {0};
      int32_t code = c.record_stream(ptr, static_cast<void*>(stream), msg, kMsg);
      if (code != 0) {
        throw_failure(2, msg);
      }
    });
    // CUDAPluggableAllocator::emptyCache(mempool) calls the reset function (any mempool).
    p->set_reset_fn([c]() {
      char msg[kMsg] = {0};
      int32_t code = c.empty_cache(msg, kMsg);
      if (code != 0) {
        throw_failure(2, msg);
      }
    });
    p->set_memory_fraction_fn([c](double fraction, int device) {
      char msg[kMsg] = {0};
      int32_t code = c.memory_fraction(fraction, device, msg, kMsg);
      if (code != 0) {
        throw_failure(2, msg);
      }
    });
    c10::Allocator* registered = c10::GetAllocator(c10::DeviceType::CUDA);
    try {
      plug::changeCurrentAllocator(ours);
    } catch (const c10::Error& e) {
      // its own refusal: another thread initialised CUDA meanwhile
      const char* what = e.what_without_backtrace();
      if (std::strncmp(what, "Can't swap an already initialized allocator", 43) != 0) {
        throw;
      }
      copy_message(what, err, cap);
      return 1;
    }
    c10::SetAllocator(c10::DeviceType::CUDA, ours.get(), UINT8_MAX);
    g_ours = ours;
    g_previous = current;
    g_previous_registered = registered;
    return 0;
  });
#endif
}

// 1 when the installed allocator is both libtorch's current CUDA allocator and the one
// registered for the CUDA device type; 0 otherwise (or not installed).
int32_t oomguard_tch_pluggable_is_current() {
#ifdef OOMGUARD_TCH_WITHOUT_CUDA
  return 0;
#else
  try {
    if (!g_ours) {
      return 0;
    }
    return cca::allocator.load() == g_ours.get() &&
                   c10::GetAllocator(c10::DeviceType::CUDA) == g_ours.get()
               ? 1
               : 0;
  } catch (...) {
    return 0;
  }
#endif
}

// Puts back the allocator install replaced (its proof failed, nothing it served is live), and
// initialises it when libtorch initialised CUDA meanwhile (its init went to ours).
int32_t oomguard_tch_pluggable_uninstall(char* err, size_t cap) {
#ifdef OOMGUARD_TCH_WITHOUT_CUDA
  copy_message("oomguard-tch was built without CUDA", err, cap);
  return 3;
#else
  return guarded(err, cap, [&]() -> int32_t {
    if (!g_ours) {
      return not_installed(err, cap);
    }
    cca::allocator.store(g_previous);
    c10::SetAllocator(c10::DeviceType::CUDA, g_previous_registered, UINT8_MAX);
    if (!g_previous->initialized()) {
      g_previous->init(c10::cuda::device_count());
    }
    // g_ours stays alive (libtorch's pluggable keeps it as its current custom allocator).
    g_ours.reset();
    return 0;
  });
#endif
}

// libtorch's calls through the installed allocator, as libtorch makes them, for tests without
// a GPU (allocate() and the DataPtr deleter need a CUDA device to ask for the current one):
// malloc(size, device, default stream); the deleter's raw_delete(ptr); emptyCache(); and
// setMemoryFraction(fraction, device). A failure's what() goes to err with code 1 for
// c10::OutOfMemoryError (its whole what(), c10's backtrace included, as tch keeps it), 2 for any
// other exception (its first line).
int32_t oomguard_tch_pluggable_call_malloc(size_t size, int32_t device, void** out,
                                           char* err, size_t cap) {
#ifdef OOMGUARD_TCH_WITHOUT_CUDA
  (void)size, (void)device, (void)out;
  copy_message("oomguard-tch was built without CUDA", err, cap);
  return 3;
#else
  return guarded(
      err, cap,
      [&]() -> int32_t {
        if (!g_ours) {
          return not_installed(err, cap);
        }
        auto* p = static_cast<plug::CUDAPluggableAllocator*>(g_ours.get());
        try {
          *out = p->malloc(size, static_cast<c10::DeviceIndex>(device), nullptr);
        } catch (const c10::OutOfMemoryError& e) {
          // the whole what(), as tch keeps it: the classifier reads the throw site too
          copy_message(e.what(), err, cap);
          return 1;
        }
        return 0;
      },
      1);
#endif
}

int32_t oomguard_tch_pluggable_call_raw_delete(void* ptr, char* err, size_t cap) {
#ifdef OOMGUARD_TCH_WITHOUT_CUDA
  (void)ptr;
  copy_message("oomguard-tch was built without CUDA", err, cap);
  return 3;
#else
  return guarded(err, cap, [&]() -> int32_t {
    if (!g_ours) {
      return not_installed(err, cap);
    }
    g_ours->raw_delete(ptr);
    return 0;
  });
#endif
}

// libtorch's emptyCache and setMemoryFraction through c10::cuda::CUDACachingAllocator (the
// current allocator, whichever it is).
int32_t oomguard_tch_libtorch_empty_cache(char* err, size_t cap) {
#ifdef OOMGUARD_TCH_WITHOUT_CUDA
  copy_message("oomguard-tch was built without CUDA", err, cap);
  return 3;
#else
  return guarded(err, cap, [&]() -> int32_t {
    cca::emptyCache();
    return 0;
  });
#endif
}

// libtorch's getDeviceStats(device) on its current allocator (PyTorch's memory_stats): 0 when it
// answers (allocated bytes, current, in *allocated), 2 and its message when it throws.
int32_t oomguard_tch_libtorch_device_stats(int32_t device, int64_t* allocated, char* err,
                                           size_t cap) {
#ifdef OOMGUARD_TCH_WITHOUT_CUDA
  (void)device, (void)allocated;
  copy_message("oomguard-tch was built without CUDA", err, cap);
  return 3;
#else
  return guarded(err, cap, [&]() -> int32_t {
    auto stats = cca::getDeviceStats(static_cast<c10::DeviceIndex>(device));
    *allocated = stats.allocated_bytes[0].current;
    return 0;
  });
#endif
}

int32_t oomguard_tch_libtorch_set_memory_fraction(double fraction, int32_t device, char* err,
                                                  size_t cap) {
#ifdef OOMGUARD_TCH_WITHOUT_CUDA
  (void)fraction, (void)device;
  copy_message("oomguard-tch was built without CUDA", err, cap);
  return 3;
#else
  return guarded(err, cap, [&]() -> int32_t {
    cca::setMemoryFraction(fraction, static_cast<c10::DeviceIndex>(device));
    return 0;
  });
#endif
}

}  // extern "C"
