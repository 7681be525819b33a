#!/usr/bin/env bash
# issues 37/39, run D (an H100): finder_gpu (the 2 GiB setup of issue 39 item 7, seeded at 4x);
# VGG-16 (tch_convnet) through train_step at 2 x 1,118 rows under the three allocators, and
# the candidate splits timed by hand as plain steps (1,118 = 2 chunks, 745 = 3, 559 = 4).
cd "$(dirname "$0")/bin"; out=${OUT:-/tmp}
for f in *.xz; do [ -e "$f" ] && xz -d -f "$f"; done; chmod +x * 2>/dev/null
TL=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))')
export LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-}
log=$out/run-d.txt; : > "$log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$log"
date -u | tee -a "$log"
echo "=== finder_gpu" | tee -a "$log"
timeout 200 ./finder_gpu --include-ignored --test-threads=1 --nocapture > $out/finder_gpu.txt 2>&1; echo "rc=$?" | tee -a "$log"
grep -E "^test |test result|RESULT|left|right" $out/finder_gpu.txt | tee -a "$log"
conv() { # ENV... -- ARGS
  local envs=(); while [ "$1" != -- ]; do envs+=("$1"); shift; done; shift
  echo "=== ${envs[*]} $*" | tee -a "$log"
  env -u PYTORCH_ALLOC_CONF -u PYTORCH_CUDA_ALLOC_CONF "${envs[@]}" timeout 170 ./tch_convnet_new "$@" 2>&1 | grep -E "^(RESULT|STEP|OOM)|tch_convnet:" | cut -c1-600 | tee -a "$log"
}
for a in "PYTORCH_ALLOC_CONF=expandable_segments:True --" "-- --allocator oomguard" "--"; do
  conv $a --batch 1118 --steps 10 --warmup 1 --oom 2
done
for b in 745 559; do
  conv PYTORCH_ALLOC_CONF=expandable_segments:True -- --batch $b --steps 5 --warmup 2
  conv -- --allocator oomguard --batch $b --steps 5 --warmup 2
done
grep -c "^RESULT" "$log"
