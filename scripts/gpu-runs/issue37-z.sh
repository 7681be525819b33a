#!/usr/bin/env bash
# Run Z (H200), 2026-11-29, after the hostile passes' fixes: reading statistics no longer
# merges the parked large block (a71f237), the finder names a step that keeps memory between
# calls (9dbb487), AllocatorConfig::check at every device (f72cbe2).
# `suites`: every GPU suite that installs, maps, measures or finds on the card.
# `loops`: VGG-16 at 1,951 rows under oomguard (gradients, loss, then the settled steps: 0 moves
# expected after the plan's install), and the finders on real frameworks under the kept-memory
# check: tch_convnet's finder over train_step's attempt (oomguard's allocator), tch_gpt's
# finder phase (oomguard's allocator), candle_gpt's finder on the driver's pool.
. "$(dirname "$0")/prelude.sh" z "${1:-suites}"
case $mode in
suites)
  suites test-gpu test-pool_gpu test-retry_gpu tchtest-allocator_gpu tchtest-finder_gpu \
    tchtest-source_gpu candletest-hook_gpu candletest-finder_gpu ;;
loops)
  under oomguard 150 tch_convnet --check --batch 1951 --steps 6 --warmup 3
  under oomguard 240 tch_convnet --seeded 2 --steps 2
  under oomguard 150 tch_gpt --phase finder
  echo "=== candle_gpt --phase find (pool)" | tee -a "$log"
  timeout 200 ./candle_gpt --phase find --allocator pool 2>&1 | grep -E "^(RESULT|PHASE|TRIAL)|rror|panick" | cut -c1-500 | tee -a "$log"
  date -u +%T | tee -a "$log" ;;
esac
date -u | tee -a "$log"
