#!/usr/bin/env bash
# issue 33, run C: after the thread-cache fix and the fresh-state max. `issue33-c.sh tests`
# (source_gpu, allocator_gpu in full), `issue33-c.sh gpt PHASES [ARGS]`, `issue33-c.sh bench`
# (runtime's alloc bench, thread table). Full outputs go to $OUT/all.txt, one section each.
cd "$(dirname "$0")/bin"
out=${OUT:-/tmp}; all=$out/all.txt
TL=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))')
export LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$all"
pass=0; fail=0
run() { # name, command...
  local name=$1; shift
  echo "=== $name: $* ($(date -u +%H:%M:%S))" | tee -a "$all"
  timeout ${LIMIT:-300} "$@" > /tmp/$name.txt 2>&1; local rc=$?
  cat /tmp/$name.txt >> "$all"
  grep -E "^test .*(ok|FAILED)$|test result|RESULT|PHASE|panicked|^Error|tch_gpt:" /tmp/$name.txt | cut -c1-300
  echo "--- $name exit $rc" | tee -a "$all"
  [ $rc = 0 ] && pass=$((pass+1)) || fail=$((fail+1))
}
case $1 in
  tests)
    for t in source_gpu allocator_gpu; do
      run $t ./$t --include-ignored --test-threads=1 --nocapture
    done ;;
  gpt)
    shift; phases=$1; shift
    run "gpt-${phases//,/-}" ./tch_gpt --phase "$phases" "$@" ;;
  bench)
    run bench-alloc ./bench-alloc --bench ;;
esac
echo "gpu: $pass passed, $fail failed" | tee -a "$all"
