#!/usr/bin/env bash
# issue 37, run W (modes below; `edge` the newest): the device is now an H200 (141 GB) where rounds 1-6 had an H100 (80 GB).
# `suites`: the host, the alloc bench, the GPU suites at main 49ce020 (first run after the step
# plans' fit check). `convnet`: tch_convnet's finder (--seeded 2) under expandable segments and
# oomguard from fresh processes, then plain steps at the batch expandable segments found under
# the three allocators. `rest`: oomguard's finder again (it ran out of time in `convnet`), OOM at 2 x that
# batch from an unseeded engine (expandable, oomguard), tch_gpt at 44 under the three allocators, candle_gpt
# frag at 24 / 27 / 28 under pool / native / default.
cd "$(dirname "$0")/bin"; out=${OUT:-/tmp}
for f in *.xz; do [ -e "$f" ] && xz -d -f "$f"; done; chmod +x * 2>/dev/null
TL=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))')
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/nvidia/lib64:$TL:${LD_LIBRARY_PATH:-}
mode=${1:-suites}; log=$out/run-w-$mode.txt; : > "$log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$log"
date -u | tee -a "$log"
conv() { # ALLOC SECONDS ARGS...
  local al=$1 t=$2; shift 2; echo "=== tch_convnet ($al) $*" | tee -a "$log"
  case $al in
    oomguard) env -u PYTORCH_ALLOC_CONF timeout $t ./tch_convnet --allocator oomguard "$@" ;;
    expandable) PYTORCH_ALLOC_CONF=expandable_segments:True timeout $t ./tch_convnet "$@" ;;
    native) env -u PYTORCH_ALLOC_CONF timeout $t ./tch_convnet "$@" ;;
  esac 2>&1 | grep -E "^(RESULT|SEEDED|FINDER|STEP|OOM)|tch_convnet:|rror|panick" | cut -c1-400 | tee -a "$log"
  date -u +%T | tee -a "$log"
}
suite() { # TEST-BINARIES...: each with the ignored GPU tests, one thread; result lines to the log
  for t in "$@"; do
    [ -e ./$t ] || { echo "=== $t: not staged" | tee -a "$log"; continue; }
    echo "=== $t" | tee -a "$log"
    timeout 150 ./$t --include-ignored --test-threads=1 > $out/$t.txt 2>&1; echo "rc=$?" | tee -a "$log"
    grep -E "^test result|FAILED|panicked" $out/$t.txt | head -20 | tee -a "$log"
  done
}
case $mode in
suites)
  echo "=== host" | tee -a "$log"
  { nproc; grep -m1 'model name' /proc/cpuinfo; cat /sys/fs/cgroup/cpu.max 2>&1; cat /proc/loadavg; } 2>&1 | tee -a "$log"
  echo "=== alloc bench" | tee -a "$log"
  timeout 170 ./alloc > $out/alloc-w.txt 2>&1; echo "rc=$?" | tee -a "$log"
  grep -E "^(Threads|512 B|64 MiB|mixed|workload|Growth)" $out/alloc-w.txt | tee -a "$log"
  echo "=== torch growth by 16 GiB, expandable segments (ms, best of 3)" | tee -a "$log"
  PYTORCH_ALLOC_CONF=expandable_segments:True python3 - <<'PY' 2>&1 | tee -a "$log"
import time, torch
torch.cuda.init(); torch.empty(1, device="cuda"); torch.cuda.synchronize()
take, give = [], []
for _ in range(3):
    t = time.perf_counter(); x = torch.empty(16 << 30, dtype=torch.uint8, device="cuda"); take.append(time.perf_counter() - t)
    del x; t = time.perf_counter(); torch.cuda.empty_cache(); give.append(time.perf_counter() - t)
print(f"torch expandable take {min(take)*1e3:.2f} give {min(give)*1e3:.2f}")
PY
  suite test-gpu test-pool_gpu test-retry_gpu tchtest-allocator_gpu tchtest-finder_gpu tchtest-oom_texts_gpu tchtest-source_gpu candletest-hook_gpu candletest-finder_gpu candletest-models ;;
convnet)
  conv expandable 170 --batch 128 --steps 2 --seeded 2 --max 64..3072
  conv oomguard 170 --batch 128 --steps 2 --seeded 2 --max 64..3072
  B=$(grep -o "RESULT phase=seeded.*" "$log" | head -1 | grep -oE "max_batch=[0-9]+" | cut -d= -f2)
  echo "B=$B" | tee -a "$log"
  for al in oomguard expandable native; do conv $al 50 --batch ${B:-1900} --steps 6 --warmup 3; done ;;
