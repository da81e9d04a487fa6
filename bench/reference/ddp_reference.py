#!/usr/bin/env python3
"""PyTorch's own DDP (Gloo) on the TransformerLM of ddp_bench: the reference dtrain must match.

Run under dtrain-launch (or torchrun), one process per rank:
    dtrain-launch --nproc-per-node 2 -- .venv/bin/python bench/reference/ddp_reference.py
Same step as bench/step_bench.cc: zero_grad -> forward -> cross-entropy -> backward -> AdamW.
Prints one JSON line on rank 0.
    --local   one process, no DDP and no communication: the local step, the limit of data
              parallelism (run it without a launcher)
    --fused   AdamW(fused=True) instead of PyTorch's default (foreach)
    --micro-batches M, --clip C
              gradient accumulation under no_sync() and clip_grad_norm_, as dtrain's trainer
              (bench/perf_check.py times the default job this way)
    --precision bf16|fp16
              the forward and the loss under torch.autocast, DDP's buckets reduced in that
              dtype (as step_bench's), and fp16 with torch.amp.GradScaler

Parity (tests/parity/ddp_parity_test.sh): with --init DIR/init.pt, train the small TransformerLM
of tests/parity/ddp_parity.cc from dtrain's initial weights on the same data, as a PyTorch user
would: DDP (with bf16_compress_hook / fp16_compress_hook for those precisions), the forward
and the loss under torch.autocast, AdamW(fused=True), torch.amp.GradScaler for fp16. Rank 0
then compares the losses, scales and final weights with dtrain's (DIR/dtrain.json,
DIR/final.pt) bit for bit and exits 1 on any difference. --runs FILE (a JSON list of
{"init", "precision"}) does several such runs in one launch. A run with "buffers": true is
ddp_parity.cc --buffers: every rank's buffers after every forward, accumulating under no_sync
with a no_grad forward after each step.
"""
import argparse
import contextlib
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import parity as common
from model import TransformerLM


DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def compress(ddp, dtype):
    """Buckets reduced in `dtype` (fp16_compress_hook, or the same for bf16), as dtrain's DDP
    with reduce_dtype does."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    if dtype == torch.float16:
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif dtype == torch.bfloat16:
        world = dist.get_world_size()

        # DDP refuses bf16_compress_hook by name without NCCL or XCCL: the same hook, renamed.
        def bf16_hook(process_group, bucket):
            buffer = bucket.buffer()
            compressed = buffer.to(torch.bfloat16).div_(world)
            fut = dist.all_reduce(compressed, async_op=True).get_future()

            def decompress(fut):
                buffer.copy_(fut.value()[0])
                return buffer
            return fut.then(decompress)
        ddp.register_comm_hook(None, bf16_hook)


class ScaleWithoutItsGradient(torch.autograd.Function):
    """x * s whose backward gives s no gradient (None), as ddp_parity.cc's."""

    @staticmethod
    def forward(ctx, x, s):
        ctx.save_for_backward(s)
        return x * s

    @staticmethod
    def backward(ctx, g):
        (s,) = ctx.saved_tensors
        return g * s, None


