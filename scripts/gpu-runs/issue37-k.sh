#!/usr/bin/env bash
# issue 37, run K (an H100): run J again after the review's mend of the skipped-release
# forecast (fewest new pages of any placement): VGG-16 through train_step at 2 x 1,118 under
# oomguard and expandable segments, then plain steps at 1,000 rows under oomguard (moves per step).
cd "$(dirname "$0")/bin"; out=${OUT:-/tmp}
for f in *.xz; do [ -e "$f" ] && xz -d -f "$f"; done; chmod +x * 2>/dev/null
TL=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))')
export LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-}
log=$out/run-k.txt; : > "$log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$log"
date -u | tee -a "$log"
conv() { # ENV... -- ARGS
  local envs=(); while [ "$1" != -- ]; do envs+=("$1"); shift; done; shift
  echo "=== ${envs[*]} $*" | tee -a "$log"
  env -u PYTORCH_ALLOC_CONF -u PYTORCH_CUDA_ALLOC_CONF "${envs[@]}" timeout 200 ./tch_convnet "$@" 2>&1 | grep -E "^(RESULT|OOM|STEP)|tch_convnet:" | cut -c1-700 | tee -a "$log"
}
conv -- --allocator oomguard --batch 1118 --steps 4 --warmup 1 --oom 2
conv PYTORCH_ALLOC_CONF=expandable_segments:True -- --batch 1118 --steps 4 --warmup 1 --oom 2
conv -- --allocator oomguard --batch 1000 --steps 6 --warmup 2
