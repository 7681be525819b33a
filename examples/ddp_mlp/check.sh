#!/usr/bin/env bash
# The data-parallel checks of examples/ddp_mlp on two GPUs of one host (issue 19): one process per
# GPU under torchrun, a rank killed mid-run, the threaded form. Prints one PASS/FAIL line per check
# and a summary; every run is bounded by `timeout`, the whole script by 7 minutes (a check that
# would start past that is reported as FAIL, skipped).
#
# Build here:   ../shared/gpu/stage --features nccl --example ddp_mlp --release
# Run there:    bash examples/ddp_mlp/check.sh          (device tool, carry [".gpu"])
# Logs:         $OUT/ddp-check.log (this output) and $OUT/ddp-runs.tar.gz (each run's full log)
#
# Environment: DDP_MLP (the binary; default .gpu/bin/example-ddp_mlp), OUT (log folder).
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=${DDP_MLP:-$root/.gpu/bin/example-ddp_mlp}
dest=${OUT:-$(mktemp -d)}
out=$(mktemp -d)
mkdir -p "$dest"
exec > >(tee "$dest/ddp-check.log") 2>&1
# NVLink multicast stays off on these machines (it can take the host's GPUs out of service).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

results=()
deadline=$((SECONDS + ${DDP_CHECK_SECONDS:-420}))
cap() { # cap N: N seconds, or what is left before the deadline if less (at least 1)
  local left=$((deadline - SECONDS - 5)); [ $left -lt 1 ] && left=1
  [ "$1" -lt $left ] && echo "$1" || echo $left
}
time_left() { [ $((deadline - SECONDS)) -gt "$1" ]; }
# A rank whose partner failed early waits at most this long in the rendezvous.
export OOMGUARD_RENDEZVOUS_TIMEOUT=30
verdict() { # verdict NAME OK(0/1) DETAIL
  local word=FAIL; [ "$2" = 0 ] && word=PASS
  results+=("$word: $1 — $3"); echo "$word: $1 — $3"
}
now() { date +%s.%N; }
stop() { # stop PID...: SIGKILL each `timeout` job of this script still running, and its rank
  local p running=" $(jobs -p | tr '\n' ' ') "
  for p in "$@"; do
    case "$running" in *" $p "*) ;; *) continue;; esac
    kill -KILL $(pgrep -P "$p" 2>/dev/null || cat /proc/"$p"/task/*/children 2>/dev/null) "$p" 2>/dev/null
    wait "$p" 2>/dev/null
  done
}
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }

echo "== machine"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
[ -x "$bin" ] || { echo "FAIL: setup — no binary at $bin (stage it first)"; exit 1; }
if command -v torchrun >/dev/null; then torchrun=(torchrun); else torchrun=(python3 -m torch.distributed.run); fi
python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count())'
# cudarc loads NCCL as libnccl.so: when only pip's libnccl.so.2 is there, link it.
have_nccl() {
  ldconfig -p 2>/dev/null | grep -q 'libnccl\.so ' && return 0
  local d; local IFS=:
  for d in ${LD_LIBRARY_PATH:-}; do [ -e "$d/libnccl.so" ] && return 0; done
  return 1
}
if ! have_nccl; then
  so=$(python3 -c '
import glob, os
try:
    import nvidia
    hits = [h for p in nvidia.__path__ for h in glob.glob(os.path.join(p, "**", "libnccl.so.2"), recursive=True)]
    print(sorted(hits)[0] if hits else "")
except Exception:
    print("")' 2>/dev/null)
  [ -n "$so" ] || so=$(timeout 20 find / -xdev -name 'libnccl.so.2' 2>/dev/null | head -1)
  if [ -n "$so" ]; then
    mkdir -p /tmp/ddp-nccl && ln -sf "$so" /tmp/ddp-nccl/libnccl.so
    export LD_LIBRARY_PATH=/tmp/ddp-nccl${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    echo "libnccl.so -> $so"
  fi
fi
args=(--steps 5 --budget-rank1 64MiB)

echo; echo "== (a) torchrun, 2 processes, a 64 MiB budget on rank 1 only"
log=$out/ddp-a-torchrun.log
timeout "$(cap 150)" "${torchrun[@]}" --standalone --nproc-per-node 2 --no-python "$bin" "${args[@]}" >"$log" 2>&1
rc=$?
cat "$log"
oks=$(grep -c 'ok: every rank ran the same plans' "$log")
rel=$(grep -o 'relative difference [0-9.e+-]*' "$log" | tail -1)
if [ $rc = 0 ] && [ "$oks" = 2 ] && grep -q 'bit-identical' "$log" && grep -q 'rank 1 had [1-9]' "$log"; then
  verdict "(a) torchrun" 0 "both ranks agreed on the plans after rank 1's OOMs, parameters bit-identical, vs single GPU: $rel"
else
  verdict "(a) torchrun" 1 "exit $rc, $oks of 2 ranks ok (log above; ddp-runs.tar.gz)"
fi

# (b): both ranks started by hand with the launcher's variables, so no launcher stops rank 0 for
# us (torchrun would: see (b3)). Rank 0 must end by itself, with an error naming rank 1.
launch_pair() { # launch_pair TAG EXTRA-ARGS...: starts rank 0 and rank 1, sets p0 p1 l0 l1
  local tag=$1; shift
  local port=$((20000 + RANDOM % 20000))
  l0=$out/ddp-$tag-rank0.log; l1=$out/ddp-$tag-rank1.log
  env RANK=0 LOCAL_RANK=0 WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    timeout "$(cap 150)" "$bin" "$@" >"$l0" 2>&1 &
  p0=$!
  env RANK=1 LOCAL_RANK=1 WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    timeout "$(cap 150)" "$bin" "$@" >"$l1" 2>&1 &
  p1=$!
}
wait_pid() { # wait_pid PID SECONDS: waits for a child at most SECONDS; 0 if it ended
  local i
  for i in $(seq $(($2 * 10))); do kill -0 "$1" 2>/dev/null || { wait "$1" 2>/dev/null; return 0; }; sleep 0.1; done
  return 1
}
judge_rank0() { # judge_rank0 NAME T_DEATH: waits up to 75 s for rank 0, then judges
  local name=$1 t1=$2 i rc0 dt
  for i in $(seq 750); do kill -0 "$p0" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$p0" 2>/dev/null; then
    stop "$p0"
    echo "--- rank 0"; tail -20 "$l0"; echo "--- rank 1"; tail -20 "$l1"
    verdict "$name" 1 "rank 0 still running 75 s after rank 1 died (killed it)"
    return
  fi
  wait "$p0"; rc0=$?; dt=$(secs "$t1" "$(now)")
  echo "--- rank 0 (exit $rc0), last lines"; tail -6 "$l0"; echo "--- rank 1, last lines"; tail -4 "$l1"
  local why; why=$(grep -m1 'ddp_mlp: ' "$l0")
  if [ "$rc0" != 0 ] && [ "$rc0" != 124 ] && awk -v d="$dt" 'BEGIN { exit !(d < 60) }' \
    && grep -Eq 'rank 1|another rank failed|NCCL reported|did not complete' <<<"$why"; then
    verdict "$name" 0 "rank 0 exited $rc0 ${dt} s after rank 1 died: ${why#ddp_mlp: }"
  else
    verdict "$name" 1 "rank 0 exit $rc0 after ${dt} s; message: ${why:-none}"
  fi
}

echo; echo "== (b1) kill -9 rank 1 from the shell mid-run (step 20 of 3000)"
time_left 100 || verdict "(b1) rank 1 killed (SIGKILL)" 1 "skipped: out of time"
time_left 100 && {
launch_pair b1 --steps 3000 --budget-rank1 64MiB
for i in $(seq 600); do grep -q 'step 20:' "$l1" && break; kill -0 "$p1" 2>/dev/null || break; sleep 0.1; done
if grep -q 'step 20:' "$l1"; then
  # $p1 is `timeout`; the rank is its child.
  kill -KILL $(pgrep -P "$p1" 2>/dev/null || cat /proc/"$p1"/task/*/children 2>/dev/null)
  wait "$p1" 2>/dev/null; t1=$(now)
  judge_rank0 "(b1) rank 1 killed (SIGKILL)" "$t1"