class BufferNet(torch.nn.Module):
    """ddp_parity.cc's --buffers net: buffers every forward changes from its input, in each
    dtype (BatchNorm's fp32 statistics and int64 count, a bf16 running sum)."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.bn = torch.nn.BatchNorm1d(16)
        self.fc2 = torch.nn.Linear(16, 4)
        self.extra = torch.nn.Linear(16, 16)
        self.gate = torch.nn.Parameter(torch.ones(16))
        self.register_buffer("seen", torch.zeros(16, dtype=torch.bfloat16))
        self.fc2.bias.requires_grad_(False)  # frozen: DDP leaves it out

    def forward(self, x, use_extra):
        h = ScaleWithoutItsGradient.apply(self.bn(self.fc1(x)), self.gate)
        if use_extra:
            h = h + self.extra(h)
        with torch.no_grad():
            self.seen.add_(h.detach().sum(0).to(torch.bfloat16))
        return self.fc2(torch.relu(h))


def buffer_batch(k, world, rank):
    """Forward k's inputs and targets on `rank`: the draws of ddp_parity.cc's buffer_batch()."""
    gen = torch.Generator().manual_seed(2000 + k * world + rank)
    x = torch.randn(8, 8, generator=gen)
    y = torch.randn(8, 4, generator=gen)
    return x, y


def parity_buffers(a):
    """ddp_parity.cc --buffers as PyTorch runs it: every rank compares its buffers after each
    forward, rank 0 the final weights too. SGD decays the weights; `gate` never has a gradient
    (with find_unused it keeps none and does not move); fc2.bias is frozen; with find_unused, `extra` takes
    part only in each step's first forward (under no_sync). Returns 1 on any difference on any
    rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = os.path.dirname(os.path.abspath(a.init))
    net = BufferNet()
    keys = net.load_state_dict(torch.load(a.init, weights_only=False), strict=True)
    assert not keys.missing_keys and not keys.unexpected_keys, keys
    unused = bool(getattr(a, "find_unused", False))
    ddp = torch.nn.parallel.DistributedDataParallel(net, gradient_as_bucket_view=True,
                                                    find_unused_parameters=unused)
    opt = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=0.1,
                          weight_decay=0.01)
    record, k = {}, 0

    def keep():
        nonlocal k
        for name, b in net.named_buffers():
            record[f"{k}.{name}"] = b.detach().clone()
        k += 1

    for _ in range(a.steps):
        opt.zero_grad(set_to_none=True)
        for m in range(3):
            x, y = buffer_batch(k, world, rank)
            with ddp.no_sync() if m < 2 else contextlib.nullcontext():
                F.mse_loss(ddp(x, not unused or m == 0), y).backward()
            keep()
        opt.step()
        with torch.no_grad():
            ddp(buffer_batch(k, world, rank)[0], True)
        keep()
    theirs = torch.load(os.path.join(out, f"buffers_rank{rank}.pt"), weights_only=False)
    bad = []
    if sorted(theirs) != sorted(record):
        bad.append(f"recorded buffers differ: dtrain {sorted(theirs)}, pytorch {sorted(record)}")
    for key in sorted(set(theirs) & set(record), key=lambda n: (int(n.split(".")[0]), n)):
        if theirs[key].dtype != record[key].dtype or not torch.equal(theirs[key], record[key]):
            bad.append(f"rank {rank}, after forward {key}: dtrain {theirs[key].flatten()[:3]}, "
                       f"pytorch {record[key].flatten()[:3]}")
    if rank == 0:
        final = torch.load(os.path.join(out, "final.pt"), weights_only=False)
        for name, p in net.named_parameters():
            if name not in final or not torch.equal(final[name], p.detach()):
                bad.append(f"rank 0: final weight {name} differs")
    # How far the ranks' buffers went apart: the comparison sees whether and when DDP
    # broadcast rank 0's only if they differ.
    last = record[f"{k - 2}.bn.running_mean"]
    gathered = [torch.empty_like(last) for _ in range(world)]
    dist.all_gather(gathered, last)
    apart = any(not torch.equal(g, gathered[0]) for g in gathered)
    failed = torch.tensor([len(bad)])
    dist.all_reduce(failed)
    for line in bad[:8]:
        print("  DIFFERS " + line, flush=True)
    dist.barrier()
    if rank == 0:
        print(f"buffers{', find_unused' if unused else ''}: {a.steps} steps of 3 forwards (2 under no_sync) and a no_grad forward, "
              f"{len(record)} buffer records per rank, ranks' BatchNorm means "
              f"{'apart' if apart else 'EQUAL'} after the last step's backward, gate "
              f"{'kept (no gradient)' if torch.equal(net.gate, torch.ones(16)) else 'decayed'}: "
              +
              ("bitwise equal on every rank" if not failed.item() and apart else
               "NOT bitwise equal" if failed.item() else "the ranks never went apart"),
              flush=True)
    return 1 if failed.item() or not apart else 0


