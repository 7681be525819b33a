#!/usr/bin/env bash
# issue 37, run I (an H100): where the first step after an OOM goes under oomguard: VGG-16 through
# train_step at 2 x 1,118, the allocator's OOM errors and skipped releases per step beside its
# retries (ooms - skipped = releases that did not serve the request).
cd "$(dirname "$0")/bin"; out=${OUT:-/tmp}
for f in *.xz; do [ -e "$f" ] && xz -d -f "$f"; done; chmod +x * 2>/dev/null
TL=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))')
export LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-}
log=$out/run-i.txt; : > "$log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$log"
date -u | tee -a "$log"
for oom in 2 1.5; do
  echo "=== --allocator oomguard --batch 1118 --steps 3 --oom $oom" | tee -a "$log"
  timeout 200 ./tch_convnet --allocator oomguard --batch 1118 --steps 3 --warmup 1 --oom $oom 2>&1 | grep -E "^(RESULT|OOM)|tch_convnet:" | cut -c1-700 | tee -a "$log"
done
