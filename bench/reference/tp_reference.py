#!/usr/bin/env python3
"""PyTorch 2.13's tensor parallelism x FSDP2 on a Llama, the reference of bench/run_tp_bench.sh.

A transformers LlamaForCausalLM of the shape tp_bench takes (untied head, grouped-query
attention), on a 2-D DeviceMesh (dp, tp) over Gloo: parallelize_module with TorchTitan's Llama
plan (ColwiseParallel q/k/v and gate/up, RowwiseParallel o and down, the embedding row-wise and
the head column-wise with loss_parallel; with --sp, SequenceParallel norms and
PrepareModuleInput), then fully_shard on each decoder layer and the root over the dp
dimension, as TorchTitan composes them. --tp 1: fully_shard alone. AdamW (PyTorch's default
implementation for DTensors), fp32, one thread per rank. Prints one JSON line on rank 0 with
the same fields as tp_bench's.
Run under dtrain-launch (or torchrun): tp_reference.py --tp 2 [--sp] [--tracker LIB]
"""
import argparse
import json
import resource
import statistics
import time
import warnings

warnings.filterwarnings("ignore")


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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--sp", action="store_true")
    for name, default in [("steps", 6), ("warmup", 2), ("hidden", 256), ("layers", 4),
                          ("heads", 8), ("kv-heads", 4), ("ffn", 768), ("vocab", 2048),
                          ("seq", 128), ("batch", 2)]:
        ap.add_argument("--" + name, type=int, default=default)
    ap.add_argument("--tracker", default="")
    args = ap.parse_args()
    mem = tracker(args.tracker)

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   loss_parallel, parallelize_module)
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = world // args.tp
    mesh = init_device_mesh("cpu", (dp, args.tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=args.ffn, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      max_position_embeddings=args.seq, tie_word_embeddings=False,
                      attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg)
    sp = args.sp and args.tp > 1
    if args.tp > 1:
        tp_mesh = mesh["tp"]
        layer_plan = {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
        }
        if sp:
            layer_plan.update({
                "input_layernorm": SequenceParallel(),
                "post_attention_layernorm": SequenceParallel(),
                "self_attn": PrepareModuleInput(
                    input_kwarg_layouts={"hidden_states": Shard(1)},
                    desired_input_kwarg_layouts={"hidden_states": Replicate()}),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                          desired_input_layouts=(Replicate(),)),
            })
        for layer in model.model.layers:
            parallelize_module(layer, tp_mesh, layer_plan)
        top = {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(),
                                                  output_layouts=Shard(1) if sp else Replicate()),
            "lm_head": ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(),
                                       output_layouts=Shard(-1), use_local_output=False),
        }
        if sp:
            top["model.norm"] = SequenceParallel()
        parallelize_module(model, tp_mesh, top)
    if dp > 1:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel()
                for p in model.parameters())
    gen = torch.Generator().manual_seed(1234 + rank // args.tp)
    positions = torch.arange(args.seq).unsqueeze(0).expand(args.batch, args.seq)
    times, steady, peak = [], 0.0, 0.0
    for s in range(args.warmup + args.steps):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
        x, y = tokens[:, :-1], tokens[:, 1:]
        dist.barrier()
        if mem:
            now = mem.dtrain_tracked_current_bytes() / 1e6
            mem.dtrain_tracked_reset_peak()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = model(x, position_ids=positions).logits
        if args.tp > 1:
            with loss_parallel():
                loss = F.cross_entropy(logits.reshape(-1, args.vocab), y.reshape(-1))
                loss.backward()
        else:
            loss = F.cross_entropy(logits.reshape(-1, args.vocab), y.reshape(-1))
            loss.backward()
        opt.step()
        t1 = time.perf_counter()
        if s >= args.warmup:
            times.append(t1 - t0)
            if mem:
                steady = max(steady, now)
                peak = max(peak, mem.dtrain_tracked_peak_bytes() / 1e6)
    out = torch.tensor([statistics.median(times),
                        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, steady,
                        peak], dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(json.dumps({"impl": "pytorch", "torch": torch.__version__, "tp": args.tp, "sp": sp,
                          "dp": dp, "world": world, "layers": args.layers,
                          "hidden": args.hidden, "seq": args.seq, "batch": args.batch,
                          "median_step_s": out[0].item(), "peak_rss_mb": out[1].item(),
                          "steady_mb": out[2].item(), "peak_mb": out[3].item(),
                          "local_elements": local}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