rest)
  B=${2:-1951}
  conv oomguard 250 --batch 128 --steps 2 --seeded 2 --max 64..3072
  conv expandable 100 --batch $B --oom 2 --steps 4
  conv oomguard 100 --batch $B --oom 2 --steps 4
  gpt() { local envs=(); while [ "$1" != -- ]; do envs+=("$1"); shift; done; shift
    echo "=== tch_gpt ${envs[*]} $*" | tee -a "$log"
    env -u PYTORCH_ALLOC_CONF "${envs[@]}" timeout 60 ./tch_gpt --phase plain "$@" 2>&1 | grep -E "^(RESULT)|rror|panick" | cut -c1-500 | tee -a "$log"; }
  for b in 44; do
    gpt -- --allocator oomguard --batch $b --steps 6 --warmup 3
    gpt PYTORCH_ALLOC_CONF=expandable_segments:True -- --batch $b --steps 6 --warmup 3
    gpt -- --batch $b --steps 6 --warmup 3
  done
  run() { echo "=== $*" | tee -a "$log"; timeout 60 "$@" 2>&1 | grep -E "RESULT|rror|panick" | cut -c1-500 | tee -a "$log"; }
  for b in 24 28; do
    run ./candle_gpt frag --batch $b --steps 6 --allocator pool --release-threshold 18446744073709551615
    run env OOMGUARD_ALLOC_CONF=expandable_segments:False ./candle_gpt frag --batch $b --steps 6 --allocator oomguard
    run ./candle_gpt frag --batch $b --steps 6 --allocator oomguard
  done ;;
esac
date -u | tee -a "$log"
# `room` (appended after the first three parts ran): tch_convnet at 128 rows, room to spare,
# under the three allocators, oomguard's with a recorded trace of 3 more steps.
if [ "$mode" = room ]; then
  conv oomguard 90 --batch 128 --steps 6 --warmup 3 --trace $out/tch_vgg16_b128.trace.csv --trace-steps 3
  conv expandable 60 --batch 128 --steps 6 --warmup 3
  conv native 60 --batch 128 --steps 6 --warmup 3
  ls -la $out | tee -a "$log"
fi
# `first`: the same from the first step: 5 steps of tch_convnet at 128 recorded from the start
# (`--steps 0`), to replay the early growth that sets peak reserved.
if [ "$mode" = first ]; then
  conv oomguard 90 --batch 128 --steps 0 --trace $out/tch_vgg16_b128_first.trace.csv --trace-steps 5
fi
# `tight`: the same binaries with OOMGUARD_ALLOC_CONF=page_recycle_threshold:0 (move free pages
# before reserved memory passes its high-water mark; step plans still on): tch_convnet at 128
# (room) and 1,951 (expandable segments' largest), tch_gpt at 44, candle_gpt frag at 24.
if [ "$mode" = tight ]; then
  export OOMGUARD_ALLOC_CONF=page_recycle_threshold:0
  conv oomguard 60 --batch 128 --steps 6 --warmup 3
  conv oomguard 80 --batch 1951 --steps 6 --warmup 3
  echo "=== tch_gpt tight --batch 44" | tee -a "$log"
  timeout 60 ./tch_gpt --phase plain --allocator oomguard --batch 44 --steps 6 --warmup 3 2>&1 | grep -E "^RESULT|rror|panick" | cut -c1-500 | tee -a "$log"
  echo "=== candle_gpt tight frag --batch 24" | tee -a "$log"
  timeout 60 ./candle_gpt frag --batch 24 --steps 6 --allocator oomguard 2>&1 | grep -E "RESULT (frag|remap: after step [05])|rror|panick" | cut -c1-300 | tee -a "$log"
  unset OOMGUARD_ALLOC_CONF
  echo "=== candle_gpt default frag --batch 24 (same run)" | tee -a "$log"
  timeout 60 ./candle_gpt frag --batch 24 --steps 6 --allocator oomguard 2>&1 | grep -E "RESULT frag|rror|panick" | cut -c1-300 | tee -a "$log"
  date -u | tee -a "$log"
fi
# `finder` (509e8ca): the finder alone from fresh processes, no bisection (the default bound is
# now 4,096 rows), expandable segments then oomguard.
if [ "$mode" = finder ]; then
  conv expandable 140 --batch 128 --steps 2 --seeded 2
  conv oomguard 150 --batch 128 --steps 2 --seeded 2
