#!/usr/bin/env bash
# issue 37/38, run Y (H200), after the examples' model shape moved into the harness (GptShape).
# `verify`: tch_gpt at 44 rows (plain steps) under oomguard and expandable segments; candle_gpt
# frag at 24 and 28 rows, oomguard's native mode first then the default, two rounds; candle_llm
# serving, one pair in each order. `llm`: more candle_llm pairs, the order alternating (ABBA).
# `main`: main's suites, tch_convnet's check and candle_llm pairs on the card (see the mode).
# `after`: the suites, tch_gpt at 44 and candle_gpt at 24/28 NDDN after a32aebe. `tchstep`:
# tch's train_step on the card after d93fa84 (tch_gpt and VGG-16 OOM at twice their largest).
. "$(dirname "$0")/prelude.sh" y "${1:-verify}"
case $mode in
verify)
  for al in oomguard expandable; do under $al 90 tch_gpt --phase plain --batch 44 --steps 6 --warmup 3; done
  for r in 1 2; do for b in 24 28; do
    native ./candle_gpt frag --batch $b --steps 6
    default ./candle_gpt frag --batch $b --steps 6
  done; done
  native ./candle_llm serve --requests 200
  default ./candle_llm serve --requests 200
  default ./candle_llm serve --requests 200
  native ./candle_llm serve --requests 200 ;;
prof)
  # where candle_llm's time goes under each configuration: CPU time of the whole run (user,
  # system) beside its wall time, ABBA; then, where perf exists, a profile of 60 requests each.
  export TIMEFORMAT="TIME real=%R user=%U sys=%S"
  t() { echo "=== $1 ./candle_llm serve --requests 200" | tee -a "$log"; local e=(env -u OOMGUARD_ALLOC_CONF); [ $1 = native ] && e=(env OOMGUARD_ALLOC_CONF=expandable_segments:False)
    { time "${e[@]}" timeout 100 ./candle_llm serve --requests 200 --allocator oomguard 2>&1 | grep -E "RESULT serve|rror|panick" | cut -c1-300; } 2>&1 | tee -a "$log"; }
  t native; t default; t default; t native
  { command -v perf; command -v nsys; nproc; grep -m1 'model name' /proc/cpuinfo; } 2>&1 | tee -a "$log"
  if command -v perf >/dev/null; then for c in native default; do
    e=(env -u OOMGUARD_ALLOC_CONF); [ $c = native ] && e=(env OOMGUARD_ALLOC_CONF=expandable_segments:False)
    "${e[@]}" timeout 120 perf record -F 499 -g -o $out/perf-$c.data ./candle_llm_sym serve --requests 60 --allocator oomguard 2>&1 | grep -E "RESULT serve" | tee -a "$log"
    echo "=== perf $c" | tee -a "$log"
    perf report -i $out/perf-$c.data --no-children --stdio 2>/dev/null | grep -E "^ +[0-9]" | head -40 | cut -c1-200 | tee -a "$log"
    rm -f $out/perf-$c.data
  done; fi ;;
