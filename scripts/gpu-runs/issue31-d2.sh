#!/usr/bin/env bash
# issue 31 final code: candle_llm under the three allocators and under 1.02 x its peak used; candle_gpt round 2 (pool first)
cd "$(dirname "$0")/bin"; for f in *.xz; do [ -e "$f" ] && xz -d -k -f "$f" && rm -f "$f"; done
chmod +x ./* 2>/dev/null
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
log=${OUT:-/tmp}/d2-log.txt; : > "$log"
run() { echo "=== $*" | tee -a "$log"; timeout 200 "$@" 2>&1 | grep -E "RESULT|rror|panick" | tee -a "$log"; }
run ./example-candle_llm serve --requests 200 --allocator pool
run env OOMGUARD_ALLOC_CONF=expandable_segments:False ./example-candle_llm serve --requests 200 --allocator oomguard
run ./example-candle_llm serve --requests 200 --allocator oomguard
used=$(grep "RESULT serve: caching" "$log" | tail -1 | sed -E 's/.*peak used ([0-9]+) .*/\1/')
total=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
frac=$(python3 -c "print(round(1.02*$used/($total*1048576), 5))")
echo "limit: 1.02 x $used B = fraction $frac of $total MiB" | tee -a "$log"
run env OOMGUARD_ALLOC_CONF=per_process_memory_fraction:$frac ./example-candle_llm serve --requests 200 --allocator oomguard
for b in 24 27 28; do
  run ./example-candle_gpt frag --batch $b --steps 12 --allocator pool --release-threshold 18446744073709551615
  run ./example-candle_gpt frag --batch $b --steps 12 --allocator oomguard
  run env OOMGUARD_ALLOC_CONF=expandable_segments:False ./example-candle_gpt frag --batch $b --steps 12 --allocator oomguard
done
echo done | tee -a "$log"
