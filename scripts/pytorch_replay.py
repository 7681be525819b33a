#!/usr/bin/env python3
"""Replays CSV allocation traces (traces/README.md's format) through PyTorch's CUDA caching
allocator, once natively and once with `expandable_segments:True`, each in its own process, and
prints PyTorch's peak allocated and peak reserved bytes beside the trace's peak live bytes: the
baseline that `oomguard replay` figures are compared with on traces that PyTorch did not record
itself (e.g. those of `oomguard gen`). Needs a CUDA GPU and PyTorch.

    python3 scripts/pytorch_replay.py TRACE.csv [TRACE.csv ...]

Each allocation is a `torch.empty(bytes, dtype=torch.uint8)` on its stream (stream 0: the
default stream; other stream ids get one new stream each), each free drops it.
"""
import json
import os
import subprocess
import sys


def replay(path):
    import torch

    streams = {}
    live = {}
    cur = peak_live = 0
    torch.cuda.init()
    torch.cuda.reset_peak_memory_stats()
    with open(path) as f:
        header = f.readline().strip()
        if header != "op,id,bytes,stream":
            raise SystemExit(f"{path}: not a trace CSV (header {header!r})")
        for line in f:
            op, i, n, s = line.strip().split(",")
            n, s = int(n), int(s)
            if s not in streams:
                streams[s] = torch.cuda.default_stream() if s == 0 else torch.cuda.Stream()
            if op == "a":
                with torch.cuda.stream(streams[s]):
                    live[i] = torch.empty(n, dtype=torch.uint8, device="cuda")
                cur += n
                peak_live = max(peak_live, cur)
            else:
                del live[i]
                cur -= n
    torch.cuda.synchronize()
    return {
        "peak_live": peak_live,
        "peak_allocated": torch.cuda.max_memory_allocated(),
        "peak_reserved": torch.cuda.max_memory_reserved(),
        "reserved_over_live": round(torch.cuda.max_memory_reserved() / max(peak_live, 1), 4),
    }


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(replay(sys.argv[2])))
        return
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    out = {}
    for path in sys.argv[1:]:
        out[path] = {}
        for name, conf in (("native", "expandable_segments:False"), ("expandable_segments", "expandable_segments:True")):
            env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=conf)
            r = subprocess.run([sys.executable, __file__, "--child", path], env=env, capture_output=True, text=True)
            if r.returncode != 0:
                raise SystemExit(f"{path} ({name}): {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")
            out[path][name] = json.loads(r.stdout.strip().splitlines()[-1])
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
