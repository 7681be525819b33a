#!/usr/bin/env bash
# issues 37/39, run F (an H100): an out-of-memory that no release could cure keeps the cache
# (MemoryStats::num_releases_skipped): VGG-16 (tch_convnet) through train_step at 2 x 1,118 under
# expandable segments and oomguard (first step, settled steps), the largest batch of each (the
# finder's trials and time); tch's finder_gpu; candle's finder_gpu with the seeded loop's
# retries per step and explicit micro-batches (where the 4 x loop stops retrying).
cd "$(dirname "$0")/bin"; out=${OUT:-/tmp}
for f in *.xz; do [ -e "$f" ] && xz -d -f "$f"; done; chmod +x * 2>/dev/null
TL=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))')
log=$out/run-f.txt; : > "$log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$log"
date -u | tee -a "$log"
echo "=== candle finder_gpu" | tee -a "$log"
LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/nvidia/lib64:$TL timeout 240 ./candle_finder_gpu --include-ignored --test-threads=1 --nocapture > $out/candle_finder_gpu.txt 2>&1; echo "rc=$?" | tee -a "$log"
grep -E "^test |test result|RESULT|RETRIED|PROBE|left|right|panicked" $out/candle_finder_gpu.txt | cut -c1-700 | tee -a "$log"
export LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-}
echo "=== tch finder_gpu" | tee -a "$log"
timeout 200 ./tch_finder_gpu --include-ignored --test-threads=1 --nocapture > $out/tch_finder_gpu.txt 2>&1; echo "rc=$?" | tee -a "$log"
grep -E "^test |test result|RESULT|left|right" $out/tch_finder_gpu.txt | tee -a "$log"
conv() { # ENV... -- ARGS
  local envs=(); while [ "$1" != -- ]; do envs+=("$1"); shift; done; shift
  echo "=== ${envs[*]} $*" | tee -a "$log"
  env -u PYTORCH_ALLOC_CONF -u PYTORCH_CUDA_ALLOC_CONF "${envs[@]}" timeout 170 ./tch_convnet "$@" 2>&1 | grep -E "^(RESULT|STEP|OOM|TRIAL)|tch_convnet:" | cut -c1-600 | tee -a "$log"
}
for a in "PYTORCH_ALLOC_CONF=expandable_segments:True --" "-- --allocator oomguard"; do
  conv $a --batch 1118 --steps 10 --warmup 1 --oom 2
done
for a in "PYTORCH_ALLOC_CONF=expandable_segments:True --" "-- --allocator oomguard"; do
  conv $a --batch 128 --steps 3 --warmup 1 --max 256..1536
done
grep -c "^RESULT" "$log"