fi
# `handles` (branch handles): 20 MiB physical handles for large maps. The GPU suites that map
# pages, the alloc bench's growth row, then tch_convnet's finder and OOM at 2 x 1,951 under
# oomguard, and candle_gpt frag at 24.
if [ "$mode" = handles ]; then
  suite test-gpu test-pool_gpu tchtest-allocator_gpu candletest-hook_gpu
  echo "=== alloc bench growth" | tee -a "$log"
  timeout 170 ./alloc --single > $out/alloc-h.txt 2>&1; echo "rc=$?" | tee -a "$log"
  grep -E "^(Growth|growth|oomguard|  )" $out/alloc-h.txt | head -20 | tee -a "$log"
  conv oomguard 150 --batch 128 --steps 2 --seeded 2
  conv oomguard 100 --batch 1951 --oom 2 --steps 4
  timeout 60 ./candle_gpt frag --batch 24 --steps 6 --allocator oomguard 2>&1 | grep -E "RESULT frag|rror|panick" | cut -c1-300 | tee -a "$log"
  date -u | tee -a "$log"
fi
# `handles2`: after the page table's coverage walk was mended, the root suites again, then the
# finder and OOM at 2 x 1,951 under expandable segments and oomguard, alternated, same run.
if [ "$mode" = handles2 ]; then
  suite test-gpu test-retry_gpu
  conv expandable 140 --batch 128 --steps 2 --seeded 2
  conv oomguard 150 --batch 128 --steps 2 --seeded 2
  conv expandable 100 --batch 1951 --oom 2 --steps 4
  conv oomguard 100 --batch 1951 --oom 2 --steps 4
  date -u | tee -a "$log"
fi
# `handles3` / `handles4` (branch handles, 20 MiB handles only for growth with room): the suites
# that map pages, tch_convnet plain at 1,951 (expandable segments' largest) alternated two rounds,
# OOM at 2 x 1,951, candle_gpt frag default / native; then (`handles4`) the finders and tch_gpt 44.
if [ "$mode" = handles3 ]; then
  suite test-gpu test-pool_gpu tchtest-allocator_gpu candletest-hook_gpu
  for r in 1 2; do for al in oomguard expandable; do conv $al 60 --batch 1951 --steps 6 --warmup 3; done; done
  conv expandable 100 --batch 1951 --oom 2 --steps 4
  conv oomguard 100 --batch 1951 --oom 2 --steps 4
  for b in 24 28; do
    echo "=== candle_gpt $b native / default" | tee -a "$log"
    OOMGUARD_ALLOC_CONF=expandable_segments:False timeout 60 ./candle_gpt frag --batch $b --steps 6 --allocator oomguard 2>&1 | grep -E "RESULT frag|rror|panick" | cut -c1-300 | tee -a "$log"
    timeout 60 ./candle_gpt frag --batch $b --steps 6 --allocator oomguard 2>&1 | grep -E "RESULT frag|rror|panick" | cut -c1-300 | tee -a "$log"
  done
  date -u | tee -a "$log"
fi
if [ "$mode" = handles4 ]; then
  conv expandable 140 --batch 128 --steps 2 --seeded 2
  conv oomguard 150 --batch 128 --steps 2 --seeded 2
  for al in oomguard expandable; do
    echo "=== tch_gpt $al 44" | tee -a "$log"
    if [ $al = expandable ]; then export PYTORCH_ALLOC_CONF=expandable_segments:True; a=""; else unset PYTORCH_ALLOC_CONF; a="--allocator oomguard"; fi
    timeout 60 ./tch_gpt --phase plain $a --batch 44 --steps 6 --warmup 3 2>&1 | grep -E "^RESULT|rror|panick" | cut -c1-500 | tee -a "$log"
  done
  unset PYTORCH_ALLOC_CONF
  date -u | tee -a "$log"
fi
# `handles5`: 20 MiB handles for every growing map (plans as before): test-gpu, tch_convnet plain
# at 1,951 alternated two rounds, OOM at 2 x 1,951, the finder, tch_gpt 44.
if [ "$mode" = handles5 ]; then
  suite test-gpu
  for r in 1 2; do for al in oomguard expandable; do conv $al 60 --batch 1951 --steps 6 --warmup 3; done; done
  conv oomguard 100 --batch 1951 --oom 2 --steps 4
  conv oomguard 150 --batch 128 --steps 2 --seeded 2
  echo "=== tch_gpt oomguard 44" | tee -a "$log"
  timeout 60 ./tch_gpt --phase plain --allocator oomguard --batch 44 --steps 6 --warmup 3 2>&1 | grep -E "^RESULT|rror|panick" | cut -c1-500 | tee -a "$log"
  echo "=== tch_gpt expandable 44" | tee -a "$log"
  PYTORCH_ALLOC_CONF=expandable_segments:True timeout 60 ./tch_gpt --phase plain --batch 44 --steps 6 --warmup 3 2>&1 | grep -E "^RESULT|rror|panick" | cut -c1-500 | tee -a "$log"
  date -u | tee -a "$log"
