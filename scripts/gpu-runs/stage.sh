#!/usr/bin/env bash
# Stages the GPU suites (and, with `loops`, the tch run programs) into .gpu/ for the device tool,
# release builds, with the run scripts beside them (`prelude.sh` and the issue*.sh of this folder).
#
# usage: scripts/gpu-runs/stage.sh [suites|loops|all]     (default: suites)
#   suites: root `gpu`, runtime `pool_gpu` and `retry_gpu` (as test-NAME), tch's `allocator_gpu`,
#           `finder_gpu`, `source_gpu` and `oom_texts_gpu` (as tchtest-NAME)
#   loops:  tch's `tch_convnet` and `tch_gpt` examples (as their names)
# Then, with the device tool: command `bash .gpu/issue37-za.sh suites` (or another run script),
# carry [".gpu"]. tch needs libtorch: scripts/libtorch.sh is run (its default prefix) and the
# tch crate is built in $TCH_TARGET (default target/tch-release). candle's GPU suites need the
# CUDA toolkit (scripts/cuda-toolkit.sh) and are not staged here.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
what=${1:-suites}
case $what in suites | loops | all) ;; *) echo "usage: $0 [suites|loops|all]" >&2; exit 2 ;; esac
export CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_BENCH_DEBUG=0
rm -rf .gpu && mkdir -p .gpu/bin
# `cargo ... --message-format=json` lines -> the executables of test (or example) targets
exes() { jq -r 'select(.reason=="compiler-artifact" and .executable != null) | .executable'; }
copy() { # copy PREFIX: each executable on stdin to .gpu/bin/PREFIX<target name>
  while read -r exe; do
    name=$(basename "$exe"); name=${name%-*}
    cp "$exe" ".gpu/bin/$1$name"
  done
}
if [ "$what" != loops ]; then
  cargo test --release --no-run -p oomguard --test gpu --message-format=json | exes | copy test-
  cargo test --release --no-run -p oomguard-runtime --test pool_gpu --test retry_gpu \
    --message-format=json | exes | copy test-
fi
exports="$(scripts/libtorch.sh)"
eval "$exports"
export CARGO_TARGET_DIR=${TCH_TARGET:-$PWD/target/tch-release}
(
  cd tch
  if [ "$what" != loops ]; then
    cargo test --release --no-run --test allocator_gpu --test finder_gpu --test source_gpu \
      --test oom_texts_gpu --message-format=json | exes | (cd .. && copy tchtest-)
  fi
  if [ "$what" != suites ]; then
    cargo build --release --example tch_convnet --example tch_gpt --message-format=json |
      exes | (cd .. && copy "")
  fi
)
strip .gpu/bin/* 2>/dev/null || true
cp scripts/gpu-runs/prelude.sh scripts/gpu-runs/issue*.sh .gpu/
ls -la .gpu/bin
du -sh .gpu
