# Sourced by the run scripts staged beside it in .gpu/ (`. "$(dirname "$0")/prelude.sh" NAME MODE`):
# enters .gpu/bin, unpacks the binaries, puts CUDA's and PyTorch's libraries on the path, opens
# the log $OUT/run-NAME-MODE.txt (`$log`) with the device and the time, and defines `under`.
cd "$(dirname "${BASH_SOURCE[0]}")/bin"; out=${OUT:-/tmp}
for f in *.xz; do [ -e "$f" ] && xz -d -f "$f"; done; chmod +x * 2>/dev/null
TL=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))')
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/nvidia/lib64:$TL:${LD_LIBRARY_PATH:-}
mode=$2; log=$out/run-$1-$mode.txt; : > "$log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$log"
date -u | tee -a "$log"
# under ALLOC SECONDS PROGRAM ARGS...: a libtorch program under oomguard's allocator
# (`--allocator oomguard`), expandable segments or libtorch's native allocator, its result lines
# (and errors) to the log, cut to 600 characters.
under() {
  local al=$1 t=$2 prog=$3; shift 3; echo "=== $prog ($al) $*" | tee -a "$log"
  case $al in
    oomguard) env -u PYTORCH_ALLOC_CONF timeout "$t" "./$prog" --allocator oomguard "$@" ;;
    expandable) PYTORCH_ALLOC_CONF=expandable_segments:True timeout "$t" "./$prog" "$@" ;;
    native) env -u PYTORCH_ALLOC_CONF timeout "$t" "./$prog" "$@" ;;
  esac 2>&1 | grep -E "^(RESULT|STEP|TRIAL|PHASE)|step plans|$prog:|rror|panick" | cut -c1-600 | tee -a "$log"
  date -u +%T | tee -a "$log"
}
# suites TEST...: each staged test binary with its ignored (GPU) tests, one thread; its output to
# $OUT/TEST.txt, its result lines (and failures) to the log.
suites() {
  local t; for t in "$@"; do
    echo "=== $t" | tee -a "$log"
    timeout 150 "./$t" --include-ignored --test-threads=1 > "$out/$t.txt" 2>&1; echo "rc=$?" | tee -a "$log"
    grep -E "^test result|FAILED|panicked" "$out/$t.txt" | head -20 | tee -a "$log"
  done
}
# run COMMAND...: a candle program's RESULT lines (and errors) to the log; `native` and `default`
# run it under oomguard's native mode (fixed segments) or its default (growable segments).
run() { echo "=== $*" | tee -a "$log"; timeout 100 "$@" 2>&1 | grep -E "RESULT|rror|panick" | cut -c1-600 | tee -a "$log"; date -u +%T | tee -a "$log"; }
native() { run env OOMGUARD_ALLOC_CONF=expandable_segments:False "$@" --allocator oomguard; }
default() { run env -u OOMGUARD_ALLOC_CONF "$@" --allocator oomguard; }
