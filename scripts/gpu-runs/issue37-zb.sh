#!/usr/bin/env bash
# Run ZB (H200), 2026-11-29 (sixth session): issue 37's "Done when" re-measured on one build of
# main, the allocators alternated in one run.
# `tch`: VGG-16 (tch::vision) at 1,951 rows, its largest batch on this card, under oomguard
# (with the gradient and loss check) and expandable segments, two rounds, 4 warm-up steps (the
# shared plan installs at step 4) and 6 timed; tch_gpt (GPT-2 small) at 80 rows, its largest,
# under oomguard and expandable segments, two rounds, and native libtorch once.
# `oom`: OOM at twice the largest batch through train_step, 8 steps, under oomguard and
# expandable segments, each model; the candidate splits timed by hand as plain steps (976 rows
# for VGG-16, 40 rows for tch_gpt; the 1,951- and 80-row steps come from `tch`); candle_gpt frag
# at 24 rows, oomguard's native mode and its default, native / default / default / native.
# `candle`: candle_gpt frag at 27 and 28 rows, native / default / default / native; candle_llm
# serving, 80 requests a process, after one warm-up, native / default / default / native twice.
. "$(dirname "$0")/prelude.sh" zb "${1:-tch}"
case $mode in
tch)
  under oomguard 150 tch_convnet --check --batch 1951 --steps 6 --warmup 4
  under expandable 120 tch_convnet --batch 1951 --steps 6 --warmup 4
  under expandable 120 tch_convnet --batch 1951 --steps 6 --warmup 4
  under oomguard 150 tch_convnet --batch 1951 --steps 6 --warmup 4
  for al in oomguard expandable expandable oomguard; do
    under $al 90 tch_gpt --phase plain --batch 80 --steps 6 --warmup 3
  done
  under native 60 tch_gpt --phase plain --batch 80 --steps 6 --warmup 3 ;;
oom)
  for al in oomguard expandable; do
    under $al 150 tch_convnet --batch 1951 --oom 2 --steps 8
    under $al 60 tch_convnet --batch 976 --steps 4 --warmup 3
    under $al 150 tch_gpt --phase oom --oom-batch 160 --oom-steps 8
    under $al 60 tch_gpt --phase plain --batch 40 --steps 4 --warmup 2
  done
  for c in native default default native; do $c ./candle_gpt frag --batch 24 --steps 6; done ;;
candle)
  for b in 27 28; do for c in native default default native; do
    $c ./candle_gpt frag --batch $b --steps 6
  done; done
  ./candle_llm serve --requests 5 --allocator oomguard > /dev/null 2>&1 # the kernels' JIT, once
  for r in 1 2; do for c in native default default native; do $c ./candle_llm serve --requests 80; done; done ;;
esac
date -u | tee -a "$log"
