#!/usr/bin/env bash
# issue 39 item 7, run H (an H100): the seeded loop on our own examples. VGG-16 (tch_convnet,
# release) under oomguard's allocator and under expandable segments: find_max_batch_train, then
# 20 train_steps at 2 x the batch found from a seeded engine; candle_gpt (debug build, the
# driver's pool): the same (phase seeded).
cd "$(dirname "$0")/bin"; out=${OUT:-/tmp}
for f in *.xz; do [ -e "$f" ] && xz -d -f "$f"; done; chmod +x * 2>/dev/null
TL=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))')
log=$out/run-h.txt; : > "$log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$log"
date -u | tee -a "$log"
echo "=== candle_gpt seeded --factor 2 --steps 20" | tee -a "$log"
LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/nvidia/lib64:$TL timeout 280 ./candle_gpt seeded --factor 2 --steps 20 2>&1 | grep -E "^(RESULT|SEEDED|Error)|rror" | cut -c1-600 | tee -a "$log"
export LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-}
conv() { # ENV... -- ARGS
  local envs=(); while [ "$1" != -- ]; do envs+=("$1"); shift; done; shift
  echo "=== ${envs[*]} $*" | tee -a "$log"
  env -u PYTORCH_ALLOC_CONF -u PYTORCH_CUDA_ALLOC_CONF "${envs[@]}" timeout 250 ./tch_convnet "$@" 2>&1 | grep -E "^(RESULT|SEEDED)|tch_convnet:" | cut -c1-600 | tee -a "$log"
}
conv -- --allocator oomguard --batch 128 --steps 20 --seeded 2 --max 256..1536
conv PYTORCH_ALLOC_CONF=expandable_segments:True -- --batch 128 --steps 20 --seeded 2 --max 256..1536
grep -c "^RESULT" "$log"
