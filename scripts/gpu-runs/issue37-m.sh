#!/usr/bin/env bash
# issue 37, run M (an H100): step plans installed only from a step that repeats the one before.
# VGG-16 (tch::vision) plain steps at 1,099 rows under oomguard (marked steps) and expandable
# segments, alternated, two rounds; plain steps at 550 rows under both (the 4 x 550 split timed
# by hand); then train_step at 2 x 1,099 under both.
cd "$(dirname "$0")/bin"; out=${OUT:-/tmp}
for f in *.xz; do [ -e "$f" ] && xz -d -f "$f"; done; chmod +x * 2>/dev/null
TL=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))')
export LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-}
log=$out/run-m.txt; : > "$log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$log"
date -u | tee -a "$log"
conv() { # ENV... -- ARGS
  local envs=(); while [ "$1" != -- ]; do envs+=("$1"); shift; done; shift
  echo "=== ${envs[*]} $*" | tee -a "$log"
  env -u PYTORCH_ALLOC_CONF -u PYTORCH_CUDA_ALLOC_CONF "${envs[@]}" timeout 200 ./tch_convnet "$@" 2>&1 | grep -E "^(RESULT|OOM|STEP)|tch_convnet:" | cut -c1-700 | tee -a "$log"
}
X=PYTORCH_ALLOC_CONF=expandable_segments:True
for round in 1 2; do
  conv -- --allocator oomguard --batch 1099 --steps 6 --warmup 2
  conv $X -- --batch 1099 --steps 6 --warmup 2
done
conv -- --allocator oomguard --batch 550 --steps 4 --warmup 2
conv $X -- --batch 550 --steps 4 --warmup 2
conv -- --allocator oomguard --batch 1099 --steps 5 --warmup 1 --oom 2
conv $X -- --batch 1099 --steps 5 --warmup 1 --oom 2
date -u | tee -a "$log"
