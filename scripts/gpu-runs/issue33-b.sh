#!/usr/bin/env bash
# issue 33, run B: oomguard-tch's tests on a card (debug binaries), tch_quickstart, then tch_gpt
# (release) phases given as arguments: `issue33-b.sh tests` or `issue33-b.sh gpt PHASES [ARGS]`.
# Every binary's full output goes to $OUT; the summary line counts exit statuses.
cd "$(dirname "$0")/bin"
out=${OUT:-/tmp}; log=$out/summary.txt
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$log"
TL=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))')
export LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-}
pass=0; fail=0
run() { # name, command...
  local name=$1; shift
  echo "=== $name: $* ($(date -u +%H:%M:%S))" | tee -a "$log"
  timeout ${LIMIT:-300} "$@" > "$out/$name.txt" 2>&1; local rc=$?
  grep -E "^test .*(ok|FAILED)$|test result|TEXT|RESULT|PHASE|loss:|rows fit|parameters changed|^Error|tch_gpt:" "$out/$name.txt" | cut -c1-400 | tee -a "$log"
  echo "--- $name exit $rc" | tee -a "$log"
  [ $rc = 0 ] && pass=$((pass+1)) || fail=$((fail+1))
}
case $1 in
  tests)
    for t in classify oom_texts_gpu source_no_device source_gpu allocator_cpu allocator_gpu train_step oom_retry_tch readme find_max_batch tch_gpt_model; do
      run $t ./$t --include-ignored --test-threads=1 --nocapture
    done
    run tch_quickstart ./tch_quickstart ;;
  gpt)
    shift; phases=$1; shift
    run "gpt-${phases//,/-}" ./tch_gpt --phase "$phases" "$@" ;;
esac
echo "gpu: $pass passed, $fail failed" | tee -a "$log"
