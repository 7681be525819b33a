#!/usr/bin/env python3
"""Make libtorch raise its real out-of-memory errors on a CUDA GPU and record their exact texts.

oomguard-tch recognises libtorch's out-of-memory by the text tch keeps: tch's C wrapper
(PROTECT in torch-sys/libtch/torch_api.h) catches `const std::exception& e` and keeps
`strdup(e.what())`, i.e. the message plus the C++ backtrace c10 appends. This script records, for
each case, that exact `what()` (through a small C++ extension that calls the same ATen function
inside the same try/catch; needs a C++ compiler and ninja) and, always, Python's text with
TORCH_SHOW_CPP_STACKTRACES=1 (Python then shows `what()`, after its own type-name rewriting).

Cases (each in a fresh process: the allocator reads its settings when CUDA starts):
  caching      the caching allocator's "CUDA out of memory. Tried to allocate ..."
  expandable   the same under PYTORCH_ALLOC_CONF=expandable_segments:True
  fraction     the same under torch.cuda.set_per_process_memory_fraction(0.5) (item 3's budget)
  async        the cudaMallocAsync backend (PYTORCH_ALLOC_CONF=backend:cudaMallocAsync)
  driver       the CUDA runtime's cudaErrorMemoryAllocation through C10_CUDA_CHECK (no cache:
               PYTORCH_NO_CUDA_MEMORY_CACHING=1, so cudaMalloc is called directly)
  cublas       cuBLAS's CUBLAS_STATUS_ALLOC_FAILED: the device filled to the last MiB, then the
               process's first matmul (cublasCreate). cuBLAS may fail differently (lazy module
               loading): the case records whatever came, and says when it is not ALLOC_FAILED.
  cpu          the CPU allocator's ENOMEM (no GPU needed)
  not_oom      a shape error (must not be classified as out-of-memory)

usage (PyTorch 2.11, one CUDA device free):
  python3 tch/scripts/oom_messages.py --out oom_messages.json
Its Python texts are tch/tests/fixtures/oom_texts_h100_python.txt; the same errors raised through
tch itself are checked on a GPU by tch/tests/oom_texts_gpu.rs.

Time: the C++ extension is compiled once, by this process, into --ext-dir (kept between runs, so
a second run does not compile again); each case's process loads the built module (about 5-10 s
for `import torch` and CUDA's start). The first run's compile of a torch/extension.h file (one
core) takes tens of seconds: give the whole run 5 minutes, or pass --no-ext. The JSON is rewritten after
every case, so a run stopped early keeps the cases it finished. (The first run on the H100 was
stopped at 150 s, after 7 of 8 cases, with no JSON written; then each case's process compiled the
extension again into a fresh directory, the likely cause, and the JSON came only at the end.)
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

EXT_SRC = r"""
#include <torch/extension.h>
#include <string>
// The same catch as tch's PROTECT: `catch (const std::exception& e) { strdup(e.what()); }`.
#define WHAT(x) try { x; return std::string(); } catch (const std::exception& e) { return std::string(e.what()); }
std::string empty_what(int64_t nbytes, bool cuda) {
  WHAT(at::empty({nbytes}, at::TensorOptions().dtype(at::kByte).device(cuda ? at::kCUDA : at::kCPU)))
}
std::string matmul_what(at::Tensor a, at::Tensor b) { WHAT(at::matmul(a, b)) }
"""


def build_ext(build_dir):
    """Compile the C++ extension once (ninja does nothing when build_dir already holds it); its
    module file's path, or None (with the reason on stderr) when it cannot be built."""
    try:
        from torch.utils.cpp_extension import load_inline

        os.makedirs(build_dir, exist_ok=True)
        t0 = time.monotonic()
        mod = load_inline(
            name="oom_what",
            cpp_sources=EXT_SRC,
            functions=["empty_what", "matmul_what"],
            build_directory=build_dir,
            verbose=False,
        )
        print(f"C++ extension ready in {time.monotonic() - t0:.1f} s: {mod.__file__}", file=sys.stderr)
        return mod.__file__
    except Exception as e:  # no compiler / ninja / headers: Python's text only
        print(f"C++ extension not built ({type(e).__name__}: {e}); what() not recorded", file=sys.stderr)
        return None


def load_ext(path):
    """The module build_ext compiled (in a case's process, after `import torch`), or None."""
    if not path:
        return None
    import importlib.util

    spec = importlib.util.spec_from_file_location("oom_what", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fill_device(leave_bytes):
    """cudaMalloc until about `leave_bytes` stay free: one allocation of all but 64 MiB, then
    halving chunks. Raw cudaMalloc, not torch tensors: a failed cudaMalloc is a return code,
    where each failed torch.empty raised an OutOfMemoryError (with its C++ backtrace, under
    TORCH_SHOW_CPP_STACKTRACES=1), and filling 1 GiB tensor by tensor took about ten of them."""
    import ctypes

    cudart = ctypes.CDLL("libcudart.so.13")
    free = ctypes.c_size_t()
    total = ctypes.c_size_t()

    def free_now():
        cudart.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total))
        return free.value

    held = []
    ptr = ctypes.c_void_p()
    first = free_now() - (64 << 20)
    if first > 0 and cudart.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(first)) == 0:
        held.append(ptr.value)
    else:
        cudart.cudaGetLastError()
    chunk = 32 << 20
    while chunk >= 4096 and free_now() > leave_bytes:
        if cudart.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(chunk)) != 0:
            cudart.cudaGetLastError()
            chunk //= 2
        else:
            held.append(ptr.value)
    return held