def parity(a):
    if getattr(a, "buffers", False):
        return parity_buffers(a)
    rank = dist.get_rank()
    out = os.path.dirname(os.path.abspath(a.init))
    model = TransformerLM(common.VOCAB, common.SEQ, common.D_MODEL, common.LAYERS, common.HEADS,
                          2 * common.D_MODEL)
    keys = model.load_state_dict(torch.load(a.init, weights_only=False), strict=True)
    assert not keys.missing_keys and not keys.unexpected_keys, keys
    sizes = {"bucket_cap_mb": a.bucket_mb} if getattr(a, "bucket_mb", None) else {}
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, gradient_as_bucket_view=True,
        find_unused_parameters=bool(getattr(a, "find_unused", False)), **sizes)
    dtype = DTYPES[a.precision]
    compress(ddp, dtype)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=a.init_scale,
                                  growth_interval=a.growth_interval,
                                  enabled=a.precision == "fp16")
    losses, scales, skipped = common.train(ddp, opt, scaler, a.steps, dtype)
    dist.barrier()
    if rank != 0:
        return 0
    with open(os.path.join(out, "dtrain.json")) as f:
        theirs = json.load(f)
    final = torch.load(os.path.join(out, "final.pt"), weights_only=False)
    ours = dict(model.named_parameters())
    bad = []
    if sorted(final) != sorted(ours):
        bad.append(f"parameter names differ: dtrain {sorted(final)}, pytorch {sorted(ours)}")
    for name in sorted(set(final) & set(ours)):
        d, p = final[name], ours[name].detach()
        if d.dtype != p.dtype or d.shape != p.shape:
            bad.append(f"{name}: dtrain {d.dtype} {tuple(d.shape)}, pytorch {p.dtype} "
                       f"{tuple(p.shape)}")
        elif not torch.equal(d, p):
            diff = (d != p)
            bad.append(f"{name}: {int(diff.sum())} of {d.numel()} elements differ, largest by "
                       f"{float((d.double() - p.double()).abs().max()):.3e}")
    for what, mine in (("loss", losses), ("scale", scales)):
        if theirs[what] != mine:
            first = next(i for i, (u, v) in enumerate(zip(theirs[what], mine)) if u != v) \
                if len(theirs[what]) == len(mine) else -1
            bad.append(f"{what} trajectories differ (first at step {first}): dtrain "
                       f"{theirs[what]}, pytorch {mine}")
    label = a.precision + "".join(f", {k} {getattr(a, k)}" for k in ("bucket_mb", "find_unused")
                                  if getattr(a, k, None))
    print(f"{label}: {len(ours)} parameters ({sum(p.numel() for p in ours.values())} "
          f"elements), {a.steps} steps, {skipped} skipped, final loss {losses[-1]:.6f}, "
          f"scales {scales if scaler.is_enabled() else 'off'}")
    for line in bad:
        print("  DIFFERS " + line)
    print(f"{label}: " + ("bitwise equal" if not bad else "NOT bitwise equal"), flush=True)
    return 1 if bad else 0


