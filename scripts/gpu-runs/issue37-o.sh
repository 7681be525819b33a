#!/usr/bin/env bash
# issue 37, run O (an H100 host, GPU hidden): the alloc bench's simulated thread table of the
# build before this session (5dfa691) and after the large-block parking (1b5cb18), alternated.
cd "$(dirname "$0")/bin"; out=${OUT:-/tmp}
for f in *.xz; do [ -e "$f" ] && xz -d -f "$f"; done; chmod +x * 2>/dev/null
log=$out/run-o.txt; : > "$log"; nproc | tee -a "$log"; date -u | tee -a "$log"
for r in 1 2; do for b in before park; do
  echo "=== $b round $r" | tee -a "$log"
  CUDA_VISIBLE_DEVICES= timeout 100 ./alloc-$b 2>&1 | sed -n '/^Threads/,$p' | tee -a "$log" | grep -E "threads|512 B|64 MiB|mixed" | head -20
done; done
date -u | tee -a "$log"
