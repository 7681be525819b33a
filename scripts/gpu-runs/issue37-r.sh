#!/usr/bin/env bash
# issue 37, run R (an H100): step plans for room (a repeated marked step with nothing moved gets a
# plan when it leaves <= 98 % of the bytes reserved). VGG-16 (tch_convnet) at 128 rows under
# oomguard (marked plain steps) and expandable segments, alternated, two rounds, 4 warm-up steps
# (the plan comes at the third mark); tch_gpt at 8 under both; tch_gpt at 44 under oomguard; VGG-16
# at 1,099 rows (the edge: the plan for moves) and train_step at 2 x 1,099 under oomguard.
cd "$(dirname "$0")/bin"; out=${OUT:-/tmp}
for f in *.xz; do [ -e "$f" ] && xz -d -f "$f"; done; chmod +x * 2>/dev/null
TL=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))')
export LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-}
log=$out/run-r.txt; : > "$log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$log"
date -u | tee -a "$log"
X=PYTORCH_ALLOC_CONF=expandable_segments:True
gpt() { # ENV... -- ARGS
  local envs=(); while [ "$1" != -- ]; do envs+=("$1"); shift; done; shift
  echo "=== tch_gpt ${envs[*]} $*" | tee -a "$log"
  env -u PYTORCH_ALLOC_CONF -u PYTORCH_CUDA_ALLOC_CONF "${envs[@]}" timeout 90 ./tch_gpt --phase plain "$@" 2>&1 | grep -E "^(RESULT|STEP)|rror|panick" | cut -c1-700 | tee -a "$log"
}
conv() { # ENV... -- ARGS
  local envs=(); while [ "$1" != -- ]; do envs+=("$1"); shift; done; shift
  echo "=== tch_convnet ${envs[*]} $*" | tee -a "$log"
  env -u PYTORCH_ALLOC_CONF -u PYTORCH_CUDA_ALLOC_CONF "${envs[@]}" timeout 150 ./tch_convnet "$@" 2>&1 | grep -E "^(RESULT|OOM|STEP|SEEDED)|tch_convnet:" | cut -c1-700 | tee -a "$log"
}
for round in 1 2; do
  conv -- --allocator oomguard --batch 128 --steps 4 --warmup 4
  conv $X -- --batch 128 --steps 4 --warmup 4
done
gpt -- --allocator oomguard --batch 8 --steps 6 --warmup 4
gpt $X -- --batch 8 --steps 6 --warmup 4
gpt -- --allocator oomguard --batch 44 --steps 6 --warmup 3
conv -- --allocator oomguard --batch 1099 --steps 6 --warmup 2
conv -- --allocator oomguard --batch 1099 --steps 5 --warmup 1 --oom 2
date -u | tee -a "$log"
