#!/usr/bin/env python3
"""dtrain's Llama (framework/models/llama.h) against transformers' LlamaForCausalLM on small
randomly initialized models saved by save_pretrained (nothing is downloaded): grouped-query
and multi-head attention, tied and untied heads, an explicit head_dim, one file and a sharded
checkpoint. dtrain loads each and computes the logits of the same tokens (fp32: within 1e-5
of transformers'; bf16: within bf16 rounding), then saves the model, and transformers loads
dtrain's checkpoint and computes the original's logits bit for bit."""
import argparse
import os
import subprocess
import sys
import tempfile
import warnings

import torch
from safetensors.torch import load_file, save_file

warnings.filterwarnings("ignore")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.set_verbosity_error()
ap = argparse.ArgumentParser()
ap.add_argument("--tool", required=True)
ap.add_argument("--launcher", required=True)
ap.add_argument("--trainer", required=True)
args = ap.parse_args()
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
    print(("ok   " if cond else "FAIL ") + what, flush=True)


def tool(*argv):
    r = subprocess.run([args.tool, *argv], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        print(r.stderr, flush=True)
    return r


CASES = {
    "gqa_untied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "mha_tied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    "head_dim_mqa": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=8,
                         tie_word_embeddings=False, rope_theta=500000.0),
}