perf)
  # a flat profile (no call graphs: the binaries keep no frame pointers) of 60 requests under
  # each configuration, with this machine's perf shipped beside the binaries (.gpu/perf).
  P="env LD_LIBRARY_PATH=$PWD/../perf/lib:$LD_LIBRARY_PATH $PWD/../perf/perf"
  $P --version 2>&1 | tee -a "$log"; cat /proc/sys/kernel/perf_event_paranoid 2>&1 | tee -a "$log"
  ./candle_llm_sym serve --requests 5 --allocator oomguard 2>&1 | grep -E "RESULT serve" | tee -a "$log" # the kernels' JIT, once
  for c in native default default native; do
    e=(env -u OOMGUARD_ALLOC_CONF); [ $c = native ] && e=(env OOMGUARD_ALLOC_CONF=expandable_segments:False)
    echo "=== perf $c" | tee -a "$log"
    "${e[@]}" timeout 150 $P record -F 999 -o $out/perf-$c.data ./candle_llm_sym serve --requests 60 --allocator oomguard 2>&1 | grep -E "RESULT serve|rror|perf" | cut -c1-300 | tee -a "$log"
    $P report -i $out/perf-$c.data --no-children --sort dso --stdio 2>&1 | grep -E "^ +[0-9]" | head -15 | cut -c1-200 | tee -a "$log"
    $P report -i $out/perf-$c.data --no-children --sort sym --stdio 2>&1 | grep -E "^ +[0-9]" > $out/syms-$c.txt
    head -25 $out/syms-$c.txt | cut -c1-200 | tee -a "$log"
    echo "--- oomguard's symbols (sum, then the top 25)" | tee -a "$log"
    grep -E "oomguard|parking_lot" $out/syms-$c.txt | awk '{s+=$1} END {print "oomguard+parking_lot total " s "%"}' | tee -a "$log"
    grep -E "oomguard|parking_lot" $out/syms-$c.txt | head -25 | cut -c1-200 | tee -a "$log"
    rm -f $out/perf-$c.data
  done ;;
groups)
  # branch groups-first: a shared step plan maps its pool's 20 MiB handles before its single
  # pages. The suites that map pages, then VGG-16 at 1,951 rows under oomguard (the shared
  # plan's install at step 5), this build against main's (tch_convnet_main), alternated.
  suites test-gpu test-pool_gpu tchtest-allocator_gpu
  for r in 1 2; do for p in tch_convnet tch_convnet_main; do
    echo "=== $p (oomguard) --batch 1951 --steps 6 --warmup 3" | tee -a "$log"
    env -u PYTORCH_ALLOC_CONF timeout 100 ./$p --allocator oomguard --batch 1951 --steps 6 --warmup 3 2>&1 | grep -E "^(RESULT|STEP)|rror|panick" | cut -c1-400 | tee -a "$log"
  done; done ;;
tiles)
  # branch tiles (the CUDA page table's check that runs tile a range, written once): the
  # suites that unmap handles and aliases; then candle_llm serving in the order default /
  # native / native / default (runs 102-105 ran native at both ends).
  suites test-gpu test-pool_gpu tchtest-allocator_gpu candletest-hook_gpu
  ./candle_llm serve --requests 5 --allocator oomguard > /dev/null 2>&1 # the kernels' JIT, once
  default ./candle_llm serve --requests 200
  native ./candle_llm serve --requests 200
  native ./candle_llm serve --requests 200
  default ./candle_llm serve --requests 200 ;;
known)
  # branch known-cap: a contiguous step plan taller than what the device is known to hold is
  # not tried. The suites that map pages; VGG-16 at 1,951 rows under oomguard, this build
  # against main's (tch_convnet_main), alternated, two rounds; OOM at 2 x 1,951, one each.
  suites test-gpu test-pool_gpu tchtest-allocator_gpu
  for r in 1 2; do for p in tch_convnet tch_convnet_main; do
    echo "=== $p (oomguard) --batch 1951 --steps 6 --warmup 3" | tee -a "$log"
    env -u PYTORCH_ALLOC_CONF timeout 100 ./$p --allocator oomguard --batch 1951 --steps 6 --warmup 3 2>&1 | grep -E "^(RESULT|STEP)|rror|panick" | cut -c1-400 | tee -a "$log"
  done; done
  for p in tch_convnet tch_convnet_main; do
    echo "=== $p (oomguard) --batch 1951 --oom 2 --steps 4" | tee -a "$log"
    env -u PYTORCH_ALLOC_CONF timeout 120 ./$p --allocator oomguard --batch 1951 --oom 2 --steps 4 2>&1 | grep -E "^(RESULT|OOM)|rror|panick" | cut -c1-400 | tee -a "$log"
  done ;;
