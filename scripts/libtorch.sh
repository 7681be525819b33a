#!/usr/bin/env bash
# Installs libtorch 2.11.0 (the version tch 0.24.0 is made for) from PyPI into a prefix, for
# building and running oomguard-tch; prints the exports to eval. Nothing comes from outside PyPI.
#
# usage:  eval "$(scripts/libtorch.sh)"     then build oomguard-tch (tch/) as usual. In a script
#         under `set -e`, go through a variable (exports="$(scripts/libtorch.sh)"; eval "$exports"):
#         `eval "$(...)"` alone would hide a failed install.
# env:    OOMGUARD_LIBTORCH_PREFIX (default ~/.cache/oomguard/libtorch-2.11.0; CI puts it under
#         the target directory), OOMGUARD_LIBTORCH_ALL=1 to add cuSOLVER and NVRTC (see below).
#
# What: PyPI has no CPU-only torch for Linux x86_64: its one wheel is the CUDA 13.0 build
# (torch-2.11.0+cu130, 531 MB). libtorch_cpu.so itself needs libcudart and libcupti, and
# libtorch.so needs libtorch_cuda.so, which needs cuBLAS, cuDNN, cuFFT, cuSPARSE(Lt), cuRAND,
# cuFile, NCCL and NVSHMEM; without them no tch program loads, even on CPU. So the CUDA libraries
# torch's wheel depends on are installed beside it (pinned to the versions torch 2.11.0's
# metadata resolves to, --no-deps: no triton, no Python packages), where torch's own RUNPATH
# ($ORIGIN/../../nvidia/...) finds them: about 2.2 GB to download, 3.3 GiB (3.56 GB) on disk
# (`du -sb`: 3,557,604,773 bytes; `du -sh` prints 3.4G, rounding up). cuSOLVER
# (libtorch_cuda_linalg.so, loaded on first use of a CUDA linear-algebra op) and NVRTC (the
# jiterator) are not needed to load or on CPU: left out unless OOMGUARD_LIBTORCH_ALL=1.
# At run time the binary needs torch/lib on the loader's path: the printed LD_LIBRARY_PATH (tch
# sets no rpath on downstream binaries). On a GPU machine with its own torch 2.11 installed, point
# LD_LIBRARY_PATH at that torch/lib instead: the binary runs against it unchanged.
# Concurrent runs (two CI jobs, two worktrees sharing a prefix) are safe: each holds an
# exclusive lock on "$prefix.lock" (flock, util-linux) while it checks and installs, so one
# installs and the others wait, then find it complete; none removes a folder another is
# filling or reading half-made.
set -euo pipefail
prefix=${OOMGUARD_LIBTORCH_PREFIX:-$HOME/.cache/oomguard/libtorch-2.11.0}
mkdir -p "$(dirname "$prefix")"
if ! command -v flock >/dev/null; then
  echo "scripts/libtorch.sh: flock (util-linux) is needed to install safely; not found" >&2
  exit 1
fi
exec 9>"$prefix.lock"
if ! flock -n 9; then
  echo "scripts/libtorch.sh: another run is installing into $prefix; waiting for it" >&2
  flock 9
fi
if [ ! -e "$prefix/.complete" ]; then
  rm -rf "$prefix"; mkdir -p "$prefix"
  # pip holds the 2.2 GB of wheels in its temporary folder while it unpacks 3.3 GiB into the
  # prefix: ask for 6 GiB free on each, and say so, instead of failing halfway with ENOSPC.
  need_kib=$((6 * 1024 * 1024))
  for dir in "$prefix" "${TMPDIR:-/tmp}"; do
    free_kib=$(df -Pk "$dir" | awk 'NR == 2 { print $4 }')
    if [ "${free_kib:-0}" -lt "$need_kib" ]; then
      echo "scripts/libtorch.sh: $dir has $((free_kib / 1024)) MiB free; installing libtorch needs about 6 GiB" >&2
      exit 1
    fi
  done
  pkgs=(torch==2.11.0 nvidia-cuda-runtime==13.0.96 nvidia-cuda-cupti==13.0.85
    nvidia-cublas==13.1.0.3 nvidia-cufft==12.0.0.61 nvidia-cufile==1.15.1.6
    nvidia-curand==10.4.0.35 nvidia-cusparse==12.6.3.3 nvidia-nvjitlink==13.0.88
    nvidia-cudnn-cu13==9.19.0.56 nvidia-cusparselt-cu13==0.8.0 nvidia-nccl-cu13==2.28.9
    nvidia-nvshmem-cu13==3.4.5)
  if [ "${OOMGUARD_LIBTORCH_ALL:-0}" = 1 ]; then
    pkgs+=(nvidia-cusolver==12.0.4.66 nvidia-cuda-nvrtc==13.0.88 nvidia-nvtx==13.0.85)
  fi
  # One pip call: `--target` does not merge a second install into an existing nvidia/ folder.
  # The wheels' tags are given, so that the local Python's version does not matter (torch has
  # wheels for 3.10-3.14 only); pip does not widen a given manylinux tag to older ones.
  plats=()
  for p in manylinux_2_28 manylinux_2_27 manylinux_2_25 manylinux_2_18 manylinux_2_17 \
    manylinux2014 manylinux_2_12 manylinux2010 manylinux_2_5 manylinux1; do
    plats+=(--platform "${p}_x86_64")
  done
  python3 -m pip install -q --disable-pip-version-check --no-cache-dir --no-deps \
    --only-binary=:all: "${plats[@]}" --python-version 3.12 --implementation cp --abi cp312 \
    --target "$prefix" "${pkgs[@]}" >&2
  touch "$prefix/.complete"
fi
# CUDA's C runtime headers (crt/, 134 kB): oomguard-tch's C++ shim includes c10's CUDA headers,
# which include cuda_runtime_api.h, which needs crt/host_defines.h; PyPI's CUDA 13 runtime wheel
# ships the rest of include/ but not crt/. Added beside the others (own pip target, then copied:
# `--target` does not merge into an existing nvidia/ folder), for prefixes installed before it.
inc=$prefix/nvidia/cu13/include
if [ ! -e "$inc/crt/host_defines.h" ]; then
  rm -rf "$prefix/.crt"
  python3 -m pip install -q --disable-pip-version-check --no-cache-dir --no-deps \
    --only-binary=:all: --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --python-version 3.12 --implementation cp --abi cp312 \
    --target "$prefix/.crt" nvidia-cuda-crt==13.0.88 >&2
  cp -r "$prefix/.crt/nvidia/cu13/include/crt" "$inc/"
  rm -rf "$prefix/.crt"
fi
lib=$prefix/torch/lib
# LIBTORCH: torch-sys takes include/ and lib/ from the wheel's torch/ folder (no Python import,
# no version file: tch 0.24.0's own check is skipped, the pin above is the check).
echo "export LIBTORCH=\"$prefix/torch\" LIBTORCH_CXX11_ABI=1"
echo "export LD_LIBRARY_PATH=\"$lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}\""
