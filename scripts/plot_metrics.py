#!/usr/bin/env python3
"""Plots a run's loss and loss scale from its metrics file (logging.metrics_file, JSON lines).

    .venv/bin/python scripts/plot_metrics.py runs/default/metrics.jsonl [out.png]
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    path = sys.argv[1]
    out = sys.argv[2] if len(sys.argv) > 2 else path.rsplit(".", 1)[0] + ".png"
    rows = [json.loads(line) for line in open(path) if line.strip()]
    if not rows:
        sys.exit(f"{path}: no metrics")
    steps = [r["step"] for r in rows]
    fig, (ax_loss, ax_scale) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    ax_loss.plot(steps, [r["loss"] for r in rows], marker=".")
    ax_loss.set_ylabel("loss (mean over ranks)")
    ax_loss.grid(alpha=0.3)
    ax_scale.plot(steps, [r["scale"] for r in rows], marker=".", color="tab:orange")
    ax_scale.set_yscale("log", base=2)
    ax_scale.set_ylabel("loss scale")
    ax_scale.set_xlabel("step")
    ax_scale.grid(alpha=0.3)
    skipped = [r["step"] for i, r in enumerate(rows) if i and r["skipped"] > rows[i - 1]["skipped"]]
    for s in skipped:
        ax_scale.axvline(s, color="red", alpha=0.3)
    fig.suptitle(f"{path}: {rows[-1]['skipped']} skipped step(s)")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
