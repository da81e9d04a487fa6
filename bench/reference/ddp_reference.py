#!/usr/bin/env python3
"""PyTorch's own DDP (Gloo) on the TransformerLM of ddp_bench: the reference dtrain must match.

Run under dtrain-launch (or torchrun), one process per rank:
    dtrain-launch --nproc-per-node 2 -- .venv/bin/python bench/reference/ddp_reference.py
Same step as bench/step_bench.cc: zero_grad -> forward -> cross-entropy -> backward -> AdamW.
Prints one JSON line on rank 0.
    --local   one process, no DDP and no communication: the local step, the limit of data
              parallelism (run it without a launcher)
    --fused   AdamW(fused=True) instead of PyTorch's default (foreach)
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from model import TransformerLM


def main():
    ap = argparse.ArgumentParser()
    for name, default in [("steps", 8), ("warmup", 2), ("d-model", 512), ("layers", 6), ("heads", 8),
                          ("d-ff", 2048), ("seq", 64), ("batch", 4)]:
        ap.add_argument("--" + name, type=int, default=default)
    ap.add_argument("--bucket-cap-mb", type=float, default=25)
    ap.add_argument("--local", action="store_true")
    ap.add_argument("--fused", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if not a.local:
        dist.init_process_group("gloo")
    rank = 0 if a.local else dist.get_rank()
    torch.manual_seed(0)
    vocab = 256
    model = TransformerLM(vocab, a.seq, a.d_model, a.layers, a.heads, a.d_ff)
    ddp = model if a.local else torch.nn.parallel.DistributedDataParallel(
        model, bucket_cap_mb=a.bucket_cap_mb, gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4, **({"fused": True} if a.fused else {}))
    gen = torch.Generator().manual_seed(1234 + rank)
    steps, backwards, optimizer = [], [], []
    for s in range(a.warmup + a.steps):
        x = torch.randint(0, vocab, (a.batch, a.seq), generator=gen)
        y = torch.randint(0, vocab, (a.batch, a.seq), generator=gen)
        if not a.local:
            dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(ddp(x).reshape(-1, vocab), y.reshape(-1))
        tb = time.perf_counter()
        loss.backward()
        te = time.perf_counter()
        opt.step()
        t1 = time.perf_counter()
        if s >= a.warmup:
            steps.append(t1 - t0)
            backwards.append(te - tb)
            optimizer.append(t1 - te)
    if rank == 0:
        print(json.dumps({"impl": "pytorch", "backend": "none" if a.local else "gloo",
                          "strategy": "local" if a.local else "ddp",
                          "optimizer": "fused" if a.fused else "default",
                          "world": 1 if a.local else dist.get_world_size(),
                          "params": sum(p.numel() for p in model.parameters()),
                          "torch": torch.__version__,
                          "median_step_s": statistics.median(steps),
                          "median_backward_s": statistics.median(backwards),
                          "median_optimizer_s": statistics.median(optimizer)}), flush=True)
    if not a.local:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
