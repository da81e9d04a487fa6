"""Elastic jobs (dtrain-launch --nnodes MIN:MAX) on three "nodes" in Linux network namespaces.

The nodes are those of tests/multinode_test.py (198.51.100.1-3, each its own host name), joined
by a bridge in a fourth namespace. One rank per node trains the tiny DDP config, checkpointing
every 4 steps, each rank recording the samples it draws (DTRAIN_TEST_RECORD_SAMPLES).

  grow-and-shrink  --nnodes 2:3 --max-restarts 2, all three nodes: node 2's dtrain-launch is
                   SIGKILLed mid-run, and nodes 0 and 1 restart without it (restart 1 of 2),
                   from the last checkpoint, at 2 ranks. node 2's launcher is started again:
                   it joins, the running attempt stops gracefully (every rank saves at the
                   same step) and the job restarts at 3 ranks, a restart not counted against
                   --max-restarts, and finishes. Every node exits 0. The samples of the steps
                   that make up the final run (each step's last attempt) are each drawn once:
                   exactly those a one-rank run draws over as many samples.
  below-minimum    --nnodes 2:3 with two nodes: a third launcher with another
                   --nproc-per-node is refused (exit 2, naming both values) and the job goes
                   on; then node 1's launcher is SIGKILLed, and node 0 ends the job (exit 1):
                   one node remains, fewer than MIN.
Nothing may be left running in the namespaces. Needs root; prints "SKIPPED: <reason>" and
exits 0 where namespaces cannot be made. The namespaces are removed on exit, whatever happens.
Usage: elastic_test.py --launcher PATH --trainer PATH
"""
import glob
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import multinode_test as mn  # noqa: E402

STEPS = 30
LIMIT_S = 240  # any one job


class Job:
    """One launcher per node, each node's output in a file."""

    def __init__(self, nodes, args, out, launch, env):
        self.nodes, self.args, self.out = nodes, args, out
        self.launch, self.env = launch, env
        self.procs, self.logs = {}, {}
        self.deadline = time.time() + LIMIT_S

    def start(self, node, launch=()):
        argv = [self.args.launcher, "--node-rank", str(node), "--master-addr", mn.HOSTS[0],
                "--master-port", str(mn.PORT), "--run-id", "elastic", "--grace-period", "5"]
        argv += list(self.launch) + list(launch) + ["--"] + train_args(self.args, self.out)
        log = f"{self.out}/node{node}.{len(self.logs)}.log"
        self.logs[node] = log
        with open(log, "w") as f:
            self.procs[node] = subprocess.Popen(self.nodes.command(node, argv), env=self.env,
                                                stdout=f, stderr=subprocess.STDOUT, text=True)
        return self.procs[node]

    def text(self):
        out = ""
        for log in sorted(glob.glob(f"{self.out}/node*.log")):
            with open(log) as f:
                out += f"==== {os.path.basename(log)}\n" + f.read()
        return out

    def wait_for(self, what, ok, limit_s=90):
        deadline = min(self.deadline, time.time() + limit_s)
        while time.time() < deadline:
            if ok():
                return True
            if all(p.poll() is not None for p in self.procs.values()):
                return ok()
            time.sleep(0.1)
        print(f"timed out waiting for {what}", flush=True)
        return False

    def finish(self):
        for p in self.procs.values():
            try:
                p.wait(timeout=max(1, self.deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        return {n: p.returncode for n, p in self.procs.items()}


def train_args(args, out):
    return [args.trainer, "--config", "configs/tiny/ddp_fp32.yaml",
            "--set", f"train.steps={STEPS}", "--set", "logging.every_steps=1",
            "--set", "logging.progress_bar=false", "--set", "logging.sample_tokens=0",
            "--set", "train.eval_every=0", "--set", "parallel.backend=gloo",
            "--set", "parallel.timeout_s=30",
            "--set", f"logging.metrics_file={out}/metrics.jsonl",
            "--set", f"checkpoint.dir={out}/ckpt", "--set", "checkpoint.every_steps=4",
            "--set", "checkpoint.keep=50"]


def logged_steps(out):
    path = f"{out}/metrics.jsonl"
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line)["step"] for line in f if '"step"' in line and '"loss"' in line]


