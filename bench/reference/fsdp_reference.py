#!/usr/bin/env python3
"""PyTorch's own FSDP2 (fully_shard over Gloo) on the TransformerLM of bench/reference/model.py.

Two uses, one process per rank under dtrain-launch (or torchrun):

  parity: train from dtrain's initial weights on the same data and write the loss and scale
          trajectory, for tests/parity/fsdp_parity_test.sh to compare with dtrain's
      dtrain-launch --nproc-per-node 2 -- .venv/bin/python bench/reference/fsdp_reference.py \\
          parity --precision bf16 --init DIR/init.pt --out DIR/pytorch.json
          With --runs FILE (a JSON list of {"precision", "clip", "init", "out"}), one launch
          trains each in turn: the test pays for the processes and torch's import once.

  bench:  median step time and peak memory per rank, one JSON line on rank 0
      dtrain-launch --nproc-per-node 2 -- .venv/bin/python bench/reference/fsdp_reference.py \\
          bench --precision bf16 --d-model 512 --layers 6 ...

  capacity: configs/capacity_1_3b.yaml's recipe as PyTorch users write it, for
          bench/capacity_demo.sh: built on the meta device, every block under
          checkpoint_wrapper and fully_shard, to_empty then each rank initializes its shards;
          AdamW(fused=True), clip_grad_norm_(1.0) (--clip 0: none), the GPL-3 bytes; losses and
          peak RSS
      dtrain-launch --nproc-per-node 2 -- .venv/bin/python bench/reference/fsdp_reference.py \
          capacity --layers 26

Every block is fully_shard'ed, then the root (FSDP2's recommended layout, what dtrain's
FULL_SHARD does). Mixed precision: MixedPrecisionPolicy(param_dtype, reduce_dtype) of the
preset; fp16 adds the ShardedGradScaler.
"""
import argparse
import json
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import parity as common  # noqa: E402
from model import TransformerLM  # noqa: E402

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def build(args, vocab, seq, d_model, layers, heads, d_ff):
    model = TransformerLM(vocab, seq, d_model, layers, heads, d_ff)
    dtype = DTYPES[args.precision]
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def parity(args):
    rank = dist.get_rank()
    # Same weights as dtrain's start: load before sharding.
    model = TransformerLM(common.VOCAB, common.SEQ, common.D_MODEL, common.LAYERS, common.HEADS,
                          2 * common.D_MODEL)
    init = torch.load(args.init, weights_only=False)
    missing = model.load_state_dict(init, strict=True)
    assert not missing.missing_keys and not missing.unexpected_keys, missing
    dtype = DTYPES[args.precision]
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=args.fused)
    scaler = ShardedGradScaler(device="cpu", init_scale=args.init_scale,
                               growth_interval=args.growth_interval,
                               enabled=args.precision == "fp16")
    losses, scales, skipped = common.train(model, opt, scaler, args.steps, clip=args.clip)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"impl": "pytorch", "torch": torch.__version__, "precision": args.precision,
                       "loss": losses, "scale": scales, "skipped": skipped}, f)


def tracker(path):
    """dtrain's counting CPU allocator (framework/memory.h), installed in this process."""
    if not path:
        return None
    import ctypes
    lib = ctypes.CDLL(path)
    lib.dtrain_tracked_current_bytes.restype = ctypes.c_longlong
    lib.dtrain_tracked_peak_bytes.restype = ctypes.c_longlong
    lib.dtrain_tracked_install()
    return lib


def bench(args):
    rank = dist.get_rank()
    vocab = 256
    mem = tracker(args.tracker)
    torch.manual_seed(0)
    model = build(args, vocab, args.seq, args.d_model, args.layers, args.heads, args.d_ff)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.fused)
    scaler = ShardedGradScaler(device="cpu", enabled=args.precision == "fp16")
    gen = torch.Generator().manual_seed(1234 + rank)
    steps, opt_s, peak_tracked, steady = [], [], 0.0, 0.0
    for s in range(args.warmup + args.steps):
        x = torch.randint(0, vocab, (args.batch, args.seq), generator=gen)
        y = torch.randint(0, vocab, (args.batch, args.seq), generator=gen)
        dist.barrier()
        if mem:
            now = mem.dtrain_tracked_current_bytes() / 1e6
            mem.dtrain_tracked_reset_peak()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).float().reshape(-1, vocab), y.reshape(-1))
        scaler.scale(loss).backward()
        tb = time.perf_counter()
        scaler.step(opt)
        scaler.update()
        t1 = time.perf_counter()
        if s >= args.warmup:
            steps.append(t1 - t0)
            opt_s.append(t1 - tb)
            if mem:
                steady = max(steady, now)
                peak_tracked = max(peak_tracked, mem.dtrain_tracked_peak_bytes() / 1e6)
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
                         peak_tracked, steady], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(json.dumps({"impl": "pytorch", "strategy": "fsdp2", "precision": args.precision,
                          "backend": "gloo", "world": dist.get_world_size(),
                          "torch": torch.__version__, "fused": args.fused,
                          "median_step_s": statistics.median(steps),
                          "median_optimizer_s": statistics.median(opt_s),
                          "peak_rss_mb": peak[0].item(),
                          "peak_tracked_mb": peak[1].item() if mem else None,
                          "steady_tracked_mb": peak[2].item() if mem else None}), flush=True)


