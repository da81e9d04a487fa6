#!/usr/bin/env python3
"""Plots one or several runs from their metrics files (logging.metrics_file, JSON lines), or a
step timeline (logging.trace, Chrome trace-event JSON).

    scripts/plot runs/default/metrics.jsonl                      # -> runs/default/metrics.png
    scripts/plot runs/fp32/m.jsonl runs/bf16/m.jsonl runs/fp16/m.jsonl -o compare.png
    scripts/plot runs/default/trace.json                         # -> runs/default/trace.png

A timeline shows, per rank, the trainer's forward, backward and optimizer, FSDP units'
forward and backward, and each communicator's collectives as bars, with the traced steps
shaded.

Panels: training loss (validation loss dashed, where logged), gradient norm, learning rate,
tokens/s, the share of communication hidden behind compute, and, when a loss scaler ran, the
loss scale with skipped steps marked. Several runs are overlaid with a legend; the title
names each run's model, strategy, precision and ranks (the metrics file's first row).
"""
import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path):
    run, rows = {}, []
    try:
        lines = open(path).read().splitlines()
    except OSError as e:
        sys.exit(f"plot: cannot read {path}: {e.strerror}")
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            sys.exit(f"plot: {path}:{n} is not a JSON line (is this a metrics file?)")
        if "run" in row:
            run = row["run"]
        elif row.get("rolled_back"):
            # train.spike_guard went back to this step: the steps after it were discarded.
            rows = [r for r in rows if r["step"] <= row["step"]]
        elif "spike" in row:
            continue  # a warning's row, not a step's
        elif "step" in row and "loss" in row:
            rows.append(row)
    if not rows:
        sys.exit(f"plot: {path} has no step rows")
    return run, rows


def describe(run, path):
    if not run:
        return os.path.basename(os.path.dirname(os.path.abspath(path))) or path
    return (f"{run.get('model', '?')}, {run.get('strategy', '?')}, {run.get('precision', '?')}, "
            f"{run.get('ranks', '?')} rank(s) ({run.get('backend', '?')})")


def choose_panels(runs):
    """The panels for these runs: the loss scale only when a scaler changed it or skipped."""
    scaled = any(r.get("scale", 1) != 1 or r.get("skipped", 0) for _, _, rows in runs
                 for r in rows)
    panels = [("loss", "loss (mean over ranks)"), ("grad_norm", "gradient norm"),
              ("lr", "learning rate"), ("tokens_per_s", "tokens/s"),
              ("comm_hidden", "communication hidden (%)")]
    if scaled:
        panels.append(("scale", "loss scale"))
    return panels, scaled


def title_of(runs, scaled):
    if len(runs) == 1:
        path, run, rows = runs[0]
        skipped = rows[-1].get("skipped", 0)
        return f"{describe(run, path)}" + (f", {skipped} skipped step(s)" if scaled else "")
    return f"{len(runs)} runs of {runs[0][1].get('model', 'a model')}"


def is_trace(path):
    try:
        with open(path) as f:
            head = f.read(64)
    except OSError as e:
        sys.exit(f"plot: cannot read {path}: {e.strerror}")
    return head.lstrip().startswith('{"traceEvents"')


