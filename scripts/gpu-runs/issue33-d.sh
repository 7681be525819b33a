#!/usr/bin/env bash
cd "$(dirname "$0")/bin"; out=${OUT:-/tmp}
for f in *.xz; do [ -e "$f" ] && xz -d -k -f "$f"; done
TL=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))')
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/nvidia/lib64:$TL:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
pass=0; fail=0
for t in *; do
  case $t in *.xz) continue;; esac
  timeout 300 ./$t --include-ignored --test-threads=1 > $out/$t.txt 2>&1; rc=$?
  grep -E "^test .*(ok|FAILED)$|test result|panicked" $out/$t.txt | cut -c1-250
  [ $rc = 0 ] && pass=$((pass+1)) || fail=$((fail+1))
done
echo "gpu: $pass passed, $fail failed"
# the tch step's snapshot (written by source_gpu) in PyTorch's own memory_viz
p=$(ls /tmp/oomguard-tch-gpu-*/tch_step.pickle 2>/dev/null | head -1)
echo "snapshot: $p"
if [ -n "$p" ]; then
  cp "$p" $out/tch_step.pickle
  python3 -m torch.cuda._memory_viz trace_plot "$p" -o $out/tch_step_trace.html && echo "memory_viz trace_plot: ok $(wc -c < $out/tch_step_trace.html) bytes"
  python3 -m torch.cuda._memory_viz segment_plot "$p" -o $out/tch_step_segments.html && echo "memory_viz segment_plot: ok"
  python3 -m torch.cuda._memory_viz stats "$p" 2>&1 | head -8
  python3 -c "import pickle,sys; d=pickle.load(open('$p','rb')); print('keys', sorted(d.keys())); print('segments', len(d['segments']), 'trace entries', sum(len(t) for t in d['device_traces']))"
fi
