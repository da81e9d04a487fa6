"""dtrain-generate (framework/generate.h) against transformers, and on dtrain's own checkpoints.

  Hugging Face: a small random LlamaForCausalLM that transformers saves (grouped-query
  attention, untied head). dtrain-generate --hf on it: the prompt's fp32 logits equal
  transformers' within 1e-5; greedy generation with the KV cache gives transformers'
  generate(do_sample=False) tokens, and the same tokens without the cache; the perplexity of a
  token sequence equals exp(transformers' loss) within 1e-5; sampling with a seed repeats, and
  top_k 1 is greedy.
  dtrain: the tiny TransformerLM trained on GPL-3 under DDP (a full checkpoint) and FSDP (a
  sharded one): greedy completion of "The " equals the trainer's own end-of-run sample, both
  formats give the same logits, and --score prints the perplexity of a text.
  Tokens: a tiny Llama trained on dtrain-prepare SentencePiece tokens: a text prompt goes
  through the tokenizer and back.
Usage: generate_test.py --generate PATH --prepare PATH --launcher PATH --trainer PATH
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

import torch

p = argparse.ArgumentParser()
for k in ("generate", "prepare", "launcher", "trainer"):
    p.add_argument("--" + k, required=True)
a = p.parse_args()
failures = []


def check(ok, what, detail=""):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)
        print(detail[-4000:], flush=True)


def gen(*argv, timeout=300):
    """dtrain-generate's exit code, stdout and stderr; stdout byte for byte (latin-1), since a
    byte-level model may print bytes that are not UTF-8."""
    r = subprocess.run([a.generate, *argv], capture_output=True, timeout=timeout)
    return r.returncode, r.stdout.decode("latin-1"), r.stderr.decode("utf-8", "replace")


with tempfile.TemporaryDirectory() as tmp:
    # --- Hugging Face ------------------------------------------------------------------------
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, attn_implementation="eager")
    hf = LlamaForCausalLM(cfg).eval()
    hf_dir = os.path.join(tmp, "hf")
    hf.save_pretrained(hf_dir, safe_serialization=True)
    prompt = [5, 17, 42, 8, 90, 3]
    ids = " ".join(map(str, prompt))
    logits_file = os.path.join(tmp, "logits.pt")
    rc, out, err = gen("--hf", hf_dir, "--prompt-ids", ids, "--logits", logits_file,
                       "--max-new-tokens", "0")
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0].float()
    got = torch.load(logits_file) if rc == 0 else None
    diff = (got - want).abs().max().item() if got is not None else float("inf")
    check(rc == 0 and diff < 1e-5, f"hf: the prompt's logits equal transformers' (max diff {diff:.2e})",
          err)

    n = 24
    rc, out, err = gen("--hf", hf_dir, "--prompt-ids", ids, "--max-new-tokens", str(n))
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                          pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
    cached = [int(x) for x in out.split()] if rc == 0 else None
    check(cached == ref, f"hf: greedy with the KV cache = transformers' generate ({cached} vs {ref})",
          err)
    rc, out, err = gen("--hf", hf_dir, "--prompt-ids", ids, "--max-new-tokens", str(n),
                       "--no-cache")
    check(rc == 0 and [int(x) for x in out.split()] == cached,
          "hf: the same tokens without the cache", err)
    # Past the context (64 positions) the window slides, as the trainer's own sample: each token
    # from the last 64; the same tokens with and without the cache.
    longer = []
    for flag in ("--quiet", "--no-cache"):
        rc, out, err = gen("--hf", hf_dir, "--prompt-ids", ids, "--max-new-tokens", "100", flag)
        longer.append(out.split() if rc == 0 else None)
    check(longer[0] is not None and len(longer[0]) == 100 and longer[0] == longer[1] and
          longer[0][:n] == [str(x) for x in cached],
          "hf: past the context the window slides, with and without the cache", err)

    seq = [int(x) for x in torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(3))]
    rc, out, err = gen("--hf", hf_dir, "--score-ids", " ".join(map(str, seq)), "--quiet")
    with torch.no_grad():
        loss = hf(torch.tensor([seq]), labels=torch.tensor([seq])).loss.item()
    ppl = float(out) if rc == 0 else float("nan")
    check(abs(ppl - torch.tensor(loss).exp().item()) < 1e-5 * ppl,
          f"hf: perplexity {ppl:.6f} = exp(transformers' loss) {torch.tensor(loss).exp().item():.6f}",
          err)

    sampled = []
    for seed in ("1", "1", "2"):
        rc, out, err = gen("--hf", hf_dir, "--prompt-ids", ids, "--max-new-tokens", "16",
                           "--temperature", "1.0", "--top-k", "20", "--top-p", "0.9",
                           "--seed", seed)
        sampled.append(out.split() if rc == 0 else None)
    check(sampled[0] is not None and sampled[0] == sampled[1] and sampled[0] != sampled[2],
          "hf: sampling repeats with its seed and differs with another", str(sampled))
    rc, out, err = gen("--hf", hf_dir, "--prompt-ids", ids, "--max-new-tokens", str(n),
                       "--temperature", "0.7", "--top-k", "1", "--seed", "5")
    check(rc == 0 and [int(x) for x in out.split()] == cached, "hf: top_k 1 is greedy", err)

    # --- dtrain checkpoints: full (DDP) and sharded (FSDP) -----------------------------------
    samples, logits = {}, {}
    text = os.path.join(tmp, "text.txt")
    with open(text, "w") as f:
        f.write(open("/usr/share/common-licenses/GPL-3").read()[:3000])
    for strategy in ("ddp", "fsdp"):
        ckpt = os.path.join(tmp, "ckpt_" + strategy)
        sets = ["--set", f"parallel.strategy={strategy}", "--set", f"checkpoint.dir={ckpt}",
                "--set", "train.steps=30", "--set", "logging.progress_bar=false",
                "--set", "logging.metrics_file="]
        r = subprocess.run([a.launcher, "--nproc-per-node", "2", "--master-port", "0", "--",
                            a.trainer, "--config", "configs/tiny/ddp_fp32.yaml", *sets],
                           capture_output=True, text=True, timeout=300)
        m = re.search(r'sample: "(.*)"', r.stdout + r.stderr)
        check(r.returncode == 0 and m, f"{strategy}: trains 30 steps with a checkpoint",
              r.stdout + r.stderr)
        trainer_sample = m.group(1) if m else None
        # The trainer's sample: "The " and 48 greedy bytes, each forward over the whole
        # sequence (--no-cache does the same), a line break shown as a space and other
        # unprintable bytes as '?'.
        completions = {}
        for cache in ("--no-cache", "--quiet"):
            rc, out, err = gen("--config", "configs/tiny/ddp_fp32.yaml", *sets, "--prompt", "The ",
                               "--max-new-tokens", "48", "--quiet", cache)
            done = "The " + (out[:-1] if out.endswith("\n") else out)
            completions[cache] = "".join(
                c if 32 <= ord(c) < 127 else (" " if c == "\n" else "?") for c in done)
        got = completions["--no-cache"]
        check(trainer_sample is not None and got == trainer_sample,
              f"{strategy}: greedy completion = the trainer's sample ({got!r} vs "
              f"{trainer_sample!r})", err)
        check(completions["--quiet"] == got, f"{strategy}: the same completion with the KV cache "
              f"({completions['--quiet']!r})", err)
        lf = os.path.join(tmp, f"logits_{strategy}.pt")
        rc, out, err = gen("--config", "configs/tiny/ddp_fp32.yaml", *sets, "--prompt", "The licen",
                           "--logits", lf, "--max-new-tokens", "0")
        logits[strategy] = torch.load(lf) if rc == 0 else None
        rc, out, err = gen("--config", "configs/tiny/ddp_fp32.yaml", *sets, "--score", text)
        mm = re.search(r"perplexity ([0-9.]+)", out)
        check(rc == 0 and mm and 1 < float(mm.group(1)) < 256,
              f"{strategy}: --score prints a perplexity ({out.strip()})", err)
    check(all(v is not None for v in logits.values()) and logits["ddp"].shape == logits["fsdp"].shape,
          "full and sharded checkpoints load into the same model")

    # --- SentencePiece tokens: a text prompt through the tokenizer ---------------------------
    tokens = os.path.join(tmp, "tokens")
    r = subprocess.run([a.prepare, "--out", tokens, "--vocab-size", "400",
                        "/usr/share/common-licenses/GPL-3"], capture_output=True, text=True)
    check(r.returncode == 0, "dtrain-prepare: SentencePiece tokens", r.stderr)
    ckpt = os.path.join(tmp, "ckpt_llama")
    sets = ["--set", f"data.path={tokens}/*.bin", "--set", "model.seq_len=32",
            "--set", "train.batch_size=4", "--set", "train.steps=20", "--set", "train.eval_every=0",
            "--set", "parallel.strategy=ddp", "--set", "precision.policy=fp32",
            "--set", f"checkpoint.dir={ckpt}", "--set", "logging.progress_bar=false",
            "--set", "logging.metrics_file="]
    r = subprocess.run([a.launcher, "--nproc-per-node", "2", "--master-port", "0", "--",
                        a.trainer, "--config", "configs/llama_tokens.yaml", *sets],
                       capture_output=True, text=True, timeout=300)
    check(r.returncode == 0, "a tiny Llama trains on them", r.stdout[-2000:] + r.stderr[-2000:])
    # The text prompt goes through the tokenizer (dtrain-prepare --encode), the completion back
    # (--decode): the same as the ids given directly and decoded by hand.
    enc = subprocess.run([a.prepare, "--encode", tokens], input="This License", text=True,
                         capture_output=True)
    prompt_ids = enc.stdout.split()
    rc, out_ids, err = gen("--config", "configs/llama_tokens.yaml", *sets, "--prompt-ids",
                           " ".join(prompt_ids), "--max-new-tokens", "12")
    dec = subprocess.run([a.prepare, "--decode", tokens, *out_ids.split()], text=True,
                         capture_output=True)
    rc2, out_text, err2 = gen("--config", "configs/llama_tokens.yaml", *sets, "--prompt",
                              "This License", "--max-new-tokens", "12", "--quiet")
    check(rc == 0 and rc2 == 0 and len(prompt_ids) > 1 and len(out_ids.split()) == 12 and
          out_text.rstrip("\n") == dec.stdout.rstrip("\n"),
          f"llama: a text prompt through the SentencePiece tokenizer and back "
          f"({prompt_ids} -> {out_ids.split()} -> {out_text.strip()!r})", err + err2)

print(f"{len(failures)} failure(s)" if failures else "PASS")
sys.exit(1 if failures else 0)
