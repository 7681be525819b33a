#!/usr/bin/env bash
# issue 37, run P (an H100): tch at the largest batch after step plans (e06644c + tch_gpt's plain
# steps marked, with what the source did in each). GPT-2 small in tch (tch_gpt plain) at 44 rows
# under oomguard, expandable segments and native, alternated, two rounds; at 8 rows under oomguard
# and expandable segments (peak reserved with room to spare); VGG-16 (tch_convnet) at 128 rows
# under both; the training finder then 3 seeded steps at 2 x (finder time and trials); train_step
# at 2 x 1,099 (first step, settled steps).
cd "$(dirname "$0")/bin"; out=${OUT:-/tmp}
for f in *.xz; do [ -e "$f" ] && xz -d -f "$f"; done; chmod +x * 2>/dev/null
TL=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))')
export LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-}
log=$out/run-p.txt; : > "$log"
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
  gpt -- --allocator oomguard --batch 44 --steps 8 --warmup 3
  gpt $X -- --batch 44 --steps 8 --warmup 3
  gpt -- --batch 44 --steps 8 --warmup 3
done
gpt -- --allocator oomguard --batch 8 --steps 6 --warmup 3
gpt $X -- --batch 8 --steps 6 --warmup 3
conv -- --allocator oomguard --batch 128 --steps 4 --warmup 2
conv $X -- --batch 128 --steps 4 --warmup 2
conv -- --allocator oomguard --batch 128 --steps 3 --seeded 2 --max 256..1536
conv $X -- --batch 128 --steps 3 --seeded 2 --max 256..1536
conv -- --allocator oomguard --batch 1099 --steps 5 --warmup 1 --oom 2
conv $X -- --batch 1099 --steps 5 --warmup 1 --oom 2
date -u | tee -a "$log"
