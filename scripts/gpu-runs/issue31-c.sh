#!/usr/bin/env bash
# issue 31/32: GPU tests after the merges, the page-move bench, the hook's GPU tests, the candle
# quickstart on the hook, ConvMixer under the three allocators
cd "$(dirname "$0")/bin"; for f in *.xz; do [ -e "$f" ] && xz -d -k -f "$f" && rm -f "$f"; done
chmod +x ./* 2>/dev/null
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
log=${OUT:-/tmp}/c-log.txt; : > "$log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$log"
pass=0; fail=0
# (as run: the exit status is tail's, so the summary line always counted passes; GPU.md run 25
# has the real counts from the test output)
t() { echo "=== $*" | tee -a "$log"; if timeout ${TO:-240} "$@" 2>&1 | tail -n ${TAIL:-60} | tee -a "$log"; then pass=$((pass+1)); else fail=$((fail+1)); echo "FAILED: $*" | tee -a "$log"; fi; }
for b in test-gpu test-retry_gpu test-pool_gpu hook_gpu; do TAIL=40 t ./$b --include-ignored --test-threads=1; done
TAIL=30 t ./bench-page_moves --bench
TAIL=20 t ./example-candle_quickstart
r() { echo "=== $*" | tee -a "$log"; timeout 300 "$@" 2>&1 | grep -E "RESULT|rror|panick" | tee -a "$log"; }
r ./example-candle_convmixer frag --batch 48 --steps 3 --allocator oomguard
r env OOMGUARD_ALLOC_CONF=expandable_segments:False ./example-candle_convmixer frag --batch 48 --steps 3 --allocator oomguard
r ./example-candle_convmixer frag --batch 48 --steps 3 --allocator pool
r ./example-candle_convmixer frag --batch 102 --steps 2 --allocator oomguard
r ./example-candle_convmixer frag --batch 104 --steps 1 --allocator oomguard
echo "gpu: $pass passed, $fail failed" | tee -a "$log"
