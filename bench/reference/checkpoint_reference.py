#!/usr/bin/env python3
"""PyTorch's checkpoints of the same FSDP model as bench/checkpoint_bench.cc: torch.save of the
full state (gathered to rank 0) and torch.distributed.checkpoint's sharded save, over Gloo.

    dtrain-launch --nproc-per-node 2 -- .venv/bin/python bench/reference/checkpoint_reference.py \\
        --dir /tmp/ckpt_bench_pt

The ~19M TransformerLM of model.py, fully_shard per block and the root, AdamW after one step.
Write and read are timed from a barrier to a barrier, median of --reps; a full write gathers
model and optimizer state (get_*_state_dict(full_state_dict=True, cpu_offload=True)) and
torch.save's them on rank 0; a full read torch.load's them on every rank and sets them. Prints
one JSON line per format on rank 0.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import TransformerLM  # noqa: E402


def size_of(path):
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/pytorch_checkpoint_bench")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TransformerLM(256, 64, 512, 6, 8, 2048)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1 + rank)
    x, y = (torch.randint(0, 256, (4, 64), generator=gen) for _ in range(2))
    F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1)).backward()
    opt.step()
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)

    def timed(fn):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    results = []
    # torch.save of the full state, on rank 0.
    path = os.path.join(args.dir, "full.pt")
    if rank == 0:
        shutil.rmtree(args.dir, ignore_errors=True)
        os.makedirs(args.dir)
    dist.barrier()

    def write_full():
        state = {"model": get_model_state_dict(model, options=full),
                 "optim": get_optimizer_state_dict(model, opt, options=full)}
        if rank == 0:
            torch.save(state, path)

    def read_full():
        state = torch.load(path, weights_only=False)
        set_model_state_dict(model, state["model"], options=StateDictOptions(full_state_dict=True))
        set_optimizer_state_dict(model, opt, state["optim"],
                                 options=StateDictOptions(full_state_dict=True))

    w = [timed(write_full) for _ in range(args.reps)]
    r = [timed(read_full) for _ in range(args.reps)]
    results.append(("torch.save (full)", w, r, size_of(path) if rank == 0 else 0))
    # torch.distributed.checkpoint, sharded.
    sharded = os.path.join(args.dir, "dcp")

    def write_dcp():
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=sharded)

    def read_dcp():
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(state, checkpoint_id=sharded)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])

    w = [timed(write_dcp) for _ in range(args.reps)]
    r = [timed(read_dcp) for _ in range(args.reps)]
    results.append(("torch.distributed.checkpoint (sharded)", w, r, size_of(sharded) if rank == 0 else 0))
    if rank == 0:
        for name, w, r, b in results:
            print(json.dumps({"impl": "pytorch", "format": name, "world": dist.get_world_size(),
                              "torch": torch.__version__, "write_s": statistics.median(w),
                              "read_s": statistics.median(r), "bytes": b}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
