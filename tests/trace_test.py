"""logging.trace on real multi-rank runs: the Chrome trace-event file is well formed and its
events nest, and scripts/plot draws it.

Runs the tiny DDP (fp32, bucket_cap_mb small enough for several buckets, 2 micro-batches)
and FSDP (bf16) configs at 2 ranks under dtrain-launch with steps 3-4 traced, then checks:
the file is JSON with a traceEvents list; every complete event has name, cat, ph, ts, dur
>= 0, pid and tid; each rank (pid 0 and 1) has exactly the traced steps; on every track the
events nest (none overlaps another partially); each step holds its forwards, backwards (one
per micro-batch) and the optimizer; DDP's buckets and FSDP's units name their collectives,
which run on communicator tracks with their dtype, size and queueing time; every flow arrow
starts at its collective's enqueue and ends at its start; FSDP has per-unit forward and
backward events; and scripts/plot writes a PNG of each.
Usage: trace_test.py --launcher PATH --trainer PATH --plot scripts/plot_metrics.py
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


def run(args, config, trace, extra):
    cmd = [args.launcher, "--nproc-per-node", "2", "--master-port", "0", "--", args.trainer,
           "--config", config, "--set", "train.steps=5", "--set", "logging.progress_bar=false",
           "--set", "logging.metrics_file=", "--set", f"logging.trace={trace}",
           "--set", "logging.trace_start=3", "--set", "logging.trace_steps=2"]
    for e in extra:
        cmd += ["--set", e]
    r = subprocess.run(cmd, capture_output=True, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    if r.returncode != 0:
        sys.exit(f"training failed ({' '.join(cmd)}):\n{r.stdout}{r.stderr}")
    check(f"trace: {trace}" in r.stdout + r.stderr, f"{config}: the log names the trace file")


def nests(events):
    """Whether events (on one track) never overlap partially."""
    stack = []
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        start, end = e["ts"], e["ts"] + e["dur"]
        while stack and stack[-1] <= start:
            stack.pop()
        if stack and end > stack[-1]:
            return False, e["name"]
        stack.append(end)
    return True, None


def inside(e, outer):
    return outer["ts"] <= e["ts"] and e["ts"] + e["dur"] <= outer["ts"] + outer["dur"]


def check_trace(path, strategy):
    try:
        doc = json.load(open(path))
    except (OSError, json.JSONDecodeError) as e:
        check(False, f"{strategy}: {path} is JSON ({e})")
        return
    events = doc.get("traceEvents")
    check(isinstance(events, list) and events, f"{strategy}: traceEvents is a non-empty list")
    spans = [e for e in events if e.get("ph") == "X"]
    keys_ok = all(all(k in e for k in ("name", "cat", "ts", "dur", "pid", "tid")) and
                  e["dur"] >= 0 for e in spans)
    check(keys_ok, f"{strategy}: every complete event has name, cat, ts, dur >= 0, pid, tid "
                   f"({len(spans)} events)")
    check({e["pid"] for e in spans} == {0, 1}, f"{strategy}: events from ranks 0 and 1")
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    for (pid, tid) in sorted({(e["pid"], e["tid"]) for e in spans}):
        ok, bad = nests([e for e in spans if (e["pid"], e["tid"]) == (pid, tid)])
        check(ok, f"{strategy}: rank {pid} track '{names.get((pid, tid), tid)}' nests"
                  + ("" if ok else f" ('{bad}' overlaps partially)"))
    for pid in (0, 1):
        mine = [e for e in spans if e["pid"] == pid]
        steps = sorted(e["name"] for e in mine if e["cat"] == "step")
        check(steps == ["step 3", "step 4"], f"{strategy}: rank {pid} traced steps 3 and 4 ({steps})")
        for s in (e for e in mine if e["cat"] == "step"):
            inner = sorted(e["name"] for e in mine if e["cat"] == "compute" and e["tid"] == 0
                           and inside(e, s))
            check(inner == ["backward 0", "backward 1", "forward 0", "forward 1", "optimizer"],
                  f"{strategy}: rank {pid} {s['name']} holds 2 forwards, 2 backwards and the "
                  f"optimizer ({inner})")
        comm = [e for e in mine if e["cat"] == "comm"]
        check(comm and all(names.get((pid, e["tid"]), "").startswith("comm ") for e in comm),
              f"{strategy}: rank {pid}'s {len(comm)} collectives run on communicator tracks")
        args_ok = all(all(k in e.get("args", {}) for k in
                          ("op", "dtype", "elements", "bytes", "queued_us", "enqueued_ts"))
                      and e["args"]["queued_us"] >= 0 for e in comm)
        check(args_ok, f"{strategy}: rank {pid}'s collectives carry op, dtype, size and queueing")
        label = "ddp bucket " if strategy == "ddp" else "fsdp unit "
        labelled = [e for e in comm if e["name"].startswith(label)]
        check(len(labelled) >= 2, f"{strategy}: rank {pid}: {len(labelled)} collectives named "
                                  f"'{label}...'")
        flows = {}
        for e in events:
            if e.get("ph") in ("s", "f") and e.get("pid") == pid:
                flows.setdefault(e["id"], {})[e["ph"]] = e
        starts = {e["ts"] for e in comm}
        enqueues = {e["args"]["enqueued_ts"] for e in comm}
        flows_ok = bool(flows) and all(
            "s" in f and "f" in f and f["s"]["ts"] <= f["f"]["ts"] and f["s"]["ts"] in enqueues
            and f["f"]["ts"] in starts for f in flows.values())
        check(flows_ok, f"{strategy}: rank {pid}: {len(flows)} flow arrows, each from an "
                        f"enqueue to its collective's start")
        if strategy == "fsdp":
            fwd = [e for e in mine if e["cat"] == "unit" and e["name"].startswith("forward ")]
            bwd = [e for e in mine if e["cat"] == "unit" and e["name"].startswith("backward ")]
            check(len(fwd) >= 2 * 2 and len(bwd) >= 2 * 2,
                  f"{strategy}: rank {pid}: per-unit forwards ({len(fwd)}) and backwards "
                  f"({len(bwd)}) over 2 steps")
            fwd_in = all(any(inside(u, f) for f in mine if f["cat"] == "compute"
                             and f["name"].startswith("forward ")) for u in fwd)
            check(fwd_in, f"{strategy}: rank {pid}: each unit's forward lies in a forward")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--launcher", required=True)
    p.add_argument("--trainer", required=True)
    p.add_argument("--plot", required=True)
    args = p.parse_args()
    tmp = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
    for strategy, config, extra in [
            ("ddp", "configs/tiny/ddp_fp32.yaml", ["parallel.bucket_cap_mb=0.05"]),
            ("fsdp", "configs/tiny/fsdp_bf16.yaml", [])]:
        trace = os.path.join(tmp, strategy, "trace.json")
        run(args, config, trace, extra)
        check_trace(trace, strategy)
        png = os.path.join(tmp, f"{strategy}.png")
        r = subprocess.run([sys.executable, args.plot, trace, "-o", png], capture_output=True,
                           text=True)
        check(r.returncode == 0 and os.path.getsize(png) > 10000,
              f"{strategy}: scripts/plot draws the trace ({r.stdout.strip()}{r.stderr.strip()})")
    if failures:
        sys.exit(f"{len(failures)} check(s) failed")
    print("all checks passed")


if __name__ == "__main__":
    main()
