#!/usr/bin/env python3
"""Compares two training trajectories written as JSON ({"loss": [...], "scale": [...]}).

    compare_trajectories.py A.json B.json --rtol 1e-5 [--same-scales]

Fails (exit 1) when any step's loss differs by more than rtol relative to B's, or, with
--same-scales, when the loss-scale trajectories are not identical. Prints the worst step.
"""
import argparse
import json
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--rtol", type=float, required=True)
    ap.add_argument("--same-scales", action="store_true")
    args = ap.parse_args()
    a, b = json.load(open(args.a)), json.load(open(args.b))
    if len(a["loss"]) != len(b["loss"]) or not a["loss"]:
        sys.exit(f"different or empty trajectories: {len(a['loss'])} vs {len(b['loss'])} steps")
    rel = [abs(x - y) / abs(y) for x, y in zip(a["loss"], b["loss"])]
    worst = max(range(len(rel)), key=rel.__getitem__)
    print(f"{len(rel)} steps, max relative loss difference {rel[worst]:.3g} at step {worst + 1} "
          f"({a['loss'][worst]!r} vs {b['loss'][worst]!r}; rtol {args.rtol:g})")
    ok = rel[worst] <= args.rtol
    if args.same_scales:
        same = [float(x) for x in a["scale"]] == [float(y) for y in b["scale"]]
        changes = sum(1 for i in range(1, len(b["scale"])) if b["scale"][i] != b["scale"][i - 1])
        print(f"scale trajectories {'identical' if same else 'DIFFER'} ({changes} changes, "
              f"skipped steps {a.get('skipped')} vs {b.get('skipped')}): {b['scale']}")
        if not same:
            print(f"  {a['scale']}")
        ok = ok and same
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
