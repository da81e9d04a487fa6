#!/usr/bin/env python3
"""dtrain-prepare (framework/prepare/prepare.h) on the licenses Debian ships, against Debian's
SentencePiece command-line tools, and what trains on its output:
  - the SentencePiece shards equal spm_encode's ids of each line, each line followed by the
    end-of-sentence id, whatever the chunking and the number of jobs; --decode equals spm_decode;
  - the byte tokenizer's shards are the files' bytes;
  - bad input is refused naming it (exit 2);
  - configs/llama_tokens.yaml (model.vocab_size: auto, the tokenizer's from meta.json) trains
    on the prepared tokens through dtrain-launch at 2 ranks
    under DDP and FSDP, bf16 and fp16: the loss falls, the validation perplexity is logged and
    the end-of-run sample decodes;
  - the config refuses a model.vocab_size smaller than the tokenizer's and a data.dtype other
    than the files', naming meta.json."""
import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import numpy as np

ap = argparse.ArgumentParser()
ap.add_argument("--prepare", required=True)
ap.add_argument("--launcher", required=True)
ap.add_argument("--trainer", required=True)
args = ap.parse_args()
failures = []
LICENSES = sorted(glob.glob("/usr/share/common-licenses/*"))
LICENSES = [f for f in LICENSES if os.path.isfile(f)]


def check(cond, what):
    if not cond:
        failures.append(what)
    print(("ok   " if cond else "FAIL ") + what, flush=True)


def run(argv, timeout=300, **kw):
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    return r


