#!/usr/bin/env bash
# issue 31: the smallest memory limit on which candle_llm's 200 requests run (default allocator)
cd "$(dirname "$0")/bin"; for f in *.xz; do [ -e "$f" ] && xz -d -k -f "$f" && rm -f "$f"; done
chmod +x ./* 2>/dev/null
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
log=${OUT:-/tmp}/e-log.txt; : > "$log"
used=23292883456   # peak used of the unconstrained default run (runs 24 and 27: the same bytes)
total=$(python3 -c "import torch; print(torch.cuda.mem_get_info()[1])")
echo "CUDA total $total B" | tee -a "$log"
for f in 1.005 1.0025 1.001; do
  frac=$(python3 -c "print(f'{$f*$used/$total:.6f}')")
  echo "=== limit $f x peak used: fraction $frac" | tee -a "$log"
  timeout 150 env OOMGUARD_ALLOC_CONF=per_process_memory_fraction:$frac ./example-candle_llm serve --requests 200 --allocator oomguard 2>&1 | grep -E "RESULT serve|rror|panick" | tee -a "$log"
done
