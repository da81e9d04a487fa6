#!/usr/bin/env python3
"""PyTorch's pipelining (torch.distributed.pipelining) on transformers' Llama, the reference for
dtrain's pipeline (tests/parity/pipeline_parity_test.sh).

  pipeline_reference.py init DIR          a small LlamaForCausalLM, save_pretrained into DIR
  pipeline_reference.py run --hf DIR --cases gpipe:4:1,1f1b:8:1,interleaved_1f1b:4:2 --out F
                                          under a launcher (torchrun's variables), over Gloo
  pipeline_reference.py bench --schedule 1f1b --micro-batches 8 [--stages-per-rank 2]
                                          the step time of bench/pipeline_bench.cc's model,
                                          split and batch, under PyTorch's schedule

Each case is schedule:micro_batches:stages_per_rank. The model's layers are split evenly into
world x stages_per_rank stages, stage s on rank s % world (PyTorch's looping placement), the
first holding the embedding and the last the norm and head, as dtrain splits them. The batch
(the same formula as tests/parity/pipeline_parity.cc) goes through ScheduleGPipe,
Schedule1F1B, ScheduleInterleaved1F1B or ScheduleInterleavedZeroBubble (zero_bubble, one stage
per rank) with cross-entropy per micro-batch; the last stage's
rank writes each case's per-micro-batch losses (JSON) to F.
"""
import argparse
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.set_verbosity_error()

MICRO, SEQ = 2, 8


def batch(micro_batches, vocab):
    """Tokens and targets [micro_batches x MICRO, SEQ], as pipeline_parity.cc makes them."""
    b = torch.arange(micro_batches * MICRO).view(-1, 1)
    t = torch.arange(SEQ).view(1, -1)
    return (b * 31 + t * 7 + 3) % vocab, (b * 17 + t * 5 + 1) % vocab


class Stage(torch.nn.Module):
    """Layers [begin, end) of a LlamaForCausalLM: embedding first, norm and head last."""

    def __init__(self, model, begin, end):
        super().__init__()
        m = model.model
        self.first, self.last = begin == 0, end == len(m.layers)
        self.embed = m.embed_tokens if self.first else None
        self.layers = torch.nn.ModuleList(m.layers[begin:end])
        self.rotary = m.rotary_emb
        self.norm = m.norm if self.last else None
        self.head = model.lm_head if self.last else None

    def forward(self, x):
        h = self.embed(x) if self.first else x
        pos = torch.arange(h.shape[1]).unsqueeze(0).expand(h.shape[0], -1)
        pe = self.rotary(h, pos)
        for layer in self.layers:
            h = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe)
            h = h[0] if isinstance(h, tuple) else h
        if self.last:
            h = self.head(self.norm(h))
        return h


def init(folder):
    torch.manual_seed(5)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, attn_implementation="eager")
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(folder)


def make_schedule(kind, model, rank, world, per_rank, micro_batches, loss_fn):
    """PyTorch's schedule over an even split of `model` into world x per_rank stages."""
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleaved1F1B,
                                              ScheduleInterleavedZeroBubble)
    n = world * per_rank
    per = model.config.num_hidden_layers // n
    stages = [PipelineStage(Stage(model, s * per, (s + 1) * per), s, n, torch.device("cpu"))
              for s in range(rank, n, world)]
    if kind == "gpipe":
        return ScheduleGPipe(stages[0], micro_batches, loss_fn=loss_fn)
    if kind == "1f1b":
        return Schedule1F1B(stages[0], micro_batches, loss_fn=loss_fn)
    if kind == "zero_bubble":  # ZB-H1: its order with one stage per rank
        return ScheduleInterleavedZeroBubble(stages, micro_batches, loss_fn=loss_fn)
    return ScheduleInterleaved1F1B(stages, micro_batches, loss_fn=loss_fn)


def bench(args):
    """Seconds per step of PyTorch's schedule on pipeline_bench.cc's model and batch."""
    import time
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    hidden, vocab = args.hidden, 512
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden,
                      intermediate_size=hidden * 8 // 3 // 64 * 64,
                      num_hidden_layers=args.layers, num_attention_heads=hidden // 64,
                      num_key_value_heads=hidden // 64, max_position_embeddings=args.seq,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).to(torch.float32)
    m = args.micro_batches

    def loss_fn(logits, target):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1))

    sched = make_schedule(args.schedule, model, rank, world, args.stages_per_rank, m, loss_fn)
    tokens = torch.randint(vocab, (m * args.micro, args.seq))
    targets = torch.randint(vocab, (m * args.micro, args.seq))
    n = world * args.stages_per_rank
    holds_last = (n - 1) % world == rank
    times = []
    for step in range(args.steps + 1):
        model.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        kw = {"target": targets, "losses": []} if holds_last else {}
        if rank == 0:
            sched.step(tokens, **kw)
        else:
            sched.step(**kw)
        dist.barrier()
        if step:
            times.append(time.perf_counter() - t0)
    if rank == 0:
        print(f"pipeline_reference {args.schedule} pp={world} m={m} v={args.stages_per_rank}: "
              f"step {1e3 * sum(times) / len(times):.1f} ms")
    dist.destroy_process_group()


def run(args):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    out = {}
    for case in args.cases.split(","):
        kind, micro_batches, per_rank = case.split(":")
        micro_batches, per_rank = int(micro_batches), int(per_rank)
        model = LlamaForCausalLM.from_pretrained(args.hf, torch_dtype=torch.float32)
        vocab = model.config.vocab_size
        layers = model.config.num_hidden_layers
        n = world * per_rank
        tokens, targets = batch(micro_batches, vocab)

        def loss_fn(logits, target):
            return torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1))

        sched = make_schedule(kind, model, rank, world, per_rank, micro_batches, loss_fn)
        losses = []
        holds_first = rank == 0
        holds_last = (n - 1) % world == rank
        kw = {}
        if holds_last:
            kw = {"target": targets, "losses": losses}
        if holds_first:
            sched.step(tokens, **kw)
        else:
            sched.step(**kw)
        if holds_last:
            out[case] = [float(x) for x in losses]
    if out:
        with open(args.out, "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("init")
    i.add_argument("folder")
    r = sub.add_parser("run")
    r.add_argument("--hf", required=True)
    r.add_argument("--cases", required=True)
    r.add_argument("--out", required=True)
    b = sub.add_parser("bench")
    b.add_argument("--schedule", default="1f1b")
    b.add_argument("--micro-batches", type=int, default=8)
    b.add_argument("--stages-per-rank", type=int, default=1)
    b.add_argument("--steps", type=int, default=5)
    b.add_argument("--layers", type=int, default=8)
    b.add_argument("--hidden", type=int, default=256)
    b.add_argument("--seq", type=int, default=128)
    b.add_argument("--micro", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.cmd == "init":
        init(args.folder)
    elif args.cmd == "bench":
        bench(args)
    else:
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
