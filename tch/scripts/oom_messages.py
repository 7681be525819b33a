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
The JSON goes to oomguard's tch/tests/fixtures/oom_messages_cuda.json; tch/tests/classify.rs
reads it (its test is ignored until the file is there).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

GiB = 1 << 30

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


def build_ext():
    """The C++ extension, or None (with the reason on stderr) when it cannot be built."""
    try:
        from torch.utils.cpp_extension import load_inline

        return load_inline(
            name="oom_what",
            cpp_sources=EXT_SRC,
            functions=["empty_what", "matmul_what"],
            build_directory=tempfile.mkdtemp(prefix="oom_what_"),
            verbose=False,
        )
    except Exception as e:  # no compiler / ninja / headers: Python's text only
        print(f"C++ extension not built ({type(e).__name__}: {e}); what() not recorded", file=sys.stderr)
        return None


def fill_device(torch, leave_bytes):
    """Allocate until about `leave_bytes` stay free (torch tensors, then raw cudaMalloc)."""
    import ctypes

    held = []
    chunk = GiB
    while chunk >= (2 << 20):
        try:
            held.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError:
            chunk //= 2
    cudart = ctypes.CDLL("libcudart.so.13")
    ptr = ctypes.c_void_p()
    chunk = 1 << 20
    while chunk >= 4096:
        free = ctypes.c_size_t()
        total = ctypes.c_size_t()
        cudart.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total))
        if free.value <= leave_bytes:
            break
        if cudart.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(chunk)) != 0:
            cudart.cudaGetLastError()
            chunk //= 2
        else:
            held.append(ptr.value)
    return held


def run_case(case, use_ext):
    """Runs in the child process: raise the case's error, return its texts."""
    import torch

    ext = build_ext() if use_ext else None
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
        held = fill_device(torch, leave_bytes=int(os.environ.get("OOM_LEAVE", 1 << 20)))
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
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_case(args.child, not args.no_ext)))
        return
    results = []
    for case in args.cases.split(","):
        extra, expect = CASES[case]
        env = dict(os.environ, TORCH_SHOW_CPP_STACKTRACES="1", **extra)
        cmd = [sys.executable, __file__, "--child", case] + (["--no-ext"] if args.no_ext else [])
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        try:
            r = json.loads(p.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            r = {"case": case, "error": f"child failed (exit {p.returncode}): {p.stderr[-2000:]}"}
        r["env"] = extra
        r["expect_oom"] = expect
        results.append(r)
        first = (r.get("what") or r.get("python_text") or r.get("error") or "").splitlines()[:1]
        print(f"[{case}] {r.get('python_type')}: {first}", file=sys.stderr)
    with open(args.out, "w") as f:
        json.dump({"generator": "tch/scripts/oom_messages.py", "cases": results}, f, indent=1)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