else
  stop "$p0" "$p1"
  echo "--- rank 0"; tail -20 "$l0"; echo "--- rank 1"; tail -20 "$l1"
  verdict "(b1) rank 1 killed (SIGKILL)" 1 "rank 1 never reached step 20"
fi
}

for how in error panic step-error; do
  echo; echo "== (b2-$how) rank 1 fails at step 3 (--die-how $how)"
  name="(b2-$how) rank 1 fails with a non-OOM $how"
  if ! time_left 100; then verdict "$name" 1 "skipped: out of time"; continue; fi
  launch_pair "b2-$how" --steps 3000 --budget-rank1 64MiB --die-at-step 3 --die-how "$how"
  if wait_pid "$p1" 60; then
    judge_rank0 "$name" "$(now)"
  else
    stop "$p0" "$p1"
    echo "--- rank 0"; tail -20 "$l0"; echo "--- rank 1"; tail -20 "$l1"
    verdict "$name" 1 "rank 1 did not end within 60 s"
  fi
done

echo; echo "== (b3) the same under torchrun (its agent stops the other rank itself)"
log=$out/ddp-b3-torchrun.log
t=$(now)
timeout "$(cap 90)" "${torchrun[@]}" --standalone --nproc-per-node 2 --no-python "$bin" --steps 3000 \
  --budget-rank1 64MiB --die-at-step 3 >"$log" 2>&1
