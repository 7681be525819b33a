#!/usr/bin/env bash
# issue 37/39, run A: VGG-16 in tch (tch/examples/tch_convnet) under libtorch's native allocator,
# expandable segments and oomguard's allocator (this build, and e994765's as the baseline: the
# binary tch_convnet_e994765), the largest batch of each, steps at expandable segments' largest
# batch, a trace of oomguard's steps there with each event's thread; then oomguard-tch's GPU
# tests (debug binaries). Binaries: tch/ built here, stripped, xz-compressed into .gpu/bin.
cd "$(dirname "$0")/bin"; out=${OUT:-/tmp}
for f in *.xz; do [ -e "$f" ] && xz -d -f "$f"; done; chmod +x * 2>/dev/null
TL=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))')
export LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-}
log=$out/run-a.txt; : > "$log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$log"
date -u | tee -a "$log"
conv() { # NAME ENV... -- ARGS
  local name=$1; shift; local envs=(); while [ "$1" != -- ]; do envs+=("$1"); shift; done; shift
  echo "=== $name $*" | tee -a "$log"
  env -u PYTORCH_ALLOC_CONF -u PYTORCH_CUDA_ALLOC_CONF "${envs[@]}" timeout 150 ./tch_convnet_$name "$@" 2>&1 | grep -E "^(RESULT|STEP|TRIAL)|rror" | tee -a "$log"
}
pass=0; fail=0
for t in oom_texts_gpu allocator_gpu source_gpu classify train_step find_max_batch finder_gpu readme panic_hook oom_retry_tch; do
  [ -e ./$t ] || continue
  echo "=== $t" | tee -a "$log"
  timeout 240 ./$t --include-ignored --test-threads=1 --nocapture > $out/$t.txt 2>&1; rc=$?
  grep -E "^test |test result|SITE|TEXT|panicked" $out/$t.txt | cut -c1-300 | tee -a "$log"
  [ $rc = 0 ] && pass=$((pass+1)) || { fail=$((fail+1)); tail -30 $out/$t.txt >> "$log"; }
done
# the largest batch of each (two consecutive plain steps, from an emptied cache)
conv new -- --check --batch 128 --steps 6 --warmup 2 --max 256..1536
conv new PYTORCH_ALLOC_CONF=expandable_segments:True -- --batch 128 --steps 6 --warmup 2 --max 256..1536
conv new -- --allocator oomguard --batch 128 --steps 6 --warmup 2 --max 256..1536
conv e994765 -- --allocator oomguard --batch 128 --steps 6 --warmup 2 --max 256..1536
MAXB=$(awk '/^=== new PYTORCH_ALLOC_CONF/{f=1} f&&/phase=max/{sub(/.*max_batch=/,"");sub(/ .*/,"");print;exit}' "$log")
echo "expandable segments' largest batch: $MAXB" | tee -a "$log"
if [ -n "$MAXB" ]; then
  for round in 1 2; do
    conv new PYTORCH_ALLOC_CONF=expandable_segments:True -- --batch $MAXB --steps 6 --warmup 2
    conv new -- --allocator oomguard --batch $MAXB --steps 6 --warmup 2
    conv e994765 -- --allocator oomguard --batch $MAXB --steps 6 --warmup 2
  done
  conv new -- --allocator oomguard --batch $MAXB --steps 1 --warmup 2 --trace $out/tch_vgg16_b$MAXB.trace.csv --trace-steps 3
fi
echo "gpu: $pass passed, $fail failed" | tee -a "$log"
