#!/usr/bin/env bash
# issue 31: candle_gpt request traces (snap), candle_llm serving under the three allocators and under a limit
cd "$(dirname "$0")/bin"; for f in *.xz; do [ -e "$f" ] && xz -d -k -f "$f"; done
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
log=${OUT:-/tmp}/b-log.txt; : > "$log"
run() { echo "=== $*" | tee -a "$log"; timeout 200 "$@" 2>&1 | grep -E "RESULT|rror|panick" | tee -a "$log"; }
for b in 28 24; do run ./example-candle_gpt snap ${OUT:-/tmp}/gpt$b --batch $b --steps 6 --allocator oomguard; done
rm -f ${OUT:-/tmp}/*.json
run ./example-candle_llm serve --requests 200 --allocator oomguard
run env OOMGUARD_ALLOC_CONF=expandable_segments:False ./example-candle_llm serve --requests 200 --allocator oomguard
run ./example-candle_llm serve --requests 200 --allocator pool
used=$(grep -A0 "RESULT serve: caching" "$log" | head -1 | sed -E 's/.*peak used ([0-9]+) .*/\1/')
total=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
frac=$(python3 -c "print(round(1.02*$used/($total*1048576), 5))")
echo "limit: 1.02 x $used B = fraction $frac of $total MiB" | tee -a "$log"
run env OOMGUARD_ALLOC_CONF=per_process_memory_fraction:$frac ./example-candle_llm serve --requests 200 --allocator oomguard
echo done | tee -a "$log"
