#!/usr/bin/env bash
# Run 38-A (H200), 2026-11-29 (seventh session): the suites staged by `stage.sh suites` after
# OomError's memory limit (fragmentation under a limit, the new root test
# `an_oom_at_the_memory_limit_with_room_in_holes_is_fragmentation`) and BudgetExceeded's
# opened_at. candle's suites are not staged (no change reaches its hook).
. "$(dirname "$0")/prelude.sh" 38a "${1:-suites}"
suites test-gpu test-pool_gpu test-retry_gpu tchtest-allocator_gpu tchtest-finder_gpu \
  tchtest-source_gpu tchtest-oom_texts_gpu
grep -E "^(6|9) MiB:" "$out/test-gpu.txt" | cut -c1-400 | tee -a "$log"
date -u | tee -a "$log"
