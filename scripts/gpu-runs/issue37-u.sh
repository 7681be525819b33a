#!/usr/bin/env bash
# issue 37, run U (an H100): part 1: the host the thread table runs on (cores, cgroup CPU quota,
# cpuset, load), then the alloc bench (simulated-device and real-device thread tables), then the
# GPU suites of main after the training-step contract, the parked large block and the room plans
# (root gpu, runtime pool_gpu/retry_gpu, tch allocator_gpu/finder_gpu/oom_texts_gpu/source_gpu,
# candle hook_gpu/finder_gpu/models). Part 2 (`issue37-u.sh finder`): tch_convnet's finder from a
# fresh process under expandable segments and under oomguard, to tell whether the first trial's
# extra 65 MiB at 1 row (run 65) is the allocator's or the first trial's (main before the fix:
# tch_convnet-before), and the finder measuring every trial above its start (tch_convnet).
cd "$(dirname "$0")/bin"; out=${OUT:-/tmp}
for f in *.xz; do [ -e "$f" ] && xz -d -f "$f"; done; chmod +x * 2>/dev/null
TL=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))')
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/nvidia/lib64:$TL:${LD_LIBRARY_PATH:-}
log=$out/run-u-${1:-suites}.txt; : > "$log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$log"
date -u | tee -a "$log"
if [ "${1:-}" = finder ]; then
  # tch_convnet-before: main before the finder measured every trial above the finder's start
  for a in expandable:-before oomguard: expandable:; do
    al=${a%%:*}; bin=./tch_convnet${a#*:}
    echo "=== $bin --seeded 2 ($al, fresh process)" | tee -a "$log"
    if [ $al = oomguard ]; then
      env -u PYTORCH_ALLOC_CONF timeout 140 $bin --allocator oomguard --batch 128 --steps 2 --seeded 2 2>&1 | grep -E "^(RESULT|SEEDED|FINDER)|tch_convnet:" | cut -c1-400 | tee -a "$log"
    else
      PYTORCH_ALLOC_CONF=expandable_segments:True timeout 140 $bin --batch 128 --steps 2 --seeded 2 2>&1 | grep -E "^(RESULT|SEEDED|FINDER)|tch_convnet:" | cut -c1-400 | tee -a "$log"
    fi
    date -u | tee -a "$log"
  done
  exit 0
fi
echo "=== host" | tee -a "$log"
{ nproc; cat /sys/fs/cgroup/cpu.max 2>&1; cat /sys/fs/cgroup/cpuset.cpus.effective 2>&1;
  grep -E 'Cpus_allowed_list' /proc/self/status; grep -c ^processor /proc/cpuinfo;
  grep -m1 'model name' /proc/cpuinfo; cat /proc/loadavg; cat /sys/fs/cgroup/cpu.stat 2>&1 | head -6;
  ps -eo pcpu,pid,comm --sort=-pcpu | head -8; } 2>&1 | tee -a "$log"
echo "=== cpu spin: 1 and 8 processes, 2e7 additions each (wall s)" | tee -a "$log"
for n in 1 8; do python3 - $n <<'PY' 2>&1 | tee -a "$log"
import sys, time, multiprocessing as mp
def spin(_):
    s = 0
    for i in range(20_000_000): s += i
    return s
n = int(sys.argv[1]); t = time.time()
with mp.Pool(n) as p: p.map(spin, range(n))
print(f"processes={n} wall={time.time()-t:.2f}")
PY
done
echo "=== alloc bench" | tee -a "$log"
timeout 170 ./alloc > $out/alloc-u.txt 2>&1; echo "rc=$?" | tee -a "$log"
grep -E "^(Threads|512 B|64 MiB|mixed|workload)" $out/alloc-u.txt | tee -a "$log"
for t in test-gpu test-pool_gpu test-retry_gpu tchtest-allocator_gpu tchtest-finder_gpu tchtest-oom_texts_gpu tchtest-source_gpu candletest-hook_gpu candletest-finder_gpu candletest-models; do
  [ -e ./$t ] || { echo "=== $t: not staged" | tee -a "$log"; continue; }
  echo "=== $t" | tee -a "$log"
  timeout 150 ./$t --include-ignored --test-threads=1 > $out/$t.txt 2>&1; echo "rc=$?" | tee -a "$log"
  grep -E "^test result|FAILED|panicked" $out/$t.txt | head -20 | tee -a "$log"
done
date -u | tee -a "$log"
