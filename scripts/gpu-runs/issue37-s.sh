#!/usr/bin/env bash
# issue 37, run S (an H100): the training finder with its verification loop marked (tch_convnet
# --seeded 2, VGG-16, oomguard and expandable segments: each trial and verification run timed);
# then candle at its largest batches: candle_gpt frag at 24, 27, 28 under default / native / pool
# (round $1), and candle_llm serve under default and native; round 2 ends with the alloc bench of
# this build (alloc-head) and of an experiment with the exact live-bytes count turned off
# (alloc-nolive: its peaks are wrong; it shows what that count costs from many threads).
cd "$(dirname "$0")/bin"; out=${OUT:-/tmp}; round=${1:-1}
for f in *.xz; do [ -e "$f" ] && xz -d -f "$f"; done; chmod +x * 2>/dev/null
TL=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))')
log=$out/run-s$round.txt; : > "$log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$log"
date -u | tee -a "$log"
if [ "$round" = 1 ]; then
  conv() { # ENV... -- ARGS
    local envs=(); while [ "$1" != -- ]; do envs+=("$1"); shift; done; shift
    echo "=== tch_convnet ${envs[*]} $*" | tee -a "$log"
    env -u PYTORCH_ALLOC_CONF -u PYTORCH_CUDA_ALLOC_CONF LD_LIBRARY_PATH=$TL "${envs[@]}" timeout 150 ./tch_convnet "$@" 2>&1 | grep -E "^(RESULT|SEEDED|FINDER)|tch_convnet:" | cut -c1-400 | tee -a "$log"
  }
  conv -- --allocator oomguard --batch 128 --steps 2 --seeded 2 --max 256..1536
  conv PYTORCH_ALLOC_CONF=expandable_segments:True -- --batch 128 --steps 2 --seeded 2 --max 256..1536
fi
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/nvidia/lib64:$TL:${LD_LIBRARY_PATH:-}
run() { echo "=== $*" | tee -a "$log"; timeout 120 "$@" 2>&1 | grep -E "RESULT|rror|panick" | cut -c1-500 | tee -a "$log"; }
order="default native pool"; [ "$round" = 2 ] && order="pool native default"
for b in 24 27 28; do
  for a in $order; do
    case $a in
      default) run ./candle_gpt frag --batch $b --steps 6 --allocator oomguard;;
      native) run env OOMGUARD_ALLOC_CONF=expandable_segments:False ./candle_gpt frag --batch $b --steps 6 --allocator oomguard;;
      pool) run ./candle_gpt frag --batch $b --steps 6 --allocator pool --release-threshold 18446744073709551615;;
    esac
  done
done
lorder="default native"; [ "$round" = 2 ] && lorder="native default"
for a in $lorder; do
  case $a in
    default) run ./candle_llm serve --requests 200 --allocator oomguard;;
    native) run env OOMGUARD_ALLOC_CONF=expandable_segments:False ./candle_llm serve --requests 200 --allocator oomguard;;
  esac
done
if [ "$round" = 2 ]; then
  for b in head nolive; do
    echo "=== alloc-$b" | tee -a "$log"
    timeout 170 ./alloc-$b > $out/alloc-$b.txt 2>&1; echo "rc=$?" | tee -a "$log"
  done
fi
date -u | tee -a "$log"
