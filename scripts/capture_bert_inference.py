#!/usr/bin/env python3
"""Captures a variable-batch BERT-base inference trace on a CUDA GPU with PyTorch (issue 26,
point 14), and PyTorch's own figures for it.

Workload: a BERT-base encoder (12 layers, width 768, 12 heads, feed-forward 3072, vocabulary
30,522, random weights, fp16, eval mode, no grad) serving a seeded list of requests, each with
its own batch (1..64) and padded sequence length (16..512); the pooled output is copied to the
host after each request, as a server returns it. The model is transformers' `BertModel` when
`transformers` is installed, else the same shape built from `torch.nn` (the JSON says which).

    python3 scripts/capture_bert_inference.py OUT_DIR [--requests 200] [--seed 0]

writes OUT_DIR/bert_infer.trace.csv (the CSV format of traces/README.md, from the snapshot's
`alloc` and the first of `free_requested` / `free_completed` per address, as `oomguard`'s
snapshot reader does), OUT_DIR/bert_infer.snapshot.pickle (the snapshot itself, no stack
frames) and OUT_DIR/bert_infer.figures.json (peak allocated and reserved under PyTorch's native
allocator and with `expandable_segments:True`, each in its own process).
"""
import argparse
import json
import os
import pickle
import random
import subprocess
import sys


def build_model(torch):
    try:
        from transformers import BertConfig, BertModel

        cfg = BertConfig()
        cfg.attn_implementation = "sdpa"
        return BertModel(cfg), "transformers BertModel(BertConfig()): bert-base, sdpa attention"
    except Exception:  # not installed, or an incompatible version
        pass
    nn = torch.nn

    class Bert(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(30522, 768)
            self.pos = nn.Embedding(512, 768)
            self.typ = nn.Embedding(2, 768)
            self.norm = nn.LayerNorm(768, eps=1e-12)
            layer = nn.TransformerEncoderLayer(
                768, 12, 3072, dropout=0.1, activation="gelu", batch_first=True, norm_first=False
            )
            self.enc = nn.TransformerEncoder(layer, 12, enable_nested_tensor=False)
            self.pool = nn.Linear(768, 768)

        def forward(self, ids, mask):
            pos = torch.arange(ids.shape[1], device=ids.device)
            x = self.norm(self.tok(ids) + self.pos(pos)[None] + self.typ(torch.zeros_like(ids)))
            x = self.enc(x, src_key_padding_mask=~mask)
            return torch.tanh(self.pool(x[:, 0]))

    return Bert(), "torch.nn BERT-base (TransformerEncoder, 12 layers, 768 wide, 12 heads, ff 3072)"


def requests(n, seed):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        batch = rng.randint(1, 64)
        seq = rng.randint(16, 512)
        lens = [rng.randint(max(1, seq // 2), seq) for _ in range(batch)]
        lens[rng.randrange(batch)] = seq  # the batch is padded to its longest request
        out.append((batch, seq, lens))
    return out


def serve(torch, n, seed, record):
    torch.manual_seed(seed)
    if record:
        torch.cuda.memory._record_memory_history(max_entries=10_000_000, context=None, stacks="python")
    model, kind = build_model(torch)
    model = model.to("cuda", torch.float16).eval()
    with torch.no_grad():
        for batch, seq, lens in requests(n, seed):
            ids = torch.randint(0, 30522, (batch, seq), device="cuda")
            mask = torch.arange(seq, device="cuda")[None, :] < torch.tensor(lens, device="cuda")[:, None]
            if kind.startswith("transformers"):
                out = model(input_ids=ids, attention_mask=mask.long()).pooler_output
            else:
                out = model(ids, mask)
            out.float().cpu()
            del ids, mask, out
    torch.cuda.synchronize()
    figures = {
        "peak_allocated": torch.cuda.max_memory_allocated(),
        "peak_reserved": torch.cuda.max_memory_reserved(),
    }
    figures["reserved_over_allocated"] = round(figures["peak_reserved"] / figures["peak_allocated"], 4)
    snap = torch.cuda.memory._snapshot() if record else None
    return kind, figures, snap


def to_csv(snap):
    lines = ["op,id,bytes,stream"]
    live, requested, next_id = {}, set(), 0
    peak = cur = 0
    for e in next(t for t in snap["device_traces"] if t):
        a = e["action"]
        if a == "alloc":
            requested.discard(e["addr"])
            live[e["addr"]] = (next_id, e["size"])
            lines.append(f"a,{next_id},{e['size']},{e.get('stream', 0)}")
            cur += e["size"]
            peak = max(peak, cur)
            next_id += 1
        elif a in ("free_requested", "free_completed", "free"):
            if a == "free_completed" and e["addr"] in requested:
                requested.discard(e["addr"])
                continue
            if e["addr"] in live:
                i, size = live.pop(e["addr"])
                lines.append(f"f,{i},{size},{e.get('stream', 0)}")
                cur -= size
                if a == "free_requested":
                    requested.add(e["addr"])
    return "\n".join(lines) + "\n", len(lines) - 1, peak


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--child", choices=["native", "expandable"])
    a = p.parse_args()
    import torch

    if a.child:
        kind, figures, _ = serve(torch, a.requests, a.seed, record=False)
        print(json.dumps(figures))
        return
    os.makedirs(a.out, exist_ok=True)
    kind, traced, snap = serve(torch, a.requests, a.seed, record=True)
    with open(os.path.join(a.out, "bert_infer.snapshot.pickle"), "wb") as f:
        pickle.dump(snap, f)
    csv, events, peak_live = to_csv(snap)
    with open(os.path.join(a.out, "bert_infer.trace.csv"), "w") as f:
        f.write(csv)
    result = {
        "captured_with": f"PyTorch {torch.__version__} on one {torch.cuda.get_device_name()}",
        "workload": f"{kind}; fp16, eval, no grad; {a.requests} requests (seed {a.seed}), batch 1..64, padded sequence 16..512, pooled output copied to the host",
        "trace_events": events,
        "peak_live_bytes": peak_live,
        "traced_run_native": traced,
    }
    for child, conf in (("native", "expandable_segments:False"), ("expandable", "expandable_segments:True")):
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=conf)
        out = subprocess.run(
            [sys.executable, __file__, a.out, "--requests", str(a.requests), "--seed", str(a.seed), "--child", child],
            env=env, check=True, capture_output=True, text=True,
        ).stdout
        result[f"pytorch_{'native' if child == 'native' else 'expandable_segments'}"] = json.loads(out.strip().splitlines()[-1])
    with open(os.path.join(a.out, "bert_infer.figures.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