def main():
    ap = argparse.ArgumentParser()
    for name, default in [("steps", 8), ("warmup", 2), ("d-model", 512), ("layers", 6), ("heads", 8),
                          ("d-ff", 2048), ("seq", 64), ("batch", 4)]:
        ap.add_argument("--" + name, type=int, default=default)
    ap.add_argument("--bucket-cap-mb", type=float, default=25)
    ap.add_argument("--micro-batches", type=int, default=1,
                    help="split each step's batch into this many micro-batches, all but the last "
                         "under no_sync(), each loss divided by their number (dtrain's "
                         "train.micro_batches)")
    ap.add_argument("--clip", type=float, default=0.0,
                    help="clip_grad_norm_ to this before the step (dtrain's train.clip_grad_norm)")
    ap.add_argument("--local", action="store_true")
    ap.add_argument("--fused", action="store_true")
    ap.add_argument("--local-ab", action="store_true",
                    help="DDP: every other step under no_sync() (no communication), reported "
                         "apart (ab_sync_step_s, ab_local_step_s)")
    ap.add_argument("--init", help="parity: dtrain's initial weights (DIR/init.pt)")
    ap.add_argument("--runs", help="parity: a JSON list of runs, each {init, precision} and "
                                   "optionally bucket_mb (DDP's bucket_cap_mb) and find_unused, "
                                   "trained and compared in turn in this one launch")
    ap.add_argument("--precision", choices=DTYPES, default="fp32")
    ap.add_argument("--init-scale", type=float, default=16777216.0)
    ap.add_argument("--growth-interval", type=int, default=4)
    a = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if a.init or a.runs:
        dist.init_process_group("gloo")
        status = 0
        for run in json.load(open(a.runs)) if a.runs else [{}]:
            status = max(status, parity(argparse.Namespace(**{**vars(a), **run})))
            dist.barrier()
        common.leave(status)
    if a.micro_batches < 1 or a.batch % a.micro_batches:
        ap.error(f"--micro-batches {a.micro_batches} must divide --batch {a.batch}")
    if a.micro_batches > 1 and (a.local or a.local_ab):
        ap.error("--micro-batches is a DDP step's (no_sync); not with --local or --local-ab")
    if not a.local:
        dist.init_process_group("gloo")
    rank = 0 if a.local else dist.get_rank()
    torch.manual_seed(0)
    vocab = 256
    model = TransformerLM(vocab, a.seq, a.d_model, a.layers, a.heads, a.d_ff)
    ddp = model if a.local else torch.nn.parallel.DistributedDataParallel(
        model, bucket_cap_mb=a.bucket_cap_mb, gradient_as_bucket_view=True)
    low = DTYPES[a.precision]
    if not a.local:
        compress(ddp, low)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4, **({"fused": True} if a.fused else {}))
    scaler = torch.amp.GradScaler("cpu", enabled=low == torch.float16)
    gen = torch.Generator().manual_seed(1234 + rank)
    steps, backwards, optimizer, synced = [], [], [], []
    for s in range(a.warmup + a.steps):
        local_step = a.local_ab and s % 2 == 1
        guard = ddp.no_sync() if local_step else contextlib.nullcontext()
        x = torch.randint(0, vocab, (a.batch, a.seq), generator=gen)
        y = torch.randint(0, vocab, (a.batch, a.seq), generator=gen)
        if not a.local:
            dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        tb = 0.0
        for m, (xm, ym) in enumerate(zip(x.chunk(a.micro_batches), y.chunk(a.micro_batches))):
            last = m == a.micro_batches - 1
            with guard if last else ddp.no_sync():
                with torch.autocast("cpu", dtype=low or torch.bfloat16, enabled=low is not None):
                    loss = F.cross_entropy(ddp(xm).reshape(-1, vocab), ym.reshape(-1))
                tm = time.perf_counter()
                scaler.scale(loss / a.micro_batches if a.micro_batches > 1 else loss).backward()
                te = time.perf_counter()
                tb += te - tm
        if a.clip > 0:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), a.clip)
        scaler.step(opt)
        scaler.update()
        t1 = time.perf_counter()
        if s >= a.warmup:
            steps.append(t1 - t0)
            backwards.append(tb)
            optimizer.append(t1 - te)
            synced.append(not local_step)
    ab = {}
    if a.local_ab:
        for tag, want in [("sync", True), ("local", False)]:
            ab[f"ab_{tag}_step_s"] = statistics.median(
                t for t, w in zip(steps, synced) if w == want)
    if rank == 0:
        print(json.dumps({"impl": "pytorch", "backend": "none" if a.local else "gloo",
                          "strategy": "local" if a.local else "ddp",
                          "optimizer": "fused" if a.fused else "default",
                          "precision": a.precision,
                          "world": 1 if a.local else dist.get_world_size(),
                          "params": sum(p.numel() for p in model.parameters()),
                          "torch": torch.__version__,
                          "median_step_s": statistics.median(steps),
                          "median_backward_s": statistics.median(backwards),
                          "median_optimizer_s": statistics.median(optimizer), **ab}), flush=True)
    if not a.local:
        dist.barrier()
        common.leave()


if __name__ == "__main__":
    main()