rc=$?; dt=$(secs "$t" "$(now)")
tail -25 "$log"
if [ $rc != 0 ] && [ $rc != 124 ] && awk -v d="$dt" 'BEGIN { exit !(d < 60) }' \
  && grep -q 'rank 1\] dying at the start of step 3' "$log"; then
  verdict "(b3) torchrun, rank 1 killed" 0 "torchrun exited $rc after ${dt} s (start included)"
else
  verdict "(b3) torchrun, rank 1 killed" 1 "torchrun exit $rc after ${dt} s (rank 1 reached its death: $(grep -c 'dying at the start' "$log"))"
fi

echo; echo "== (c) the threaded form (one process, one thread per GPU)"
log=$out/ddp-c-threads.log
timeout "$(cap 120)" "$bin" --threads "${args[@]}" >"$log" 2>&1
rc=$?
cat "$log"
if [ $rc = 0 ] && grep -q '^ok: both ranks ran the same plans' "$log"; then
  verdict "(c) threads" 0 "$(grep -o 'relative difference [0-9.e+-]*' "$log" | tail -1)"
else
  verdict "(c) threads" 1 "exit $rc (log above)"
fi

echo; echo "== (c2) threaded, rank 1's thread fails at step 3, collective timeout 10 s"
log=$out/ddp-c2-threads-timeout.log
t=$(now)
timeout "$(cap 90)" "$bin" --threads "${args[@]}" --steps 50 --die-at-step 3 --die-how error \
  --nccl-timeout 10 >"$log" 2>&1
rc=$?; dt=$(secs "$t" "$(now)")
cat "$log"
if [ $rc = 1 ] && grep -Eq 'did not complete within 10.0 s|NCCL reported an error' "$log" \
  && awk -v d="$dt" 'BEGIN { exit !(d < 60) }'; then
  verdict "(c2) threads, timeout" 0 "exit 1 after ${dt} s: $(grep -Eo 'ncclAllReduce: (did not complete within 10.0 s|NCCL reported an error[^;]*)' "$log" | head -1)"
else
  verdict "(c2) threads, timeout" 1 "exit $rc after ${dt} s"
fi

stop $(jobs -p) # nothing started here outlives the script
echo; echo "== summary"
fails=0
for r in "${results[@]}"; do echo "$r"; case "$r" in FAIL*) fails=$((fails + 1));; esac; done
echo "ddp-check: $((${#results[@]} - fails)) passed, $fails failed"
tar -czf "$dest/ddp-runs.tar.gz" -C "$out" . 2>/dev/null
[ $fails = 0 ]
