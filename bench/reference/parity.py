"""PyTorch's side of the comparisons with dtrain (tests/parity/ddp_parity.cc, fsdp_parity.cc and
their parity_run.h): the same small TransformerLM, the same data, the same loop."""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

# The model and batch of tests/parity/parity_run.h.
VOCAB, SEQ, D_MODEL, LAYERS, HEADS, BATCH = 64, 16, 32, 2, 4, 4


def batch(step, world, rank):
    """Step `step`'s inputs and targets on `rank`: the draws of parity_run.h's batch()."""
    gen = torch.Generator().manual_seed(1000 + step * world + rank)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    y = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return x, y


def train(model, opt, scaler, steps, autocast_dtype=None, clip=0.0):
    """zero_grad, forward and loss (under autocast when a dtype is given), scaled backward,
    (with clip: unscale_ and clip_grad_norm_), scaler step and update. Returns the loss
    averaged over ranks and the scale after every step, and how many steps the scaler
    skipped."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses, scales, skipped = [], [], 0
    for s in range(steps):
        x, y = batch(s, world, rank)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16,
                            enabled=autocast_dtype is not None):
            logits = model(x).float()
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        scaler.scale(loss).backward()
        if clip > 0:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        before = scaler.get_scale() if scaler.is_enabled() else 1.0
        scaler.step(opt)
        scaler.update()
        if scaler.is_enabled() and scaler.get_scale() < before:
            skipped += 1
        mean = loss.detach().double().reshape(1)
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        scales.append(scaler.get_scale() if scaler.is_enabled() else 1.0)
    return losses, scales, skipped


def leave(status=0):
    """Ends a rank after its last barrier without tearing down PyTorch's Gloo group or the
    interpreter. That teardown once aborted a rank in CI ('terminate called without an active
    exception', after every comparison had printed), failing a test whose numbers were equal;
    nothing is left to say to the other rank, and the exit status still carries the verdict."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
