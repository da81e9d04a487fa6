"""scripts/plot on metrics files written by real dtrain-train runs.

An fp32 run plots loss, grad norm, lr, tokens/s and communication hidden, and no loss-scale
panel; an fp16 run whose loss overflows (DTRAIN_TEST_NAN_FROM_STEP) adds the scale panel with
its skipped steps, and says how many in the title; the title names the model, strategy,
precision and ranks; a config path with a quote and a backslash is escaped in the JSON;
two runs overlay into one PNG; a file that is not a metrics file, a
missing file and an empty one end with a one-line error, not a traceback.
Usage: plot_test.py --trainer PATH --plot scripts/plot_metrics.py
"""
import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


def train(trainer, config, metrics, extra, env=None):
    cmd = [trainer, "--config", config, "--set", "train.steps=6", "--set", "logging.every_steps=1",
           "--set", "logging.progress_bar=false", "--set", f"logging.metrics_file={metrics}"]
    for e in extra:
        cmd += ["--set", e]
    r = subprocess.run(cmd, capture_output=True, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
    if r.returncode != 0:
        sys.exit(f"dtrain-train failed:\n{r.stdout}{r.stderr}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--trainer", required=True)
    p.add_argument("--plot", required=True)
    args = p.parse_args()
    spec = importlib.util.spec_from_file_location("plot_metrics", args.plot)
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    tmp = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
    m32, m16 = os.path.join(tmp, "fp32.jsonl"), os.path.join(tmp, "fp16.jsonl")
    # The fp32 config from a path with a quote and a backslash, which the metrics file's JSON
    # must escape.
    odd = os.path.join(tmp, 'odd "name" \\ here.yaml')
    shutil.copyfile("configs/tiny/ddp_fp32.yaml", odd)
    train(args.trainer, odd, m32, [])
    train(args.trainer, "configs/tiny/ddp_fp16.yaml", m16,
          ["precision.scaler.min_scale=0", "precision.scaler.max_consecutive_skips=0"],
          {"DTRAIN_TEST_NAN_FROM_STEP": "3:0"})

    fp32 = [(m32, *plot.load(m32))]
    check(fp32[0][1].get("config") == odd,
          f"the run line names the config path as given ({fp32[0][1]})")
    panels, scaled = plot.choose_panels(fp32)
    keys = [k for k, _ in panels]
    check(keys == ["loss", "grad_norm", "lr", "tokens_per_s", "comm_hidden"],
          f"fp32: loss, grad norm, lr, tokens/s, comm hidden, no scale panel ({keys})")
    title = plot.title_of(fp32, scaled)
    for want in ("TransformerLM", "ddp", "fp32", "1 rank(s)"):
        check(want in title, f"fp32 title names {want!r} ({title})")

    fp16 = [(m16, *plot.load(m16))]
    panels, scaled = plot.choose_panels(fp16)
    check([k for k, _ in panels][-1] == "scale", "fp16 with skipped steps: a loss-scale panel")
    title = plot.title_of(fp16, scaled)
    check("fp16" in title and "4 skipped step(s)" in title, f"fp16 title counts the skips ({title})")

    out = os.path.join(tmp, "both.png")
    r = subprocess.run([sys.executable, args.plot, m32, m16, "-o", out], capture_output=True,
                       text=True)
    check(r.returncode == 0 and f"wrote {out}" in r.stdout, f"two runs overlaid ({r.stderr})")
    with open(out, "rb") as f:
        check(f.read(8) == b"\x89PNG\r\n\x1a\n", "the output is a PNG")

    empty = os.path.join(tmp, "empty.jsonl")
    open(empty, "w").close()
    for path, want in (("configs/tiny/ddp_fp32.yaml", "is not a JSON line (is this a metrics file?)"),
                       (os.path.join(tmp, "missing.jsonl"), "cannot read"),
                       (empty, "has no step rows")):
        r = subprocess.run([sys.executable, args.plot, path], capture_output=True, text=True)
        check(r.returncode == 1 and want in r.stderr and "Traceback" not in r.stderr,
              f"{os.path.basename(path)}: one-line error '{want}' ({r.stderr.strip()})")
    print(f"{len(failures)} check(s) failed" if failures else "all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
