#!/usr/bin/env bash
# issue 37, run N (an H100 host): the alloc bench's thread table after large blocks park one
# deep per thread (merged back before any large placement); GPT-2 small in tch (tch_gpt) plain
# steps at batch 8 under oomguard (peak reserved against run 35's 16.48 GB) and at 44, its
# largest batch, under oomguard, expandable segments and native.
cd "$(dirname "$0")/bin"; out=${OUT:-/tmp}
for f in *.xz; do [ -e "$f" ] && xz -d -f "$f"; done; chmod +x * 2>/dev/null
TL=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))')
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/nvidia/lib64:$TL:${LD_LIBRARY_PATH:-}
log=$out/run-n.txt; : > "$log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$log"
nproc | tee -a "$log"; date -u | tee -a "$log"
echo "=== alloc bench" | tee -a "$log"
timeout 200 ./alloc 2>&1 | tee -a "$log" | tail -n 60
gpt() { echo "=== $*" | tee -a "$log"; env -u PYTORCH_ALLOC_CONF -u PYTORCH_CUDA_ALLOC_CONF "$@" 2>&1 | grep -E "^RESULT|rror|panick" | cut -c1-600 | tee -a "$log"; }
gpt timeout 120 ./tch_gpt --phase plain --allocator oomguard --batch 8 --steps 20 --warmup 3
for a in oomguard expandable native; do
  case $a in
    oomguard) gpt timeout 150 ./tch_gpt --phase plain --allocator oomguard --batch 44 --steps 10 --warmup 3;;
    expandable) gpt timeout 150 env PYTORCH_ALLOC_CONF=expandable_segments:True ./tch_gpt --phase plain --batch 44 --steps 10 --warmup 3;;
    native) gpt timeout 150 ./tch_gpt --phase plain --batch 44 --steps 10 --warmup 3;;
  esac
done
date -u | tee -a "$log"
