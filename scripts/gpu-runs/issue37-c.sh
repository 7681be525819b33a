#!/usr/bin/env bash
# issue 37, run C: steps only at expandable segments' largest batch of run B (1118 on an H100), and at 1000; VGG-16 in tch (tch/examples/tch_convnet) under libtorch's native allocator,
# expandable segments and oomguard's allocator (this build, and e994765's as the baseline: the
# binary tch_convnet_e994765), the largest batch of each, steps at expandable segments' largest
# batch, a trace of oomguard's steps there with each event's thread; binaries: tch/ built here, stripped, xz-compressed into .gpu/bin.
cd "$(dirname "$0")/bin"; out=${OUT:-/tmp}
for f in *.xz; do [ -e "$f" ] && xz -d -f "$f"; done; chmod +x * 2>/dev/null
TL=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))')
export LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-}
log=$out/run-c.txt; : > "$log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$log"
date -u | tee -a "$log"
conv() { # NAME ENV... -- ARGS
  local name=$1; shift; local envs=(); while [ "$1" != -- ]; do envs+=("$1"); shift; done; shift
  echo "=== $name ${envs[*]} $*" | tee -a "$log"
  env -u PYTORCH_ALLOC_CONF -u PYTORCH_CUDA_ALLOC_CONF "${envs[@]}" timeout 150 ./tch_convnet_$name "$@" 2>&1 | grep -E "^(RESULT|STEP|TRIAL)|rror" | tee -a "$log"
}
MAXB=${1:-1118}
echo "expandable segments' largest batch: $MAXB" | tee -a "$log"
if [ -n "$MAXB" ]; then
  for round in 1 2; do
    conv new PYTORCH_ALLOC_CONF=expandable_segments:True -- --batch $MAXB --steps 6 --warmup 2
    conv new -- --allocator oomguard --batch $MAXB --steps 6 --warmup 2
    conv e994765 -- --allocator oomguard --batch $MAXB --steps 6 --warmup 2
  done
  for b in 1000; do
    conv new PYTORCH_ALLOC_CONF=expandable_segments:True -- --batch $b --steps 6 --warmup 2
    conv new -- --allocator oomguard --batch $b --steps 6 --warmup 2
  done
  conv new -- --allocator oomguard --batch $MAXB --steps 1 --warmup 2 --trace $out/tch_vgg16_b$MAXB.trace.csv --trace-steps 3
fi
grep -c "^RESULT" "$log"