passes)
  # candle_llm's gap to native: the same 100 requests three times in one process, the cache
  # kept, a line per pass (tokens/s and the allocator's driver calls), native / default /
  # default / native after one warm-up. A gap only in pass 1 is the cache's growth; a gap in
  # every pass is in the steps themselves.
  ./candle_llm serve --requests 5 --allocator oomguard > /dev/null 2>&1 # the kernels' JIT, once
  run() { echo "=== $*" | tee -a "$log"; timeout 170 "$@" 2>&1 | grep -E "RESULT|rror|panick" | cut -c1-600 | tee -a "$log"; date -u +%T | tee -a "$log"; }
  for c in native default default native; do $c ./candle_llm serve --requests 100 --passes 3; done ;;
abba)
  # candle_llm serving, 80 requests a process, native / default / default / native four
  # times over (sixteen processes, order balanced), after one warm-up.
  ./candle_llm serve --requests 5 --allocator oomguard > /dev/null 2>&1 # the kernels' JIT, once
  for r in 1 2 3 4; do for c in native default default native; do $c ./candle_llm serve --requests 80; done; done ;;
conv)
  # tch_convnet's counters as one array (the lines' text unchanged): VGG-16 at 1,951 rows
  # under oomguard (the shared plan's install at step 5, as in runs 106 and 108) and under
  # expandable segments (libtorch's counters).
  under oomguard 120 tch_convnet --batch 1951 --steps 6 --warmup 3
  under expandable 120 tch_convnet --batch 1951 --steps 3 --warmup 2 ;;
main)
  # main after the flush of parked lists (120edf2, not yet on a card): the suites that install,
  # map and unmap; tch_convnet's gradient and loss check (every parameter gets a gradient, the
  # loss falls) before VGG-16 at 1,951 rows under oomguard, and expandable segments at the same
  # batch; then candle_llm serving, 80 requests a process, native / default / default / native
  # four times over, after one warm-up.
  suites test-gpu test-pool_gpu tchtest-allocator_gpu candletest-hook_gpu
  under oomguard 150 tch_convnet --check --batch 1951 --steps 6 --warmup 3
  under expandable 120 tch_convnet --batch 1951 --steps 3 --warmup 2
  ./candle_llm serve --requests 5 --allocator oomguard > /dev/null 2>&1 # the kernels' JIT, once
  for r in 1 2 3 4; do for c in native default default native; do $c ./candle_llm serve --requests 80; done; done ;;
after)
  # main after reserve_initial's native segment and the bounded static layouts (a32aebe): the
  # suites; tch_gpt at 44 rows under oomguard and expandable segments; candle_gpt frag at 24
  # and 28 rows, native / default / default / native, three rounds.
  suites test-gpu test-pool_gpu tchtest-allocator_gpu candletest-hook_gpu
  for al in oomguard expandable; do under $al 90 tch_gpt --phase plain --batch 44 --steps 6 --warmup 3; done
  for r in 1 2 3; do for b in 24 28; do for c in native default default native; do
    $c ./candle_gpt frag --batch $b --steps 6
  done; done; done ;;
tchstep)
  # tch's train_step after its detached-loss and nothing-to-train checks (d93fa84): the tch
  # allocator suite; tch_gpt's OOM at 160 rows (twice its largest batch) through train_step,
  # 4 steps, oomguard then expandable segments; VGG-16's OOM at 2 x 1,951 under oomguard.
  suites tchtest-allocator_gpu
  for al in oomguard expandable; do under $al 150 tch_gpt --phase oom --oom-batch 160 --oom-steps 4; done
  under oomguard 150 tch_convnet --batch 1951 --oom 2 --steps 4 ;;
llm)
  for r in 1 2; do
    native ./candle_llm serve --requests 200
    default ./candle_llm serve --requests 200
    default ./candle_llm serve --requests 200
    native ./candle_llm serve --requests 200
  done ;;
esac
date -u | tee -a "$log"