def plot_trace(path, out):
    try:
        doc = json.load(open(path))
    except json.JSONDecodeError as e:
        sys.exit(f"plot: {path} is not JSON ({e})")
    events = doc.get("traceEvents", [])
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
              if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    if not spans:
        sys.exit(f"plot: {path} holds no events (were the traced steps run?)")
    t0 = min(e["ts"] for e in spans)
    ranks = sorted({e["pid"] for e in spans})
    rows = []  # (rank, label, events)
    for r in ranks:
        mine = [e for e in spans if e["pid"] == r]
        rows.append((r, "compute", [e for e in mine if e["cat"] == "compute"]))
        units = [e for e in mine if e["cat"] == "unit"]
        if units:
            rows.append((r, "units", units))
        for tid in sorted({e["tid"] for e in mine if e["cat"] == "comm"}):
            name = tracks.get((r, tid), f"track {tid}")
            rows.append((r, name, [e for e in mine if e["cat"] == "comm" and e["tid"] == tid]))
    # "input" and "weight": a zero-bubble pipeline's two halves of a backward.
    colors = {"forward": "#4c72b0", "backward": "#dd8452", "input": "#e5ae38",
              "weight": "#937860", "optimizer": "#55a868", "unit": "#8172b3", "comm": "#c44e52"}
    used = set()
    span_us = max(e["ts"] + e["dur"] for e in spans) - t0
    fig, ax = plt.subplots(figsize=(13, 0.55 * len(rows) + 1.6))
    for y, (r, label, evs) in enumerate(rows):
        for e in evs:
            kind = e["cat"] if e["cat"] in ("unit", "comm") else e["name"].split()[0]
            used.add(kind)
            ax.broken_barh([((e["ts"] - t0) / 1000, max(e["dur"], 1) / 1000)], (y - 0.4, 0.8),
                           color=colors.get(kind, "#999999"), alpha=0.85 if kind != "unit" else 0.6)
            # A pipeline's actions ("forward 2.5": stage 2, micro-batch 5) carry their numbers.
            parts = e["name"].split()
            if e["cat"] == "compute" and len(parts) == 2 and "." in parts[1] and \
                    e["dur"] > 0.012 * span_us:
                ax.text((e["ts"] - t0 + e["dur"] / 2) / 1000, y, parts[1], ha="center",
                        va="center", fontsize=7, color="white")
    for r in ranks:
        for e in spans:
            if e["pid"] == r and e["cat"] == "step":
                ax.axvspan((e["ts"] - t0) / 1000, (e["ts"] + e["dur"] - t0) / 1000,
                           color="#000000", alpha=0.04)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {r}: {label}" for r, label, _ in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.grid(axis="x", alpha=0.3)
    from matplotlib.patches import Patch
    shown = [k for k in colors if k in used or k in ("forward", "backward", "optimizer")]
    ax.legend(handles=[Patch(color=colors[k], label=k) for k in shown], fontsize=8,
              loc="upper right", ncol=len(shown))
    other = doc.get("otherData", {})
    ax.set_title(f"step timeline: {other.get('strategy', '?')} {other.get('precision', '')}, "
                 f"{len(ranks)} rank(s), steps {other.get('first_step', '?')}.."
                 f"{other.get('first_step', 0) + other.get('steps', 1) - 1} (shaded); "
                 f"{other.get('config', '')}", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")


def main():
    ap = argparse.ArgumentParser(
        prog="scripts/plot", description=__doc__.split("\n\n")[0],
        epilog="Example: scripts/plot runs/default/metrics.jsonl")
    ap.add_argument("metrics", nargs="+",
                    help="metrics files (JSON lines) of one or more runs, or one trace")
    ap.add_argument("-o", "--out", help="the PNG to write (default: beside the first file)")
    args = ap.parse_args()
    if is_trace(args.metrics[0]):
        if len(args.metrics) > 1:
            sys.exit("plot: a trace is plotted alone")
        plot_trace(args.metrics[0], args.out or os.path.splitext(args.metrics[0])[0] + ".png")
        return
    runs = [(path, *load(path)) for path in args.metrics]
    out = args.out or os.path.splitext(args.metrics[0])[0] + ".png"

    panels, scaled = choose_panels(runs)
    cols = 2
    nrows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(12, 3.2 * nrows), sharex=True)
    axes = axes.flatten()
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (path, run, rows) in enumerate(runs):
        color = colors[i % len(colors)]
        label = describe(run, path) if len(runs) == 1 else (
            f"{run.get('precision', '')} {run.get('strategy', '')}".strip() or path)
        steps = [r["step"] for r in rows]
        for ax, (key, _) in zip(axes, panels):
            values = [r.get(key) for r in rows]
            if key == "comm_hidden":
                values = [None if v is None else 100 * v for v in values]
            pts = [(s, v) for s, v in zip(steps, values) if v is not None]
            if not pts:
                continue
            ax.plot(*zip(*pts), marker=".", color=color, label=label)
            if key == "loss":
                val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
                if val:
                    ax.plot(*zip(*val), linestyle="--", marker="o", color=color,
                            label=f"{label} (validation)")
            if key == "scale":
                ax.set_yscale("log", base=2)
                for j in range(1, len(rows)):
                    if rows[j].get("skipped", 0) > rows[j - 1].get("skipped", 0):
                        ax.axvline(rows[j]["step"], color=color, alpha=0.3)
    for ax, (key, title) in zip(axes, panels):
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        if key == "scale":
            ax.text(0.01, 0.02, "vertical lines: skipped steps", transform=ax.transAxes,
                    fontsize=8, alpha=0.7)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    for ax in axes[max(0, len(panels) - cols):len(panels)]:
        ax.set_xlabel("step")
    axes[0].legend(fontsize=8)
    fig.suptitle(title_of(runs, scaled))
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
