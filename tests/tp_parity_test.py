#!/usr/bin/env python3
"""dtrain's tensor parallelism against PyTorch's own, on the same Llama, over Gloo: TP at 2 ranks,
and FSDP x TP on a 2-D mesh at 4 ranks.

A small random transformers LlamaForCausalLM (grouped-query attention, untied head) is saved;
both sides load it and train the same AdamW steps on the same tokens:
  dtrain   llama_tool finetune ... tp|tp-sp: the Llama plan (sharding/tensor_parallel_plan.h),
           the vocabulary-parallel cross-entropy, under dtrain-launch;
  PyTorch  parallelize_module with ColwiseParallel / RowwiseParallel (and SequenceParallel with
           PrepareModuleInput for tp-sp, TorchTitan's Llama plan), loss_parallel, on a
           DeviceMesh over Gloo, in this file's --reference mode under dtrain-launch;
  2-D      fsdp-tp|fsdp-tp-sp: the same plans on the tp dimension of a (dp 2, tp 2) mesh at
           4 ranks, with fully_shard on each decoder layer and the root over dp (TorchTitan's
           composition) against dtrain's FSDP over the data-parallel ranks x its plan; each
           data-parallel rank trains on its rows, and the losses compared are the mean over
           data-parallel ranks.
Each step's loss must agree within fp32 rounding, and so must the trained model's logits
(dtrain's full model gathered over the group and saved; PyTorch's full_tensor()s).
Usage: tp_parity_test.py --tool PATH --launcher PATH [--steps N]
"""
import argparse
import os
import subprocess
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore")

LR = 1e-3