torch.manual_seed(0)
tokens = torch.randint(0, 100, (2, 12))
with tempfile.TemporaryDirectory() as tmp:
    tok_file = os.path.join(tmp, "tokens.safetensors")
    save_file({"tokens": tokens}, tok_file)
    for name, extra in CASES.items():
        theta = extra.pop("rope_theta", 10000.0)
        cfg = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=96,
                          num_hidden_layers=2, max_position_embeddings=32,
                          rope_parameters={"rope_type": "default", "rope_theta": theta},
                          attn_implementation="eager", **extra)
        hf = LlamaForCausalLM(cfg).eval()
        with torch.no_grad():  # make the norms matter
            for n, p in hf.named_parameters():
                if "norm" in n:
                    p.uniform_(0.5, 1.5)
            want = hf(tokens).logits.float()
        for layout in ["single", "sharded"]:
            src = os.path.join(tmp, f"{name}_{layout}")
            hf.save_pretrained(src, max_shard_size="20KB" if layout == "sharded" else "5GB")
            if layout == "sharded":
                check(os.path.exists(os.path.join(src, "model.safetensors.index.json")),
                      f"{name}: save_pretrained wrote a sharded checkpoint")
            out = os.path.join(tmp, f"{name}_{layout}_logits.safetensors")
            r = tool("logits", src, tok_file, out)
            if r.returncode != 0:
                check(False, f"{name} {layout}: dtrain loads and runs the checkpoint")
                continue
            got = load_file(out)["logits"]
            err = (got - want).abs().max().item()
            check(got.shape == want.shape and err <= 1e-5 * max(1.0, want.abs().max().item()),
                  f"{name} {layout}: fp32 logits within 1e-5 of transformers' (max |diff| {err:.2e})")
        # bf16: both sides in bf16; rounding of bf16 matmuls and norms.
        hf16 = LlamaForCausalLM.from_pretrained(os.path.join(tmp, f"{name}_single"),
                                                dtype=torch.bfloat16,
                                                attn_implementation="eager").eval()
        with torch.no_grad():
            want16 = hf16(tokens).logits.float()
        out = os.path.join(tmp, f"{name}_bf16.safetensors")
        if tool("logits", os.path.join(tmp, f"{name}_single"), tok_file, out, "bf16").returncode == 0:
            got16 = load_file(out)["logits"]
            err = (got16 - want16).abs().max().item()
            scale = want16.abs().max().item()
            check(err <= 0.02 * scale, f"{name}: bf16 logits within bf16 rounding of "
                  f"transformers' (max |diff| {err:.3f} of max {scale:.3f})")
        else:
            check(False, f"{name}: dtrain runs the checkpoint in bf16")
        # dtrain's save, loaded by transformers: the original's logits, bit for bit.
        saved = os.path.join(tmp, f"{name}_dtrain")
        if tool("resave", os.path.join(tmp, f"{name}_sharded"), saved).returncode == 0:
            back = LlamaForCausalLM.from_pretrained(saved, attn_implementation="eager").eval()
            with torch.no_grad():
                again = back(tokens).logits.float()
            check(torch.equal(again, want), f"{name}: transformers loads dtrain's save, the same "
                  "logits bit for bit")
        else:
            check(False, f"{name}: dtrain saves the model")

    # A fine-tune at 2 ranks under DDP and FSDP, saved by dtrain: transformers loads it and
    # computes dtrain's logits of the fine-tuned model bit for bit.
    src = os.path.join(tmp, "gqa_untied_sharded")
    rows = torch.randint(0, 100, (4, 12), generator=torch.Generator().manual_seed(3))
    rows_file = os.path.join(tmp, "rows.safetensors")
    save_file({"tokens": rows}, rows_file)
    with torch.no_grad():
        before = LlamaForCausalLM.from_pretrained(src, attn_implementation="eager")(rows).logits
    tuned = {}
    for strategy in ["ddp", "fsdp"]:
        out = os.path.join(tmp, f"tuned_{strategy}")
        r = subprocess.run([args.launcher, "--nproc-per-node", "2", "--master-port", "0", "--",
                            args.tool, "finetune", src, rows_file, out, strategy, "3"],
                           capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            print(r.stdout[-3000:], r.stderr[-3000:], flush=True)
            check(False, f"{strategy}: a 2-rank fine-tune runs")
            continue
        theirs = LlamaForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
        with torch.no_grad():
            got = theirs(rows).logits.float()
        ours = load_file(os.path.join(out, "dtrain_logits.safetensors"))["logits"]
        check(torch.equal(got, ours), f"{strategy}: transformers loads the fine-tuned save, "
              "dtrain's logits bit for bit")
        check((got - before).abs().max().item() > 1e-3, f"{strategy}: the fine-tune moved the model")
        tuned[strategy] = got
    if len(tuned) == 2:
        err = (tuned["ddp"] - tuned["fsdp"]).abs().max().item()
        check(err <= 1e-4 * tuned["ddp"].abs().max().item(),
              f"DDP and FSDP fine-tunes agree (max |diff| {err:.2e})")

    # The same through dtrain-train and configs/llama_finetune.yaml (model.type: llama): a
    # 2-rank fine-tune of the checkpoint (model.pretrained) under DDP and FSDP, written back by
    # the trainer (model.save_pretrained) and loaded by transformers; DDP and FSDP agree.
    trained = {}
    for strategy in ["ddp", "fsdp"]:
        out = os.path.join(tmp, f"trainer_{strategy}")
        # configs/llama_finetune.yaml, pointed at this checkpoint, synthetic tokens and tmp.
        sets = [f"model.pretrained={src}", f"model.save_pretrained={out}", "model.seq_len=12",
                "data={source: synthetic}", "train.steps=3", "train.batch_size=2",
                "train.micro_batches=1", "train.lr=1.0e-3", "train.warmup_steps=0",
                "train.eval_every=0", f"parallel.strategy={strategy}", "precision.policy=fp32",
                f"checkpoint.dir={tmp}/ckpt_{strategy}", f"logging.metrics_file={tmp}/m.jsonl",
                "logging.every_steps=1", "logging.progress_bar=false", "logging.sample_tokens=4"]
        argv = [args.launcher, "--nproc-per-node", "2", "--master-port", "0", "--",
                args.trainer, "--config", "configs/llama_finetune.yaml"]
        for x in sets:
            argv += ["--set", x]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        log = r.stdout + r.stderr
        if r.returncode != 0 or not os.path.exists(os.path.join(out, "config.json")):
            print(log[-4000:], flush=True)
            check(False, f"dtrain-train {strategy}: fine-tunes the checkpoint and saves it")
            continue
        check("model: Llama" in log and f"from {src}" in log,
              f"dtrain-train {strategy}: builds the Llama from model.pretrained")
        theirs = LlamaForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
        with torch.no_grad():
            got = theirs(rows).logits.float()
        check((got - before).abs().max().item() > 1e-4,
              f"dtrain-train {strategy}: transformers loads the trained save, and it moved")
        trained[strategy] = got
    if len(trained) == 2:
        err = (trained["ddp"] - trained["fsdp"]).abs().max().item()
        check(err <= 1e-4 * trained["ddp"].abs().max().item(),
              f"dtrain-train: DDP and FSDP fine-tunes agree (max |diff| {err:.2e})")

    # A checkpoint that does not match its config is refused naming the tensor.
    bad = os.path.join(tmp, "gqa_untied_single")
    w = load_file(os.path.join(bad, "model.safetensors"))
    w["model.norm.weight"] = torch.ones(65)
    save_file(w, os.path.join(bad, "model.safetensors"), metadata={"format": "pt"})
    r = tool("logits", bad, tok_file, os.path.join(tmp, "x.safetensors"))
    check(r.returncode == 2 and "model.norm.weight" in r.stderr and "shape" in r.stderr,
          "a tensor of the wrong shape is refused, naming it")

print("llama_hf_test:", "FAILED" if failures else "passed", f"({len(failures)} failures)")
sys.exit(1 if failures else 0)