fi
# `final` (branch handles at its last commit: 20 MiB handles, at most 1/2048 of the usable
# memory, for every growing map; pages with page_recycle_threshold): the suites, the growth row,
# tch_convnet plain at 1,951 alternated two rounds, OOM at 2 x 1,951, oomguard's finder, candle_gpt
# frag native / default at 24 and 28, tch_gpt 44 oomguard / expandable.
if [ "$mode" = final ]; then
  suite test-gpu test-pool_gpu test-retry_gpu tchtest-allocator_gpu tchtest-oom_texts_gpu candletest-hook_gpu
  echo "=== alloc bench --single" | tee -a "$log"
  timeout 120 ./alloc --single > $out/alloc-final.txt 2>&1; echo "rc=$?" | tee -a "$log"
  grep -E "^Growth" $out/alloc-final.txt | tee -a "$log"
  for r in 1 2; do for al in oomguard expandable; do conv $al 60 --batch 1951 --steps 6 --warmup 3; done; done
  conv oomguard 100 --batch 1951 --oom 2 --steps 4
  conv oomguard 150 --batch 128 --steps 2 --seeded 2
  for b in 24 28; do
    echo "=== candle_gpt $b native / default" | tee -a "$log"
    OOMGUARD_ALLOC_CONF=expandable_segments:False timeout 60 ./candle_gpt frag --batch $b --steps 6 --allocator oomguard 2>&1 | grep -E "RESULT frag|rror|panick" | cut -c1-300 | tee -a "$log"
    timeout 60 ./candle_gpt frag --batch $b --steps 6 --allocator oomguard 2>&1 | grep -E "RESULT frag|rror|panick" | cut -c1-300 | tee -a "$log"
  done
  echo "=== tch_gpt oomguard 44" | tee -a "$log"
  timeout 60 ./tch_gpt --phase plain --allocator oomguard --batch 44 --steps 6 --warmup 3 2>&1 | grep -E "^RESULT|rror|panick" | cut -c1-500 | tee -a "$log"
  echo "=== tch_gpt expandable 44" | tee -a "$log"
  PYTORCH_ALLOC_CONF=expandable_segments:True timeout 60 ./tch_gpt --phase plain --batch 44 --steps 6 --warmup 3 2>&1 | grep -E "^RESULT|rror|panick" | cut -c1-500 | tee -a "$log"
  date -u | tee -a "$log"
fi
# `candle2` (main after the 20 MiB handles): candle_llm serving default / native, candle_gpt frag
# at 24 native / default (a second round after run 84's).
if [ "$mode" = candle2 ]; then
  for conf in "" expandable_segments:False; do
    echo "=== candle_llm serve --requests 200 ${conf:-default}" | tee -a "$log"
    OOMGUARD_ALLOC_CONF=$conf timeout 90 ./candle_llm serve --requests 200 --allocator oomguard 2>&1 | grep -E "RESULT|rror|panick" | cut -c1-300 | tee -a "$log"
  done
  echo "=== candle_gpt 24 native / default" | tee -a "$log"
  OOMGUARD_ALLOC_CONF=expandable_segments:False timeout 40 ./candle_gpt frag --batch 24 --steps 6 --allocator oomguard 2>&1 | grep -E "RESULT frag|rror|panick" | cut -c1-300 | tee -a "$log"
  timeout 40 ./candle_gpt frag --batch 24 --steps 6 --allocator oomguard 2>&1 | grep -E "RESULT frag|rror|panick" | cut -c1-300 | tee -a "$log"
  date -u | tee -a "$log"
