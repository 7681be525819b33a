#!/usr/bin/env bash
# issue 37, run J (an H100): the first step after an OOM once the engine leaves growable caches
# alone and hopeless releases are skipped: VGG-16 through train_step at 2 x and 1.5 x 1,118 under
# oomguard and expandable segments (same run), then the finder under both.
cd "$(dirname "$0")/bin"; out=${OUT:-/tmp}
for f in *.xz; do [ -e "$f" ] && xz -d -f "$f"; done; chmod +x * 2>/dev/null
TL=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))')
export LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-}
log=$out/run-j.txt; : > "$log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$log"
date -u | tee -a "$log"
conv() { # ENV... -- ARGS
  local envs=(); while [ "$1" != -- ]; do envs+=("$1"); shift; done; shift
  echo "=== ${envs[*]} $*" | tee -a "$log"
  env -u PYTORCH_ALLOC_CONF -u PYTORCH_CUDA_ALLOC_CONF "${envs[@]}" timeout 200 ./tch_convnet "$@" 2>&1 | grep -E "^(RESULT|OOM|TRIAL)|tch_convnet:" | cut -c1-700 | tee -a "$log"
}
for oom in 2 1.5; do
  conv -- --allocator oomguard --batch 1118 --steps 4 --warmup 1 --oom $oom
  conv PYTORCH_ALLOC_CONF=expandable_segments:True -- --batch 1118 --steps 4 --warmup 1 --oom $oom
done
conv -- --allocator oomguard --batch 128 --steps 2 --warmup 1 --max 256..1536
