#!/usr/bin/env bash
# issue 31/32 final code: GPU test suites, candle_gpt at 24/27/28 under the three allocators (round 1), 29
cd "$(dirname "$0")/bin"; for f in *.xz; do [ -e "$f" ] && xz -d -k -f "$f" && rm -f "$f"; done
chmod +x ./* 2>/dev/null
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
log=${OUT:-/tmp}/d1-log.txt; : > "$log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$log"
for b in test-gpu test-retry_gpu test-pool_gpu hook_gpu; do echo "=== $b" | tee -a "$log"; timeout 200 ./$b --include-ignored --test-threads=1 > /tmp/$b.out 2>&1; echo "exit $?" | tee -a "$log"; grep -E "^test |test result|panicked|^  |RESULT|moved|fresh" /tmp/$b.out | cut -c1-400 | tee -a "$log"; done
run() { echo "=== $*" | tee -a "$log"; timeout 150 "$@" 2>&1 | grep -E "RESULT|rror|panick" | tee -a "$log"; }
for b in 24 27 28; do
  run ./example-candle_gpt frag --batch $b --steps 12 --allocator oomguard
  run env OOMGUARD_ALLOC_CONF=expandable_segments:False ./example-candle_gpt frag --batch $b --steps 12 --allocator oomguard
  run ./example-candle_gpt frag --batch $b --steps 12 --allocator pool --release-threshold 18446744073709551615
done
run ./example-candle_gpt frag --batch 29 --steps 4 --allocator oomguard
echo done | tee -a "$log"