def spm_reference(model, path, eos):
    """spm_encode's ids of each line of `path`, each line followed by `eos`."""
    with open(path, "rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    lines = text.split("\n")
    if text.endswith("\n"):
        lines = lines[:-1]
    r = subprocess.run(["spm_encode", f"--model={model}", "--output_format=id"],
                       input="\n".join(lines) + "\n", capture_output=True, text=True, check=True)
    out = r.stdout.split("\n")[:len(lines)]
    ids = []
    for line in out:
        ids.extend(int(t) for t in line.split())
        ids.append(eos)
    return ids


def shards_of(out_dir, name):
    shard = re.compile(re.escape(name) + r"-[0-9]{4}\.bin")
    files = sorted(os.path.join(out_dir, f) for f in os.listdir(out_dir) if shard.fullmatch(f))
    return np.concatenate([np.fromfile(f, dtype=np.uint16) for f in files]) if files else None


with tempfile.TemporaryDirectory() as tmp:
    # SentencePiece, trained here.
    sp_dir = os.path.join(tmp, "licenses")
    r = run([args.prepare, "--out", sp_dir, "--vocab-size", "2048", "--jobs", "2",
             "/usr/share/common-licenses/*"])
    print(r.stdout + r.stderr[-2000:], flush=True)
    check(r.returncode == 0, "dtrain-prepare trains a SentencePiece tokenizer and encodes")
    meta = json.load(open(os.path.join(sp_dir, "meta.json")))
    check(meta["tokenizer"] == "sentencepiece" and meta["dtype"] == "uint16"
          and meta["vocab_size"] == 2048, f"meta.json: sentencepiece, uint16, 2048 ({meta})")
    check("vocab_size: auto" in r.stdout and "2048" in r.stdout and f"path: {sp_dir}/*.bin" in r.stdout,
          "it prints the config lines that train on the result")
    check("MB/s" in r.stderr and "tokens/s" in r.stderr, "a progress bar with its throughput")
    model = os.path.join(sp_dir, "tokenizer.model")
    vocab = [line.split("\t")[0] for line in open(os.path.join(sp_dir, "tokenizer.vocab"))]
    eos = vocab.index("</s>")
    total = 0
    mismatched = []
    for f in LICENSES:
        got = shards_of(sp_dir, os.path.basename(f))
        want = spm_reference(model, f, eos)
        total += 0 if got is None else len(got)
        if got is None or got.tolist() != want:
            mismatched.append(os.path.basename(f))
    check(not mismatched, f"every file's tokens equal spm_encode's, line by line "
          f"({len(LICENSES)} files, {total} tokens; mismatched: {mismatched})")
    check(total == meta["tokens"] == sum(s["tokens"] for s in meta["shards"]),
          "meta.json counts every token")
    # Cut into 4 KB pieces and encoded by 2 jobs: the same tokens.
    small = os.path.join(tmp, "small_chunks")
    r = run([args.prepare, "--out", small, "--tokenizer-model", model, "--chunk-mb", "0.004",
             "--jobs", "2", *LICENSES])
    check(r.returncode == 0 and len(glob.glob(os.path.join(small, "*.bin"))) > len(LICENSES),
          "a loaded tokenizer, files cut into many pieces")
    same = all(np.array_equal(shards_of(small, os.path.basename(f)),
                              shards_of(sp_dir, os.path.basename(f))) for f in LICENSES)
    check(same, "the pieces hold the same tokens as whole files")
    ids = shards_of(sp_dir, "GPL-3")[:60].tolist()
    r = run([args.prepare, "--decode", sp_dir, *map(str, ids)])
    # spm_decode: one line of ids per line of text (the end-of-sentence ids are the breaks).
    lines, line = [], []
    for i in ids:
        if i == eos:
            lines.append(line)
            line = []
        else:
            line.append(i)
    lines.append(line)
    ref = run(["spm_decode", f"--model={model}", "--input_format=id"],
              input="".join(" ".join(map(str, l)) + "\n" for l in lines))
    check(r.returncode == 0 and r.stdout.rstrip("\n") == ref.stdout.rstrip("\n"),
          f"--decode gives spm_decode's text ({r.stdout[:60]!r})")

    # Bytes: the files themselves.
    by_dir = os.path.join(tmp, "bytes")
    r = run([args.prepare, "--out", by_dir, "--tokenizer", "bytes", *LICENSES[:3]])
    ok = r.returncode == 0
    for f in LICENSES[:3]:
        got = shards_of(by_dir, os.path.basename(f))
        ok = ok and got is not None and bytes(got.astype(np.uint8).tolist()) == open(f, "rb").read()
    check(ok, "bytes: the shards are the files' bytes")

    # Bad input.
    r = run([args.prepare, "--out", os.path.join(tmp, "x"), "/nonexistent/*.txt"])
    check(r.returncode == 2 and "matches no file" in r.stderr, f"a glob matching nothing ({r.stderr.strip()})")
    r = run([args.prepare, "--out", os.path.join(tmp, "x"), "--tokenizer-model", LICENSES[0],
             LICENSES[0]])
    check(r.returncode == 2 and LICENSES[0] in r.stderr and "SentencePiece" in r.stderr,
          f"a tokenizer model that is not one ({r.stderr.strip()[:120]})")
    twin = os.path.join(tmp, "twin")
    os.makedirs(twin)
    shutil.copy(LICENSES[0], twin)
    r = run([args.prepare, "--out", os.path.join(tmp, "x"), "--tokenizer", "bytes", LICENSES[0],
             os.path.join(twin, os.path.basename(LICENSES[0]))])
    check(r.returncode == 2 and "same file name" in r.stderr, "two inputs of the same name")

    # configs/llama_tokens.yaml on the prepared tokens, 2 ranks.
    def train(*sets, steps=30):
        argv = [args.launcher, "--nproc-per-node", "2", "--master-port", "0", "--",
                args.trainer, "--config", "configs/llama_tokens.yaml",
                "--set", f"data.path={sp_dir}/*.bin", "--set", f"train.steps={steps}",
                "--set", "model.seq_len=32", "--set", "train.batch_size=4",
                "--set", "train.warmup_steps=5", "--set", "train.eval_every=15",
                "--set", "logging.every_steps=10", "--set", "logging.progress_bar=false",
                "--set", f"logging.metrics_file={tmp}/metrics.jsonl", "--set",
                "logging.sample_tokens=8"]
        for s in sets:
            argv += ["--set", s]
        r = run(argv, timeout=600)
        return r.returncode, r.stdout + r.stderr

    for strategy in ["ddp", "fsdp"]:
        for policy in ["bf16", "fp16"]:
            rc, log = train(f"parallel.strategy={strategy}", f"precision.policy={policy}",
                            *(["precision.scaler.enabled=true"] if policy == "fp16" else []))
            done = re.search(r"done: 30 steps, loss ([0-9.]+) -> ([0-9.]+)", log)
            falls = done is not None and float(done.group(2)) < 0.9 * float(done.group(1))
            if rc != 0 or not falls:
                print(log[-3000:], flush=True)
            check(rc == 0 and falls, f"llama_tokens {strategy} {policy}: trains, loss "
                  f"{done.group(1) + ' -> ' + done.group(2) if done else '?'}")
            check("val_ppl" in log and "model: Llama, 1.00058M parameters" in log,
                  f"llama_tokens {strategy} {policy}: a Llama, validation perplexity logged")
            sample = re.search(r"sample \(token ids; prompt \| greedy continuation\): ([0-9 |]+)",
                               log)
            if strategy == "fsdp" and policy == "bf16":
                dec = run([args.prepare, "--decode", sp_dir, *sample.group(1).split()]) \
                    if sample else None
                check(dec is not None and dec.returncode == 0 and dec.stdout.strip() != "",
                      f"the sample decodes: {dec.stdout.strip()[:80]!r}" if dec else
                      "the sample decodes")

    # The config checks the tokens against meta.json.
    rc, log = train("model.vocab_size=1000", "parallel.strategy=ddp")
    check(rc == 2 and "meta.json" in log and "set model.vocab_size: 2048" in log,
          "a model.vocab_size below the tokenizer's is refused, naming the fix")
    rc, log = train("data.dtype=uint32", "parallel.strategy=ddp")
    check(rc == 2 and "meta.json" in log and "remove data.dtype" in log,
          "a data.dtype other than the files' is refused")

print("prepare_test:", "FAILED" if failures else "passed", f"({len(failures)} failures)")
sys.exit(1 if failures else 0)
