#!/usr/bin/env bash
# issue 37, run Q (an H100): the GPU suites at e06644c (root tests/gpu.rs, runtime pool_gpu and
# retry_gpu, tch allocator_gpu, finder_gpu, source_gpu), then the alloc bench of e06644c
# (alloc-before) and of the thread-cache change (alloc-after: a cache counts itself once in the
# shared parked-large counter, the exact live-bytes count and its peak on cache lines of their
# own), alternated.
cd "$(dirname "$0")/bin"; out=${OUT:-/tmp}
for f in *.xz; do [ -e "$f" ] && xz -d -f "$f"; done; chmod +x * 2>/dev/null
TL=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))')
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/nvidia/lib64:$TL:${LD_LIBRARY_PATH:-}
log=$out/run-q.txt; : > "$log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$log"
nproc | tee -a "$log"; date -u | tee -a "$log"
for t in test-gpu test-pool_gpu test-retry_gpu tchtest-allocator_gpu tchtest-finder_gpu tchtest-source_gpu; do
  echo "=== $t" | tee -a "$log"
  timeout 240 ./$t --include-ignored --test-threads=1 > $out/$t.txt 2>&1; echo "rc=$?" | tee -a "$log"
  grep -E "^test result|FAILED|panicked" $out/$t.txt | head -20 | tee -a "$log"
done
date -u | tee -a "$log"
for b in before after; do
  echo "=== alloc-$b" | tee -a "$log"
  timeout 170 ./alloc-$b > $out/alloc-$b-$RANDOM.txt 2>&1; echo "rc=$?" | tee -a "$log"
done
date -u | tee -a "$log"
