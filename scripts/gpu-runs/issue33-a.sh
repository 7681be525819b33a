#!/usr/bin/env bash
# issue 33, run A: oomguard-tch's tests on a card (classification, libtorch's allocator as a
# memory source, oomguard's allocator under libtorch) and tch_quickstart, against the device's
# own PyTorch 2.11 libraries. Binaries: tch/ debug test binaries, copied into .gpu/bin.
cd "$(dirname "$0")/bin"
log=${OUT:-/tmp}/tch-a.txt; : > "$log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$log"
TL=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))')
export LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-}
python3 -c 'import torch;print("torch", torch.__version__)' | tee -a "$log"
pass=0; fail=0
for t in classify oom_texts_gpu source_no_device source_gpu allocator_cpu allocator_gpu train_step oom_retry_tch; do
  echo "=== $t" | tee -a "$log"
  timeout 240 ./$t --include-ignored --test-threads=1 --nocapture > /tmp/$t.out 2>&1; rc=$?
  grep -E "^test |test result|TEXT|panicked|RESULT" /tmp/$t.out | tee -a "$log"
  [ $rc = 0 ] && pass=$((pass+1)) || { fail=$((fail+1)); tail -40 /tmp/$t.out >> "$log"; }
done
echo "=== tch_quickstart" | tee -a "$log"
timeout 240 ./tch_quickstart > /tmp/q.out 2>&1; rc=$?
grep -vE "^\|" /tmp/q.out | head -30 | tee -a "$log"; grep -E "^\|" /tmp/q.out | head -14 >> "$log"
[ $rc = 0 ] && pass=$((pass+1)) || fail=$((fail+1))
echo "gpu: $pass passed, $fail failed" | tee -a "$log"