fi
# `edge` (main d93ceb4: best fit ranks a free block at the edge of unmapped space as PyTorch does):
# the suites that place blocks, VGG-16 at 128 (room: peak reserved in the timed steps, the fourth
# step's plan timed, as in run 75) under oomguard / expandable in two rounds and native, tch_gpt
# at 44 under the three allocators. `edge2`: VGG-16 at 1,951 (the largest) two rounds, OOM at
# 2 x 1,951 from an unseeded engine under both, the split 4 x 976 timed by hand as plain steps,
# and a recorded trace of three steps at 1,951.
if [ "$mode" = edge ]; then
  suite test-gpu test-pool_gpu tchtest-allocator_gpu candletest-hook_gpu
  for r in 1 2; do for al in oomguard expandable; do
    conv $al 60 --batch 128 --steps 6 --warmup 3
  done; done
  conv native 60 --batch 128 --steps 6 --warmup 3
  for al in oomguard expandable native; do
    echo "=== tch_gpt $al 44" | tee -a "$log"
    a=""; unset PYTORCH_ALLOC_CONF
    [ $al = oomguard ] && a="--allocator oomguard"
    [ $al = expandable ] && export PYTORCH_ALLOC_CONF=expandable_segments:True
    timeout 60 ./tch_gpt --phase plain $a --batch 44 --steps 6 --warmup 3 2>&1 | grep -E "^RESULT|rror|panick" | cut -c1-500 | tee -a "$log"
  done
  unset PYTORCH_ALLOC_CONF
  date -u | tee -a "$log"
fi
if [ "$mode" = edge2 ]; then
  for r in 1 2; do for al in oomguard expandable; do
    conv $al 60 --batch 1951 --steps 6 --warmup 3
  done; done
  conv oomguard 100 --batch 1951 --oom 2 --steps 4
  conv expandable 100 --batch 1951 --oom 2 --steps 4
  conv oomguard 60 --batch 976 --steps 4 --warmup 2
  # three steps at 1,951 after three of warm-up, recorded with each event's thread, to replay
  # why the step plan is refused there
  conv oomguard 90 --batch 1951 --steps 6 --warmup 3 --trace $out/tch_vgg16_b1951.trace.csv --trace-steps 3
  ls -la $out | tee -a "$log"
  date -u | tee -a "$log"
fi
# `edge3`: candle's hook suite, then candle at its largest batches, native / default alternated in two rounds: candle_gpt
# frag at 24 and 28, candle_llm serving 200 requests.
if [ "$mode" = edge3 ]; then
  suite candletest-hook_gpu
  for r in 1 2; do
    for b in 24 28; do for conf in expandable_segments:False ""; do
      echo "=== candle_gpt $b ${conf:-default} (round $r)" | tee -a "$log"
      OOMGUARD_ALLOC_CONF=$conf timeout 40 ./candle_gpt frag --batch $b --steps 6 --allocator oomguard 2>&1 | grep -E "RESULT frag|rror|panick" | cut -c1-300 | tee -a "$log"
    done; done
    for conf in "" expandable_segments:False; do
      echo "=== candle_llm serve --requests 200 ${conf:-default} (round $r)" | tee -a "$log"
      OOMGUARD_ALLOC_CONF=$conf timeout 90 ./candle_llm serve --requests 200 --allocator oomguard 2>&1 | grep -E "RESULT|rror|panick" | cut -c1-300 | tee -a "$log"
    done
  done
  date -u | tee -a "$log"
fi
# `shared` (branch shared-plan: a step too tall for one contiguous layout planned at page
# granularity, each request its own address range over pages mapped twice with cuMemMap): the
# suites that map pages (root gpu with its new shared-plan test), VGG-16 at 1,951 rows under
# oomguard / expandable segments alternated in two rounds (losses printed per step), OOM at
# 2 x 1,951 and the split 4 x 976 by hand, VGG-16 at 128 (room).
if [ "$mode" = shared ]; then
  suite test-gpu test-pool_gpu tchtest-allocator_gpu
  grep -E "shared step plans" $out/test-gpu.txt | tee -a "$log"
  for r in 1 2; do for al in oomguard expandable; do
    conv $al 60 --batch 1951 --steps 6 --warmup 3
  done; done
  conv oomguard 100 --batch 1951 --oom 2 --steps 4
  conv oomguard 60 --batch 976 --steps 4 --warmup 2
  conv oomguard 40 --batch 128 --steps 6 --warmup 3
  date -u | tee -a "$log"
fi
# `shared2`: the branch's last build (the access call shared by maps and aliases): root gpu,
# tch allocator_gpu, VGG-16 at 1,951 under oomguard.
if [ "$mode" = shared2 ]; then
  suite test-gpu tchtest-allocator_gpu
  conv oomguard 60 --batch 1951 --steps 6 --warmup 3
  date -u | tee -a "$log"
fi
