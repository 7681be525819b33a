#!/usr/bin/env bash
# issue 31: candle_gpt at 24, 27, 28 (and 29) under default / native / pool, alternated
cd "$(dirname "$0")/bin"; for f in *.xz; do [ -e "$f" ] && xz -d -k -f "$f"; done
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
log=${OUT:-/tmp}/gpt-log.txt; : > "$log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$log"
run() { echo "=== $*" | tee -a "$log"; timeout 150 "$@" 2>&1 | grep -E "RESULT|rror|panick" | tee -a "$log"; }
for b in 24 27 28; do
  for a in default native pool; do
    case $a in
      default) run ./example-candle_gpt frag --batch $b --steps ${STEPS:-12} --allocator oomguard;;
      native) run env OOMGUARD_ALLOC_CONF=expandable_segments:False ./example-candle_gpt frag --batch $b --steps ${STEPS:-12} --allocator oomguard;;
      pool) run ./example-candle_gpt frag --batch $b --steps ${STEPS:-12} --allocator pool --release-threshold 18446744073709551615;;
    esac
  done
done
run ./example-candle_gpt frag --batch 29 --steps 6 --allocator oomguard
echo done | tee -a "$log"
