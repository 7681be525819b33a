#!/usr/bin/env bash
# issue 39 item 7, run G (an H100): candle's and tch's finder_gpu after the seed leaves room for
# one set of accumulated gradients (FinderReport::accumulation_bytes) and LARGER_BATCH_SHARE is
# 0.85; binaries (debug, stripped, xz) in .gpu/f; then the root tests/gpu.rs that stage gathered.
here="$(cd "$(dirname "$0")" && pwd)"; out=${OUT:-/tmp}
cd "$here/f"
for f in *.xz; do [ -e "$f" ] && xz -d -f "$f"; done; chmod +x * 2>/dev/null
TL=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))')
log=$out/run-g.txt; : > "$log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$log"
date -u | tee -a "$log"
echo "=== candle finder_gpu" | tee -a "$log"
LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/nvidia/lib64:$TL timeout 240 ./candle_finder_gpu --include-ignored --test-threads=1 --nocapture > $out/candle_finder_gpu.txt 2>&1; echo "rc=$?" | tee -a "$log"
grep -E "^test |test result|RESULT|RETRIED|left|right|panicked" $out/candle_finder_gpu.txt | cut -c1-700 | tee -a "$log"
echo "=== tch finder_gpu" | tee -a "$log"
LD_LIBRARY_PATH=$TL timeout 200 ./tch_finder_gpu --include-ignored --test-threads=1 --nocapture > $out/tch_finder_gpu.txt 2>&1; echo "rc=$?" | tee -a "$log"
grep -E "^test |test result|RESULT|left|right" $out/tch_finder_gpu.txt | tee -a "$log"
echo "=== tests/gpu.rs" | tee -a "$log"
bash "$here/run" 2>&1 | grep -E "^test |test result|gpu:|FAILED" | tee -a "$log"