def reference(args):
    """PyTorch's side: each strategy of --strategy (a comma-separated list, all at this world
    size) in turn in this one process group, each writing --out-dir/pytorch-<strategy>.safetensors
    (one start of torch, transformers and the group for all of them)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    for strategy in args.strategy.split(","):
        reference_one(args, strategy,
                      os.path.join(args.out_dir, "pytorch-" + strategy + ".safetensors"))
        dist.barrier()
    dist.destroy_process_group()


def reference_one(args, strategy, out):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from safetensors.torch import load_file, save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   loss_parallel, parallelize_module)
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    from torch.distributed.fsdp import fully_shard
    world = dist.get_world_size()
    two_d = strategy.startswith("fsdp-")
    dp = world // 2 if two_d else 1
    if two_d:
        mesh2 = init_device_mesh("cpu", (dp, 2), mesh_dim_names=("dp", "tp"))
        mesh = mesh2["tp"]
    else:
        mesh = init_device_mesh("cpu", (world,))
    model = LlamaForCausalLM.from_pretrained(args.dir, torch_dtype=torch.float32,
                                             attn_implementation="sdpa")
    sp = strategy.endswith("tp-sp")
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
            "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                            desired_input_kwarg_layouts={
                                                "hidden_states": Replicate()}),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                      desired_input_layouts=(Replicate(),)),
        })
    for layer in model.model.layers:
        parallelize_module(layer, mesh, layer_plan)
    top = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(),
                                              output_layouts=Shard(1) if sp else Replicate()),
        "lm_head": ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(),
                                   output_layouts=Shard(-1), use_local_output=False),
    }
    if sp:
        top["model.norm"] = SequenceParallel()
    parallelize_module(model, mesh, top)
    if two_d:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh2["dp"])
        fully_shard(model, mesh=mesh2["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    tokens = load_file(args.tokens)["tokens"].long()
    if two_d:  # this data-parallel rank's rows: d, d + dp, ...
        tokens = tokens[dist.get_rank() // 2::dp]
    B, T = tokens.shape
    positions = torch.arange(T).unsqueeze(0).expand(B, T)
    losses = []
    for _ in range(args.steps):
        opt.zero_grad()
        logits = model(tokens, position_ids=positions).logits
        with loss_parallel():
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                   tokens[:, 1:].reshape(-1))
            loss.backward()
        opt.step()
        value = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        value = value.detach().double().reshape(1).clone()
        if two_d:
            dist.all_reduce(value, group=mesh2["dp"].get_group())
        losses.append(value.item() / dp)
    full = {}
    for name, p in model.named_parameters():
        full[name] = p.full_tensor().detach() if hasattr(p, "full_tensor") else p.detach()
    if dist.get_rank() == 0:
        whole = LlamaForCausalLM.from_pretrained(args.dir, torch_dtype=torch.float32,
                                                 attn_implementation="sdpa")
        whole.load_state_dict(full, strict=False)
        with torch.no_grad():
            logits = whole(load_file(args.tokens)["tokens"].long()).logits
        save_file({"logits": logits.contiguous(),
                   "losses": torch.tensor(losses, dtype=torch.float64)}, out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tool")
    ap.add_argument("--launcher")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--reference", action="store_true")
    ap.add_argument("--dir")
    ap.add_argument("--tokens")
    ap.add_argument("--out-dir")
    ap.add_argument("--strategy")
    args = ap.parse_args()
    if args.reference:
        reference(args)
        return

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    failures = []
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=32, tie_word_embeddings=False)
        model_dir = os.path.join(tmp, "hf")
        LlamaForCausalLM(cfg).save_pretrained(model_dir)
        tokens = os.path.join(tmp, "tokens.safetensors")
        save_file({"tokens": torch.randint(0, 64, (4, 16))}, tokens)
        # dtrain's run of each strategy, then PyTorch's of every strategy at that world size
        # in one job (each PyTorch start imports torch, transformers and DTensor: seconds).
        for ranks, strategies in ((2, ("tp", "tp-sp")), (4, ("fsdp-tp", "fsdp-tp-sp"))):
            cmds = [[args.tool, "finetune", model_dir, tokens, os.path.join(tmp, "dtrain-" + s),
                     s, str(args.steps)] for s in strategies]
            cmds.append([sys.executable, "-W", "ignore", os.path.abspath(__file__), "--reference",
                         "--dir", model_dir, "--tokens", tokens, "--out-dir", tmp,
                         "--strategy", ",".join(strategies), "--steps", str(args.steps)])
            for cmd in cmds:
                r = subprocess.run([args.launcher, "--nproc-per-node", str(ranks), "--master-port", "0",
                                    "--backend", "gloo", "--"] + cmd, capture_output=True,
                                   text=True, env=env, timeout=600)
                if r.returncode != 0:
                    print(r.stdout[-4000:], r.stderr[-4000:])
                    raise SystemExit(f"{cmd[-2] if cmd[0] == args.tool else 'PyTorch'}: "
                                     f"{' '.join(cmd[:2])} exited {r.returncode}")
            for strategy in strategies:
                a = load_file(os.path.join(tmp, "dtrain-" + strategy, "dtrain_logits.safetensors"))
                b = load_file(os.path.join(tmp, "pytorch-" + strategy + ".safetensors"))
                loss_diff = float(((a["losses"] - b["losses"]).abs() / b["losses"].abs()).max())
                logit_diff = float((a["logits"] - b["logits"]).abs().max() / b["logits"].abs().max())
                print(f"{strategy}: {args.steps} steps, losses dtrain "
                      f"{[round(x, 6) for x in a['losses'].tolist()]} PyTorch "
                      f"{[round(x, 6) for x in b['losses'].tolist()]}: max relative difference "
                      f"{loss_diff:.2e}; trained logits {logit_diff:.2e}", flush=True)
                if not loss_diff < 1e-5:
                    failures.append(f"{strategy}: losses differ by {loss_diff:.3e}")
                if not logit_diff < 1e-4:
                    failures.append(f"{strategy}: trained logits differ by {logit_diff:.3e}")
    for f in failures:
        print("FAIL " + f)
    if failures:
        sys.exit(1)
    print("tp_parity_test: dtrain's TP and PyTorch's agree")


if __name__ == "__main__":
    main()
