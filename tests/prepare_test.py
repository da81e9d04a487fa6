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
LICENSES, _seen = [], set()
for _f in sorted(glob.glob("/usr/share/common-licenses/*")):
    # dtrain-prepare reads a file once, under its first name (GFDL is a link to GFDL-1.3).
    if os.path.isfile(_f) and os.path.realpath(_f) not in _seen:
        _seen.add(os.path.realpath(_f))
        LICENSES.append(_f)


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
    gpl3 = next(os.path.basename(f) for f in LICENSES
                if os.path.realpath(f) == os.path.realpath("/usr/share/common-licenses/GPL-3"))
    ids = shards_of(sp_dir, gpl3)[:60].tolist()
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
    # Two inputs of the same name in two folders: shards named from their paths, both kept.
    twin_root = os.path.join(tmp, "corpora")
    for sub in ("a", "b"):
        os.makedirs(os.path.join(twin_root, sub))
        shutil.copy(LICENSES[0], os.path.join(twin_root, sub, "notes.txt"))
    with open(os.path.join(twin_root, "b", "notes.txt"), "a") as f:
        f.write("one more line\n")
    twins = os.path.join(tmp, "twins")
    r = run([args.prepare, "--out", twins, "--tokenizer", "bytes",
             os.path.join(twin_root, "a", "notes.txt"), os.path.join(twin_root, "b", "notes.txt")])
    a_ids, b_ids = shards_of(twins, "a_notes"), shards_of(twins, "b_notes")
    check(r.returncode == 0 and a_ids is not None and b_ids is not None and
          bytes(b_ids.astype(np.uint8).tolist()) ==
          open(os.path.join(twin_root, "b", "notes.txt"), "rb").read(),
          f"two inputs of the same name: shards a_notes-*, b_notes-* ({sorted(os.listdir(twins))})")
    # The same file twice (here through a link): read once.
    link = os.path.join(tmp, "link.txt")
    os.symlink(LICENSES[0], link)
    once = os.path.join(tmp, "once")
    r = run([args.prepare, "--out", once, "--tokenizer", "bytes", LICENSES[0], link])
    check(r.returncode == 0 and "read once" in r.stderr and
          len(glob.glob(os.path.join(once, "*.bin"))) == 1, "the same file twice is read once")

    # gzip is read decompressed; other compressed and binary files are refused by content,
    # before any work, and a failure leaves the output folder as it was.
    gz = os.path.join(tmp, "GPL-3.gz")
    subprocess.run(f"gzip -c /usr/share/common-licenses/GPL-3 > {gz}", shell=True, check=True)
    gz_out = os.path.join(tmp, "gz")
    r = run([args.prepare, "--out", gz_out, "--tokenizer", "bytes", gz])
    got = shards_of(gz_out, "GPL-3")
    check(r.returncode == 0 and got is not None and
          bytes(got.astype(np.uint8).tolist()) == open("/usr/share/common-licenses/GPL-3", "rb").read(),
          "a .gz input is read decompressed: its shard holds the text's bytes")
    before = sorted(os.listdir(gz_out)), open(os.path.join(gz_out, "meta.json")).read()
    xz = os.path.join(tmp, "GPL-3.xz")
    subprocess.run(f"xz -c /usr/share/common-licenses/GPL-3 > {xz}", shell=True, check=True)
    binary = os.path.join(tmp, "data.bin.txt")
    with open(binary, "wb") as f:
        f.write(bytes(range(256)) * 64)
    for bad, needle in ((xz, "compressed with xz"), (binary, "is not text")):
        r = run([args.prepare, "--out", gz_out, "--vocab-size", "300", LICENSES[0], bad])
        after = sorted(os.listdir(gz_out)), open(os.path.join(gz_out, "meta.json")).read()
        check(r.returncode == 2 and bad in r.stderr and needle in r.stderr and
              "training a" not in r.stderr and after == before and
              not [d for d in os.listdir(tmp) if ".preparing." in d],
              f"{os.path.basename(bad)} refused before any work, the output folder as it was "
              f"({r.stderr.strip()[:140]})")
    # A vocabulary too small for the text's characters: said in dtrain-prepare's options.
    r = run([args.prepare, "--out", os.path.join(tmp, "small_vocab"), "--vocab-size", "64",
             "/usr/share/common-licenses/GPL-3"])
    check(r.returncode == 2 and "--vocab-size 64 is too small" in r.stderr and
          "character_coverage" not in r.stderr and not os.path.exists(os.path.join(tmp, "small_vocab")),
          f"a vocabulary too small is said in dtrain-prepare's terms ({r.stderr.strip()[-160:]})")
    foreign = os.path.join(tmp, "foreign")
    os.makedirs(foreign)
    open(os.path.join(foreign, "mine.txt"), "w").write("keep me")
    r = run([args.prepare, "--out", foreign, "--tokenizer", "bytes", LICENSES[0]])
    check(r.returncode == 2 and "did not write" in r.stderr and
          os.listdir(foreign) == ["mine.txt"], "an output folder of other files is refused")

    # configs/llama_tokens.yaml on the prepared tokens, 2 ranks.
    def train(*sets, steps=30):
        argv = [args.launcher, "--nproc-per-node", "2", "--master-port", "0", "--",
                args.trainer, "--config", "configs/llama_tokens.yaml",
                "--set", f"data.path={sp_dir}/*.bin", "--set", f"train.steps={steps}",
                "--set", "model.seq_len=32", "--set", "train.batch_size=4",
                "--set", "train.warmup_steps=5", "--set", "train.eval_every=15",
                "--set", "logging.every_steps=10", "--set", "logging.progress_bar=false",
                "--set", f"logging.metrics_file={tmp}/metrics.jsonl", "--set",
                "logging.sample_tokens=8", "--set", "checkpoint.dir="]
        for s in sets:
            argv += ["--set", s]
        r = run(argv, timeout=600)
        return r.returncode, r.stdout + r.stderr

    # A pretrained checkpoint (vocabulary 515) and tokens of another tokenizer (2048): the
    # message names that problem and its fix, not model.vocab_size.
    from transformers import LlamaConfig, LlamaForCausalLM
    hf_dir = os.path.join(tmp, "pretrained")
    LlamaForCausalLM(LlamaConfig(vocab_size=515, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=1, num_attention_heads=4,
                                 max_position_embeddings=64)).save_pretrained(hf_dir)
    rc, log = train(f"model.pretrained={hf_dir}", "model.vocab_size=null",
                    "model.hidden_size=null", "model.intermediate_size=null",
                    "model.num_hidden_layers=null", "model.num_attention_heads=null",
                    "model.num_key_value_heads=null", "model.max_position_embeddings=null",
                    "model.tie_word_embeddings=null", steps=2)
    check(rc == 2 and "these tokens come from another tokenizer than model.pretrained's" in log and
          "vocabulary is 515" in log and "set model.vocab_size" not in log,
          "pretrained vocabulary 515, tokens of 2048: the other tokenizer is named, and the fix")

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