def final_samples(prefix):
    """The sample ids of the run's final history: each data step as its last attempt drew it,
    over every rank of that attempt (records <prefix>.<attempt>.<rank>)."""
    by_attempt = {}
    for path in glob.glob(prefix + ".*.*"):
        attempt = int(path.split(".")[-2])
        steps = by_attempt.setdefault(attempt, {})
        with open(path) as f:
            for line in f:
                w = [int(x) for x in line.split()]
                steps.setdefault(w[0], []).extend(w[2:])
    ids, last = [], {}
    for attempt in sorted(by_attempt):
        for step in by_attempt[attempt]:
            last[step] = attempt
    for step in sorted(last):
        ids += by_attempt[last[step]][step]
    return ids, {a: sorted(s) for a, s in by_attempt.items()}


def main():
    ready = mn.setup(3, "dtrain_elastic_")
    if ready is None:
        return 0
    args, nodes, work = ready
    failures = []
    started = time.time()

    def check(ok, what, output=""):
        print(("ok   " if ok else "FAIL ") + what, flush=True)
        if not ok:
            failures.append(what)
            print(output[-8000:], flush=True)

    def launcher_lines(text):
        return "\n".join(l for l in text.splitlines() if "dtrain-launch]" in l or l.startswith("===="))

    # ---- grow-and-shrink ----
    out = f"{work}/grow"
    os.makedirs(out)
    env = mn.base_env()
    env["DTRAIN_TEST_RECORD_SAMPLES"] = f"{out}/samples"
    env["DTRAIN_TEST_SLOW_RANK"] = "250:0"  # 4 steps a second: time to act mid-run
    job = Job(nodes, args, out, ["--nnodes", "2:3", "--nproc-per-node", "1", "--max-restarts",
                                 "2", "--elastic-wait", "10"], env)
    for node in range(3):
        job.start(node)
    t0 = time.time()
    ok = job.wait_for("step 6 at 3 nodes", lambda: max(logged_steps(out), default=0) >= 6)
    check(ok and "starting with 3 of --nnodes 2:3 node(s): node 0, 1, 2" in job.text(),
          "grow-and-shrink: the job starts with all 3 nodes", job.text())
    job.procs[2].kill()  # node 2's dtrain-launch; its rank dies with it
    job.procs[2].wait()
    killed_at = max(logged_steps(out), default=0)
    restarted = "restarting every node's ranks with 2 node(s)"
    ok = job.wait_for("the restart at 2 nodes", lambda: restarted in job.text())
    before = len(logged_steps(out))
    ok = ok and job.wait_for("3 steps at 2 nodes", lambda: len(logged_steps(out)) >= before + 3)
    check(ok, f"grow-and-shrink: node 2 lost at step {killed_at}: nodes 0 and 1 restart "
          f"without it ({time.time() - t0:.1f} s)", job.text())
    job.start(2)  # started again: it joins, and the job grows back
    codes = job.finish()
    text = job.text()
    print(launcher_lines(text), flush=True)
    steps = logged_steps(out)
    check(codes == {0: 0, 1: 0, 2: 0} and max(steps, default=0) == STEPS,
          f"grow-and-shrink: every node exits 0 and the run reaches step {STEPS} (exit codes "
          f"{codes}, last step {max(steps, default=0)}, {time.time() - t0:.1f} s)", text)
    node0 = open(job.logs[0] if os.path.exists(job.logs[0]) else os.devnull).read()
    check("node 2 is lost: its dtrain-launch closed the connection" in node0
          and "with 2 node(s), this one as node slot 0 (restart 1 of 2: node 2 is lost" in node0
          and "node 2 joins the job: stopping attempt 1 to restart with 3 node(s)" in node0
          and "with 3 node(s), this one as node slot 0 (not counted against --max-restarts: "
              "node 2 joined" in node0,
          "grow-and-shrink: node 0 names the lost node, the restart it cost (1 of 2) and the "
          "join, not counted", text)
    saved = "checkpoint saved: resume with the same command" in text
    resumed = text.count("resumed from ")
    check(saved and resumed >= 2 and "this run has 3" in text and "this run has 2" in text,
          f"grow-and-shrink: the join's stop saves a checkpoint, and both restarts resume "
          f"from one, resharded (3 ranks, then 2, then 3; {resumed} resumes)", text)
    ids, per_attempt = final_samples(f"{out}/samples")
    # The reference: one rank drawing as many samples, 8 per step.
    ref_out = f"{work}/one"
    os.makedirs(ref_out)
    ref_env = mn.base_env()
    ref_env["DTRAIN_TEST_RECORD_SAMPLES"] = f"{ref_out}/samples"
    ref = subprocess.run([args.launcher, "--nproc-per-node", "1", "--master-port", "0", "--"]
                         + train_args(args, ref_out)[:-6]
                         + ["--set", f"train.steps={len(ids) // 8}"],
                         env=ref_env, capture_output=True, text=True, timeout=LIMIT_S)
    one, _ = final_samples(f"{ref_out}/samples")
    repeated = len(ids) - len(set(ids))
    check(ref.returncode == 0 and len(ids) % 8 == 0 and len(one) == len(ids)
          and len(set(one)) == len(one) and sorted(ids) == sorted(one),
          f"grow-and-shrink: the final run's {len(ids)} samples over {len(per_attempt)} "
          f"attempts: {repeated} repeated, {len(set(one) - set(ids))} of one rank's "
          f"{len(one)} never drawn", ref.stdout[-3000:] + ref.stderr[-3000:])
    left = []
    for _ in range(50):
        left = mn.namespace_pids(nodes)
        if not left:
            break
        time.sleep(0.1)
    check(not left, f"grow-and-shrink: nothing left running in the namespaces ({left})")

    # ---- below-minimum ----
    out = f"{work}/minimum"
    os.makedirs(out)
    env = mn.base_env()
    env["DTRAIN_TEST_SLOW_RANK"] = "400:0"  # 12 s for the run: it is still going when node 1 dies
    job = Job(nodes, args, out, ["--nnodes", "2:3", "--max-restarts", "2", "--elastic-wait",
                                 "1"], env)
    job.start(0, ["--nproc-per-node", "1"])
    job.start(1, ["--nproc-per-node", "1"])
    ok = job.wait_for("step 3 at 2 nodes", lambda: max(logged_steps(out), default=0) >= 3)
    odd = job.start(2, ["--nproc-per-node", "2"])
    try:
        odd.wait(timeout=60)
    except subprocess.TimeoutExpired:
        odd.kill()
        odd.wait()
    refused = open(job.logs[2]).read()
    check(ok and odd.returncode == 2 and "has --nproc-per-node 2, node 0 1" in refused
          and job.procs[0].poll() is None,
          f"below-minimum: a node with another --nproc-per-node is refused (exit "
          f"{odd.returncode}) and the job goes on", job.text())
    del job.procs[2]
    t0 = time.time()
    job.procs[1].kill()
    codes = job.finish()
    text = job.text()
    print(launcher_lines(text), flush=True)
    check(codes[0] == 1 and "1 node(s) remain, fewer than the 2 --nnodes 2:3 needs" in text
          and "restarting" not in text,
          f"below-minimum: node 1 lost, node 0 ends the job naming the minimum (exit "
          f"{codes[0]}, {time.time() - t0:.1f} s)", text)

    print(f"elastic: {len(failures)} failure(s), {time.time() - started:.0f} s", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
