#!/usr/bin/env bash
# issue 38, run V (an H100): the measuring harness (oomguard-harness) behind candle_gpt and
# tch_gpt, against the figures of the examples it replaced: candle_gpt frag at 24, 27, 28 under
# default / native / pool (round 2 order, run 64 was round 1), and tch_gpt's plain steps at 44
# rows (GPT-2 small's largest) under oomguard, expandable segments and native.
cd "$(dirname "$0")/bin"; out=${OUT:-/tmp}
for f in *.xz; do [ -e "$f" ] && xz -d -f "$f"; done; chmod +x * 2>/dev/null
TL=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))')
log=$out/run-v.txt; : > "$log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$log"
date -u | tee -a "$log"
gpt() { # ENV... -- ARGS
  local envs=(); while [ "$1" != -- ]; do envs+=("$1"); shift; done; shift
  echo "=== tch_gpt ${envs[*]} $*" | tee -a "$log"
  env -u PYTORCH_ALLOC_CONF -u PYTORCH_CUDA_ALLOC_CONF LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-} "${envs[@]}" timeout 90 ./tch_gpt --phase plain "$@" 2>&1 | grep -E "^(RESULT|STEP)|rror|panick" | cut -c1-700 | tee -a "$log"
}
gpt -- --allocator oomguard --batch 44 --steps 8 --warmup 3
gpt PYTORCH_ALLOC_CONF=expandable_segments:True -- --batch 44 --steps 8 --warmup 3
gpt -- --batch 44 --steps 8 --warmup 3
date -u | tee -a "$log"
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/nvidia/lib64:$TL:${LD_LIBRARY_PATH:-}
run() { echo "=== $*" | tee -a "$log"; timeout 120 "$@" 2>&1 | grep -E "RESULT|rror|panick" | cut -c1-500 | tee -a "$log"; }
for b in 24 27 28; do
  run ./candle_gpt frag --batch $b --steps 6 --allocator pool --release-threshold 18446744073709551615
  run env OOMGUARD_ALLOC_CONF=expandable_segments:False ./candle_gpt frag --batch $b --steps 6 --allocator oomguard
  run ./candle_gpt frag --batch $b --steps 6 --allocator oomguard
done
date -u | tee -a "$log"
