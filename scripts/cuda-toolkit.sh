#!/usr/bin/env bash
# Installs what candle's CUDA build needs and this machine lacks, all from PyPI, into a prefix:
# nvcc, NVVM and the headers of CUDA 13.0 (candle-kernels compiles its PTX with nvcc), the
# cuBLAS / cuRAND / NVRTC / cudart libraries candle links against (cudarc `dynamic-linking`), and a
# link-time stub of libcuda.so.1 made from cudarc's own list of driver functions (the real driver
# library is the one found at run time; nothing from the stub runs).
#
# usage:  eval "$(scripts/cuda-toolkit.sh)"     then build with --features cuda as usual.
# env:    OOMGUARD_CUDA_PREFIX (default ~/.cache/oomguard/cuda-13.0)
# Why 13.0: PTX from a newer nvcc does not load on a CUDA 13.0 driver (580); cudarc 0.19.10 knows
# versions up to 13.4 (set CUDARC_CUDA_VERSION for a toolkit it does not know).
set -euo pipefail
prefix=${OOMGUARD_CUDA_PREFIX:-$HOME/.cache/oomguard/cuda-13.0}
root=$(cd "$(dirname "$0")/.." && pwd)
cu=$prefix/nvidia/cu13
if [ ! -x "$cu/bin/nvcc" ]; then
  rm -rf "$prefix"; mkdir -p "$prefix"
  python3 -m pip install -q --disable-pip-version-check --target "$prefix" \
    nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 \
    nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 nvidia-cublas==13.0.2.14 \
    nvidia-cuda-nvrtc==13.0.88 nvidia-curand==10.4.0.35 >&2
fi
link=$prefix/link
if [ ! -e "$link/libcuda.so" ]; then
  mkdir -p "$link"
  for l in cublas cublasLt cudart curand nvrtc; do
    f=$(ls "$cu"/lib/lib$l.so.* | head -n 1); ln -sf "$f" "$link/lib$l.so"
  done
  # The driver's function names, from the cudarc sources cargo fetched for this workspace.
  cudarc=$(cd "$root" && cargo metadata --format-version 1 2>/dev/null |
    python3 -c 'import json,sys; print(next(p["manifest_path"] for p in json.load(sys.stdin)["packages"] if p["name"]=="cudarc"))')
  grep -ohE '^\s+fn cu[A-Za-z0-9_]+\(' "$(dirname "$cudarc")/src/driver/sys/mod.rs" |
    sed -E 's/^\s+fn (cu[A-Za-z0-9_]+)\(/void \1(void) {}/' | sort -u > "$link/cuda_stub.c"
  cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$link/libcuda.so" "$link/cuda_stub.c"
fi
echo "export PATH=\"$cu/bin:\$PATH\""
echo "export CUDA_ROOT=\"$cu\" CUDA_PATH=\"$cu\" CUDA_HOME=\"$cu\""
echo "export CUDA_COMPUTE_CAP=\${CUDA_COMPUTE_CAP:-90}"
echo "export LIBRARY_PATH=\"$link\${LIBRARY_PATH:+:\$LIBRARY_PATH}\""