def capacity(args):
    """The largest-model recipe: meta-device build, recompute, fp32 AdamW, 5 steps."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)
    with torch.device("meta"):
        model = TransformerLM(256, args.seq, args.d_model, args.layers, args.heads, args.d_ff)
    n_params = sum(p.numel() for p in model.parameters())
    for i, block in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(block)
        fully_shard(model.blocks[i])
    fully_shard(model)
    model.to_empty(device="cpu")
    residual_std = 0.02 / (2.0 * args.layers) ** 0.5
    with torch.no_grad():  # each rank initializes its own shards (GPT-2's rule)
        for name, p in model.named_parameters():
            local = p.to_local()
            if "ln" in name:
                local.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                local.zero_()
            else:
                local.normal_(0.0, residual_std if ("attn.proj.weight" in name or
                                                    "fc_proj.weight" in name) else 0.02)
    built_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0, fused=True)
    data = torch.frombuffer(bytearray(open(args.corpus, "rb").read()), dtype=torch.uint8).long()
    gen = torch.Generator().manual_seed(1 + rank)
    per_rank = args.batch // world
    for step in range(args.steps):
        t0 = time.perf_counter()
        starts = torch.randint(0, data.numel() - args.seq - 1, (per_rank,), generator=gen)
        x = torch.stack([data[s:s + args.seq] for s in starts.tolist()])
        y = torch.stack([data[s + 1:s + args.seq + 1] for s in starts.tolist()])
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).float().reshape(-1, 256), y.reshape(-1))
        loss.backward()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
        if rank == 0:
            print(f"pytorch step {step + 1}/{args.steps} loss {total.item() / world:.4f} "
                  f"step {time.perf_counter() - t0:.1f} s peak_rss {rss:.0f} MB", flush=True)
    peak = torch.tensor([built_mb, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0],
                        dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(json.dumps({"impl": "pytorch", "mode": "capacity", "torch": torch.__version__,
                          "parameters": n_params, "layers": args.layers, "world": world,
                          "built_peak_rss_mb": peak[0].item(), "peak_rss_mb": peak[1].item()}),
              flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("parity")
    p.add_argument("--precision", choices=DTYPES, default="fp32")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--init")
    p.add_argument("--out")
    p.add_argument("--runs", help="a JSON list of runs, each {precision, clip, init, out}")
    p.add_argument("--init-scale", type=float, default=16777216.0)
    p.add_argument("--growth-interval", type=int, default=4)
    p.add_argument("--fused", action="store_true", help="AdamW(fused=True)")
    p.add_argument("--clip", type=float, default=0.0, help="clip_grad_norm_ to this (0: off)")
    b = sub.add_parser("bench")
    b.add_argument("--precision", choices=DTYPES, default="fp32")
    for name, default in [("steps", 8), ("warmup", 2), ("d-model", 512), ("layers", 6),
                          ("heads", 8), ("d-ff", 2048), ("seq", 64), ("batch", 4)]:
        b.add_argument("--" + name, type=int, default=default)
    b.add_argument("--fused", action="store_true", help="AdamW(fused=True)")
    b.add_argument("--tracker", default="", help="libdtrain_memory.so: count tensor bytes")
    c = sub.add_parser("capacity")
    for name, default in [("steps", 5), ("d-model", 2048), ("layers", 26), ("heads", 16),
                          ("d-ff", 8192), ("seq", 64), ("batch", 2)]:
        c.add_argument("--" + name, type=int, default=default)
    c.add_argument("--corpus", default="/usr/share/common-licenses/GPL-3")
    c.add_argument("--clip", type=float, default=1.0, help="clip_grad_norm_ to this (0: off)")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    if args.mode == "parity" and args.runs:
        with open(args.runs) as f:
            for run in json.load(f):
                parity(argparse.Namespace(**{**vars(args), **run}))
                dist.barrier()
    elif args.mode == "parity" and not (args.init and args.out):
        ap.error("parity needs --init and --out, or --runs")
    else:
        {"parity": parity, "bench": bench, "capacity": capacity}[args.mode](args)
    dist.barrier()
    common.leave()


if __name__ == "__main__":
    main()
