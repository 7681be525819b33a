#!/usr/bin/env bash
# issue 37, run X (H200): tch_gpt (GPT-2 small, AdamW) at its largest batch. `gptmax`: the true
# largest batch of a plain step (`--phase max`) under expandable segments, oomguard and libtorch's
# native allocator, each a fresh process; then plain steps at expandable segments' largest batch
# under the three allocators, alternated, two rounds (STEP lines: maps, unmaps, syncs per step).
. "$(dirname "$0")/prelude.sh" x "${1:-gptmax}"
gpt() { under "$1" "$2" tch_gpt "${@:3}"; } # ALLOC SECONDS ARGS...
case $mode in
gptmax)
  for al in expandable oomguard; do gpt $al 150 --phase max --max-cap 256; done
  B=${2:-$(grep -A100 "=== tch_gpt (expandable)" "$log" | grep -m1 -oE "RESULT phase=max max_batch=[0-9]+" | grep -oE "[0-9]+$")}
  echo "B=$B" | tee -a "$log"
  for r in 1 2; do for al in oomguard expandable native; do gpt $al 60 --phase plain --batch ${B:-70} --steps 6 --warmup 3; done; done
  gpt native 150 --phase max --max-cap 256 ;;
gptoom)
  # OOM at 2 x 80 (tch_gpt's largest batch under expandable segments and oomguard, run 95) from
  # an unseeded engine, 4 steps; the candidate splits timed by hand as plain steps (80 and 40
  # rows, one optimizer step each) in the same run, under both allocators; then the alloc bench
  # (the thread table's baseline on this host).
  for al in oomguard expandable; do
    gpt $al 120 --phase oom --oom-batch 160
    gpt $al 60 --phase plain --batch 80 --steps 4 --warmup 2
    gpt $al 60 --phase plain --batch 40 --steps 4 --warmup 2
  done
  echo "=== host" | tee -a "$log"
  { nproc; grep -m1 'model name' /proc/cpuinfo; cat /sys/fs/cgroup/cpu.max 2>&1; cat /proc/loadavg; } 2>&1 | tee -a "$log"
  echo "=== alloc bench" | tee -a "$log"
  timeout 200 ./alloc > $out/alloc-x.txt 2>&1; echo "rc=$?" | tee -a "$log"
  grep -E "^(Threads|512 B|1 MiB|64 MiB|mixed|workload|threads|[0-9]+ )" $out/alloc-x.txt | tee -a "$log" ;;
gptoom10)
  # the same OOM, 10 guarded steps, each with what the allocator did (run 96's oomguard step 4
  # took 8.8 s); the splits timed by hand again; alternated, two rounds.
  for r in 1 2; do for al in oomguard expandable; do
    gpt $al 150 --phase oom --oom-batch 160 --oom-steps 10
  done; done
  for al in oomguard expandable; do
    gpt $al 60 --phase plain --batch 80 --steps 4 --warmup 2
    gpt $al 60 --phase plain --batch 40 --steps 4 --warmup 2
  done ;;
handles)
  # branch plan-handles: a step plan's range at the edge maps 20 MiB handles (was 2 MiB pages).
  # The suites that map pages; OOM at 160 rows, 10 steps, oomguard twice and expandable segments
  # once, alternated; VGG-16 at 1,951 rows (the shared plan's path) under oomguard.
  suites test-gpu test-pool_gpu tchtest-allocator_gpu
  gpt oomguard 150 --phase oom --oom-batch 160 --oom-steps 10
  gpt expandable 150 --phase oom --oom-batch 160 --oom-steps 10
  gpt oomguard 150 --phase oom --oom-batch 160 --oom-steps 10
  echo "=== tch_convnet (oomguard) --batch 1951 --steps 6 --warmup 3" | tee -a "$log"
  env -u PYTORCH_ALLOC_CONF timeout 90 ./tch_convnet --allocator oomguard --batch 1951 --steps 6 --warmup 3 2>&1 | grep -E "^(RESULT|STEP)|rror|panick" | cut -c1-400 | tee -a "$log" ;;
candle)
  # after run 98's change (a plan's range at the edge in handles): candle's hook suite, then
  # candle_gpt frag at 24 and 28 and candle_llm serving, the default and native (oomguard without
  # expandable segments) alternated, two rounds.
  echo "=== candletest-hook_gpu" | tee -a "$log"
  timeout 150 ./candletest-hook_gpu --include-ignored --test-threads=1 > $out/hook_gpu.txt 2>&1; echo "rc=$?" | tee -a "$log"
  grep -E "^test result|FAILED|panicked" $out/hook_gpu.txt | head -20 | tee -a "$log"
  run() { echo "=== $*" | tee -a "$log"; timeout 90 "$@" 2>&1 | grep -E "RESULT|rror|panick" | cut -c1-600 | tee -a "$log"; }
  for r in 1 2; do
    for b in 24 28; do
      run ./candle_gpt frag --batch $b --steps 6 --allocator oomguard
      run env OOMGUARD_ALLOC_CONF=expandable_segments:False ./candle_gpt frag --batch $b --steps 6 --allocator oomguard
    done
    run ./candle_llm serve --requests 200 --allocator oomguard
    run env OOMGUARD_ALLOC_CONF=expandable_segments:False ./candle_llm serve --requests 200 --allocator oomguard
  done ;;
llm)
  # candle_llm serving, native first then the default, two rounds (run 99 ran the default first),
  # with each run's memory summary (maps, unmaps, synchronisations).
  for r in 1 2; do for conf in expandable_segments:False default; do
    echo "=== candle_llm serve --requests 200 ($conf)" | tee -a "$log"
    if [ $conf = default ]; then e=(env -u OOMGUARD_ALLOC_CONF); else e=(env OOMGUARD_ALLOC_CONF=$conf); fi
    timeout 90 "${e[@]}" ./candle_llm serve --requests 200 --allocator oomguard 2>&1 | grep -E "RESULT serve|map|unmap|sync|retries|OOM|plans|segments|rror|panick" | cut -c1-300 | tee -a "$log"
  done; done ;;
splits)
  # the oom phase now times the settled split and the next finer one by hand in the same run
  # (TRIAL lines, RESULT settled_over_fastest_split): OOM at 160 rows, 10 steps, both allocators.
  for al in oomguard expandable; do gpt $al 150 --phase oom --oom-batch 160 --oom-steps 10; done ;;
splits2)
  # with the coarser neighbour timed too: expandable segments only (the device time left)
  gpt expandable 120 --phase oom --oom-batch 160 --oom-steps 8 ;;
esac
date -u | tee -a "$log"
