#!/usr/bin/env bash
# Run ZA (H200), 2026-11-29 (fourth session), after the hostile passes' fixes: tch's train_step
# refuses batch tensors with autograd history and resets input gradients (an is_leaf and a
# requires_grad read per batch tensor and attempt), the core discards gradients on a panic's
# unwind, the plan memory's file handling, the finder's NothingFits text.
# `suites`: every GPU suite that installs, maps, measures or finds on the card, and tch's
# out-of-memory texts through train_step.
# `loops`: VGG-16 at 1,951 rows under oomguard (gradients, loss, settled steps: 0 moves expected
# after the plan's install, step time against run 115's 1,547-1,558 ms), train_step at 2 × that
# batch (real out-of-memory splits through the changed step), tch_gpt's oom phase.
. "$(dirname "$0")/prelude.sh" za "${1:-suites}"
case $mode in
suites)
  suites test-gpu test-pool_gpu test-retry_gpu tchtest-allocator_gpu tchtest-finder_gpu \
    tchtest-source_gpu tchtest-oom_texts_gpu candletest-hook_gpu candletest-finder_gpu ;;
loops)
  under oomguard 150 tch_convnet --check --batch 1951 --steps 6 --warmup 3
  under oomguard 200 tch_convnet --batch 1951 --oom 2 --steps 4
  under oomguard 240 tch_gpt --phase oom --max 44 ;;
esac
date -u | tee -a "$log"