def run_case(case, ext_path):
    """Runs in the child process: raise the case's error, return its texts."""
    import torch

    ext = load_ext(ext_path)
    out = {"case": case, "torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        out["device"] = torch.cuda.get_device_name(0)
        out["total_bytes"] = torch.cuda.get_device_properties(0).total_memory

    def record(py_call, what_call):
        try:
            py_call()
            out["python_type"] = None
            out["python_text"] = None
        except Exception as e:  # what we came for
            out["python_type"] = type(e).__module__ + "." + type(e).__qualname__
            out["python_text"] = str(e)
        out["what"] = what_call() if ext is not None else None
        if out["what"] == "":
            out["what"] = None

    big = 1 << 50  # 1 PiB: more than any device or host has
    if case in ("caching", "expandable", "async", "driver"):
        record(lambda: torch.empty(big, dtype=torch.uint8, device="cuda"),
               lambda: ext.empty_what(big, True))
    elif case == "fraction":
        torch.cuda.set_per_process_memory_fraction(0.5)
        n = int(torch.cuda.get_device_properties(0).total_memory * 0.6)
        out["requested_bytes"] = n
        record(lambda: torch.empty(n, dtype=torch.uint8, device="cuda"),
               lambda: ext.empty_what(n, True))
    elif case == "cublas":
        a = torch.randn(256, 256, device="cuda")
        b = torch.randn(256, 256, device="cuda")
        torch.cuda.synchronize()
        held = fill_device(leave_bytes=int(os.environ.get("OOM_LEAVE", 1 << 20)))
        free, _ = torch.cuda.mem_get_info()
        out["free_bytes_before_matmul"] = free
        out["held_allocations"] = len(held)
        # The extension's call is the first cuBLAS use when it runs first: it gets the
        # cublasCreate failure; Python's call then records its own.
        if ext is not None:
            out["what"] = ext.matmul_what(a, b) or None
        try:
            torch.matmul(a, b)
            torch.cuda.synchronize()
            out["python_type"] = None
            out["python_text"] = None
        except Exception as e:
            out["python_type"] = type(e).__module__ + "." + type(e).__qualname__
            out["python_text"] = str(e)
        text = (out.get("what") or out.get("python_text") or "")
        if "CUBLAS_STATUS_ALLOC_FAILED" not in text:
            out["note"] = "cuBLAS did not fail with ALLOC_FAILED here; try OOM_LEAVE=<bytes> (default 1 MiB)"
    elif case == "cpu":
        record(lambda: torch.empty(big, dtype=torch.uint8), lambda: ext.empty_what(big, False))
    elif case == "not_oom":
        a = torch.zeros(2, 3)
        b = torch.zeros(4, 5)
        record(lambda: torch.matmul(a, b), lambda: ext.matmul_what(a, b))
    else:
        raise SystemExit(f"unknown case {case}")
    return out


CASES = {
    # case: (extra environment, expected to be an out-of-memory)
    "caching": ({}, True),
    "expandable": ({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, True),
    "fraction": ({}, True),
    "async": ({"PYTORCH_ALLOC_CONF": "backend:cudaMallocAsync"}, True),
    "driver": ({"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}, True),
    "cublas": ({}, True),
    "cpu": ({}, True),
    "not_oom": ({}, False),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="oom_messages.json")
    ap.add_argument("--no-ext", action="store_true", help="Python's texts only (no C++ build)")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--ext-dir", default=os.path.join(tempfile.gettempdir(), "oomguard_oom_what"),
                    help="where the C++ extension is built (reused by later runs)")
    ap.add_argument("--case-timeout", type=float, default=120.0,
                    help="seconds one case's process may take before it is recorded as failed")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--ext-path", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_case(args.child, args.ext_path)))
        return
    for case in args.cases.split(","):
        if case not in CASES:
            raise SystemExit(f"unknown case {case!r} (cases: {', '.join(CASES)})")
    ext_path = None if args.no_ext else build_ext(args.ext_dir)
    results = []
    for case in args.cases.split(","):
        extra, expect = CASES[case]
        env = dict(os.environ, TORCH_SHOW_CPP_STACKTRACES="1", **extra)
        cmd = [sys.executable, __file__, "--child", case]
        if ext_path:
            cmd += ["--ext-path", ext_path]
        t0 = time.monotonic()
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True,
                               timeout=args.case_timeout)
            try:
                r = json.loads(p.stdout.strip().splitlines()[-1])
            except (IndexError, json.JSONDecodeError):
                r = {"case": case, "error": f"child failed (exit {p.returncode}): {p.stderr[-2000:]}"}
        except subprocess.TimeoutExpired as e:
            err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
            r = {"case": case, "error": f"child timed out after {args.case_timeout} s: {err[-2000:]}"}
        r["seconds"] = round(time.monotonic() - t0, 1)
        r["env"] = extra
        r["expect_oom"] = expect
        results.append(r)
        first = (r.get("what") or r.get("python_text") or r.get("error") or "").splitlines()[:1]
        print(f"[{case}] {r.get('python_type')}: {first} ({r['seconds']} s)", file=sys.stderr)
        # after every case: a run stopped early keeps what it recorded
        with open(args.out, "w") as f:
            json.dump({"generator": "tch/scripts/oom_messages.py", "cases": results}, f, indent=1)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
