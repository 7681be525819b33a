#!/usr/bin/env bash
# issues 37/39, run E (an H100): finder_gpu again (the seed for a larger batch now leaves
# LARGER_BATCH_SHARE); tch_gpt (GPT-2 small, AdamW) at batch 44 under libtorch's native
# allocator, expandable segments and oomguard's (phase alloc: three child processes, each
# timing plain steps at --batch, then the largest batch by bisection).
cd "$(dirname "$0")/bin"; out=${OUT:-/tmp}
for f in *.xz; do [ -e "$f" ] && xz -d -f "$f"; done; chmod +x * 2>/dev/null
TL=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))')
export LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-}
log=$out/run-e.txt; : > "$log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$log"
date -u | tee -a "$log"
echo "=== finder_gpu" | tee -a "$log"
timeout 200 ./finder_gpu --include-ignored --test-threads=1 --nocapture > $out/finder_gpu.txt 2>&1; echo "rc=$?" | tee -a "$log"
grep -E "^test |test result|RESULT|left|right" $out/finder_gpu.txt | tee -a "$log"
echo "=== tch_gpt --phase alloc --batch 44 --steps 5 --warmup 2 --max-cap 64" | tee -a "$log"
timeout 420 ./tch_gpt --phase alloc --batch 44 --steps 5 --warmup 2 --max-cap 64 2>&1 | grep -E "^(RESULT|STEP|PHASE|CONFIG)" | cut -c1-500 | tee -a "$log"
