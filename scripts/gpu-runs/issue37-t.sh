#!/usr/bin/env bash
# issue 37, run T (an H100): the training finder under oomguard with its verification loop marked
# (tch_convnet --seeded 2 without the harness's own bisection: run S's timed out after it), then
# the alloc bench of this build (alloc-head) and of an experiment with the exact live-bytes count
# turned off (alloc-nolive: its peaks are wrong; it shows what that count costs from 8 threads).
cd "$(dirname "$0")/bin"; out=${OUT:-/tmp}
for f in *.xz; do [ -e "$f" ] && xz -d -f "$f"; done; chmod +x * 2>/dev/null
TL=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))')
log=$out/run-t.txt; : > "$log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$log"
date -u | tee -a "$log"
echo "=== tch_convnet --allocator oomguard --batch 128 --steps 2 --seeded 2" | tee -a "$log"
env -u PYTORCH_ALLOC_CONF LD_LIBRARY_PATH=$TL timeout 200 ./tch_convnet --allocator oomguard --batch 128 --steps 2 --seeded 2 2>&1 | grep -E "^(RESULT|SEEDED|FINDER)|tch_convnet:" | cut -c1-400 | tee -a "$log"
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/nvidia/lib64:$TL:${LD_LIBRARY_PATH:-}
for b in nolive head; do
  echo "=== alloc-$b" | tee -a "$log"
  timeout 150 ./alloc-$b > $out/alloc-$b.txt 2>&1; echo "rc=$?" | tee -a "$log"
  sed -n '/^Threads on/,/^$/p' $out/alloc-$b.txt | grep -E "^(512 B|64 MiB|mixed) +(1|8) " | tee -a "$log"
done
date -u | tee -a "$log"
