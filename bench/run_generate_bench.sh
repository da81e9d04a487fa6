#!/usr/bin/env bash
# Generation speed: dtrain-generate (with its KV cache, and without) beside transformers'
# generate() on the same Hugging Face Llama, greedy, fp32, on this CPU, in alternating rounds.
# Prints tokens per second of each (the prompt's forward included) and the ratios.
#   bench/run_generate_bench.sh [ROUNDS] [NEW_TOKENS] [THREADS]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3} new=${2:-128} threads=${3:-2}
scripts/bootstrap >/dev/null
log=$(mktemp)
bazel build --config=ci //framework:dtrain-generate >"$log" 2>&1 || { cat "$log"; exit 1; }
rm -f "$log"
OMP_NUM_THREADS=$threads .venv/bin/python - "$(bazel info --config=ci bazel-bin 2>/dev/null)" \
  "$rounds" "$new" "$threads" <<'PY'
import statistics, subprocess, sys, tempfile, time
import torch
from transformers import LlamaConfig, LlamaForCausalLM

bin_dir, rounds, new, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(threads)
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                  tie_word_embeddings=False, attn_implementation="sdpa")
model = LlamaForCausalLM(cfg).eval()
params = sum(p.numel() for p in model.parameters())
prompt = torch.randint(0, 32000, (16,), generator=torch.Generator().manual_seed(1)).tolist()
with tempfile.TemporaryDirectory() as d:
    model.save_pretrained(d)
    def dtrain(cache):
        argv = [f"{bin_dir}/framework/dtrain-generate", "--hf", d, "--prompt-ids",
                " ".join(map(str, prompt)), "--max-new-tokens", str(new)]
        if not cache:
            argv.append("--no-cache")
        r = subprocess.run(argv, capture_output=True, text=True, check=True,
                           env={"OMP_NUM_THREADS": str(threads), "PATH": "/usr/bin:/bin"})
        # "N token(s) in S s (...)": dtrain-generate's own timing of the tokens.
        secs = float(r.stderr.split(" token(s) in ")[1].split(" s ")[0])
        return new / secs, r.stdout.split()
    def hf():
        with torch.no_grad():
            x = torch.tensor([prompt])
            t = time.perf_counter()
            out = model.generate(x, max_new_tokens=new, do_sample=False, use_cache=True,
                                 pad_token_id=0, eos_token_id=None)
            secs = time.perf_counter() - t
        return new / secs, [str(i) for i in out[0, len(prompt):].tolist()]
    hf()  # warm up
    runs = {"dtrain-generate, KV cache": [], "dtrain-generate, no cache": [],
            "transformers generate(), KV cache": []}
    same = True
    for _ in range(rounds):
        a, ta = dtrain(True)
        b, tb = dtrain(False)
        c, tc = hf()
        runs["dtrain-generate, KV cache"].append(a)
        runs["dtrain-generate, no cache"].append(b)
        runs["transformers generate(), KV cache"].append(c)
        same = same and ta == tc and tb == tc
print(f"Llama {params / 1e6:.1f}M parameters (hidden 512, 8 layers, GQA 8/4, vocab 32000), fp32, "
      f"greedy, 16-token prompt, {new} new tokens, {threads} thread(s), {rounds} alternating "
      f"rounds (median)\n")
print("| run | tokens/s | vs transformers |\n|---|---:|---:|")
ref = statistics.median(runs["transformers generate(), KV cache"])
for k, v in runs.items():
    print(f"| {k} | {statistics.median(v):.1f} | {statistics.median(v) / ref:.2f}x |")
print(f"\nthe same tokens in every run: {'yes' if same else 'NO'}")
PY
