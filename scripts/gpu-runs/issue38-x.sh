#!/usr/bin/env bash
# issue 38, run X (an H200): after merging the clap harness and the framework crates' shared
# pieces (InstallSite, panic_text, thiserror errors): the install suites (tch allocator_gpu,
# oom_texts_gpu; candle hook_gpu), tch_gpt and candle_gpt through the new argument parser
# (plain at 44 under oomguard and expandable segments; frag at 24 default and native), a bad
# argument, and a closed pipe.
cd "$(dirname "$0")/bin"; out=${OUT:-/tmp}
for f in *.xz; do [ -e "$f" ] && xz -d -f "$f"; done; chmod +x * 2>/dev/null
TL=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))')
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/nvidia/lib64:$TL:${LD_LIBRARY_PATH:-}
log=$out/run-x.txt; : > "$log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$log"
date -u | tee -a "$log"
for t in tchtest-allocator_gpu tchtest-oom_texts_gpu candletest-hook_gpu; do
  echo "=== $t" | tee -a "$log"
  timeout 120 ./$t --include-ignored --test-threads=1 > $out/$t.txt 2>&1; echo "rc=$?" | tee -a "$log"
  grep -E "^test result|FAILED|panicked" $out/$t.txt | head -20 | tee -a "$log"
done
echo "=== tch_gpt oomguard 44" | tee -a "$log"
env -u PYTORCH_ALLOC_CONF timeout 60 ./tch_gpt --phase plain --allocator oomguard --batch 44 --steps 6 --warmup 3 2>&1 | grep -E "^RESULT|rror|panick" | cut -c1-600 | tee -a "$log"
echo "=== tch_gpt expandable 44" | tee -a "$log"
PYTORCH_ALLOC_CONF=expandable_segments:True timeout 60 ./tch_gpt --phase plain --batch 44 --steps 6 --warmup 3 2>&1 | grep -E "^RESULT|rror|panick" | cut -c1-600 | tee -a "$log"
echo "=== tch_gpt bad argument" | tee -a "$log"
./tch_gpt --phase plain --allocator pool 2>&1 | head -3 | tee -a "$log"; echo "rc=${PIPESTATUS[0]}" | tee -a "$log"
echo "=== tch_gpt | head -1 (closed pipe)" | tee -a "$log"
env -u PYTORCH_ALLOC_CONF timeout 60 ./tch_gpt --phase plain --allocator oomguard --batch 8 --steps 2 --warmup 1 2>$out/pipe-err.txt | head -1 | tee -a "$log"; echo "rc=${PIPESTATUS[0]} stderr_lines=$(wc -l < $out/pipe-err.txt)" | tee -a "$log"
for a in "" "OOMGUARD_ALLOC_CONF=expandable_segments:False"; do
  echo "=== candle_gpt frag 24 ${a:-default}" | tee -a "$log"
  env $a timeout 60 ./candle_gpt frag --batch 24 --steps 6 --allocator oomguard 2>&1 | grep -E "RESULT frag|rror|panick" | cut -c1-300 | tee -a "$log"
done
date -u | tee -a "$log"
