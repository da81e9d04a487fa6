"""Faults injected into real training jobs: what ends, how fast, and what is left running.

Each case starts dtrain-train on the tiny DDP config under dtrain-launch (Gloo) or mpirun
(MPI), waits until the job is past its third step, and then:
  kill  SIGKILL, SIGSEGV or SIGTERM to one rank: every other rank ends within 5 s, the job
        exits non-zero, and the launcher names the dead rank;
  stop  SIGSTOP to one rank: the others raise TimeoutError naming the collective within the
        timeout + 5 s, and the whole job exits within the timeout + 10 s;
  launcher  SIGKILL to dtrain-launch itself: nothing of the job is left.
In every case no process of the job survives: the test records every descendant of the
launcher while the job runs (ranks, their children, mpirun's helpers) and checks each one
after the end. Every rank also starts a child (a `sleep`, through train.test_child), the
kind of process that used to outlive a killed launcher.

Prints one row per case (the table in docs/reliability.md) and exits non-zero if any failed.
Usage: faults_test.py --launcher PATH --trainer PATH --config PATH [--only NAME] [--no-mpi]
"""

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time

TIMEOUT_S = 6  # parallel.timeout_s of the stalled-rank cases


def descendants(root):
    """PIDs of every process below root (by parent pid), read from /proc."""
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rfind(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def rank_of(pid):
    """The rank a process of the job runs as, from its environment (None for helpers)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(
                kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            exe = os.path.basename(f.read().split(b"\0")[0])
    except OSError:
        return None
    if exe != b"dtrain-train":
        return None
    for key in (b"RANK", b"OMPI_COMM_WORLD_RANK"):
        if key in env:
            return int(env[key])
    return None


def steps_done(metrics):
    try:
        with open(metrics) as f:
            return sum(1 for line in f if '"step"' in line)
    except OSError:
        return 0


class Job:
    def __init__(self, args, kind, np, tmp, timeout_s):
        self.metrics = os.path.join(tmp, "metrics.jsonl")
        self.log = open(os.path.join(tmp, "log.txt"), "w+")
        train = [
            args.trainer, "--config", args.config,
            "--set", "train.steps=100000",
            "--set", "train.eval_every=0",
            "--set", f"parallel.timeout_s={timeout_s}",
            "--set", "logging.every_steps=1",
            "--set", "logging.progress_bar=false",
            "--set", f"logging.metrics_file={self.metrics}",
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1", DTRAIN_TEST_CHILD="sleep 1000")
        if kind == "launch":
            cmd = [args.launcher, "--nproc-per-node", str(np), "--master-port", "0",
                   "--grace-period", "3", "--backend", "gloo", "--"] + train
        else:
            env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                       OMPI_MCA_mpi_yield_when_idle="1")
            cmd = ["mpirun", "-np", str(np), "--oversubscribe", "--bind-to", "none",
                   "-x", "OMP_NUM_THREADS", "-x", "DTRAIN_TEST_CHILD",
                   "-x", "DTRAIN_BACKEND=mpi"] + train
        # Its own session: whatever happens, the test can end the whole job.
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.seen = set()
        self.ranks = {}

    def track(self):
        for pid in descendants(self.proc.pid):
            if pid not in self.seen:
                self.seen.add(pid)
            r = rank_of(pid)
            if r is not None and r not in self.ranks:
                self.ranks[r] = pid

    def wait_until_training(self, np, deadline_s=120):
        end = time.time() + deadline_s
        while time.time() < end:
            self.track()
            if steps_done(self.metrics) >= 3 and len(self.ranks) == np:
                return True
            if self.proc.poll() is not None:
                return False
            time.sleep(0.05)
        return False

    def wait_ranks_gone(self, pids, t0, limit_s):
        """Seconds from t0 until every pid in pids is gone, or None past limit_s."""
        while time.time() - t0 < limit_s:
            self.track()
            if not any(alive(p) for p in pids):
                return time.time() - t0
            time.sleep(0.02)
        return None

    def wait_exit(self, t0, limit_s):
        """Seconds from t0 until the job's launcher exits, or None past limit_s."""
        while time.time() - t0 < limit_s:
            self.track()
            if self.proc.poll() is not None:
                return time.time() - t0
            time.sleep(0.02)
        return None

    def output(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def cleanup(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        for p in self.seen:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        self.proc.wait()


def run_case(args, name, kind, np, fault, victim):
    """Runs one case; returns (ok, row, detail)."""
    tmp = tempfile.mkdtemp(prefix=name + ".", dir=os.environ.get("TEST_TMPDIR"))
    timeout_s = TIMEOUT_S if fault == "SIGSTOP" else 60
    job = Job(args, kind, np, tmp, timeout_s)
    problems = []
    detect = end = None
    try:
        if not job.wait_until_training(np):
            return False, f"{name}: never started training", job.output()
        t0 = time.time()
        if fault == "launcher":
            os.kill(job.proc.pid, signal.SIGKILL)
            end = job.wait_exit(t0, 10)
            detect = job.wait_ranks_gone(list(job.ranks.values()), t0, 10)
            if detect is None or detect > 5:
                problems.append(f"the ranks ended after {detect} s (limit 5)")
        else:
            victim_pid = job.ranks[victim]
            os.kill(victim_pid, getattr(signal, fault))
            others = [p for r, p in job.ranks.items() if r != victim]
            if fault == "SIGSTOP":
                detect = job.wait_ranks_gone(others, t0, TIMEOUT_S + 5 + 5)
                if detect is None or detect > TIMEOUT_S + 5:
                    problems.append(f"other ranks ended after {detect} s (limit {TIMEOUT_S + 5})")
                end = job.wait_exit(t0, TIMEOUT_S + 10 + 5)
                if end is None or end > TIMEOUT_S + 10:
                    problems.append(f"job exited after {end} s (limit {TIMEOUT_S + 10})")
            else:
                detect = job.wait_ranks_gone(others, t0, 10)
                if detect is None or detect > 5:
                    problems.append(f"other ranks ended after {detect} s (limit 5)")
                end = job.wait_exit(t0, 15)
        if end is None:
            problems.append("the job did not exit")
        code = job.proc.wait(timeout=30) if end is not None else None
        out = job.output()
        if fault != "launcher":
            if code == 0:
                problems.append("the job exited 0")
            if kind == "launch" and f"rank {victim} (pid {job.ranks[victim]})" not in out:
                problems.append(f"the launcher did not name rank {victim}")
            if kind == "mpi" and f"rank {victim} with PID" not in out and fault != "SIGSTOP":
                problems.append(f"mpirun did not name rank {victim}")
            if fault == "SIGSTOP" and "did not complete within" not in out:
                problems.append("no TimeoutError naming the collective")
        # Nothing of the job survives (a killed child may linger a moment as a zombie).
        time.sleep(0.2)
        survivors = [p for p in job.seen if alive(p)]
        deadline = time.time() + 5
        while survivors and time.time() < deadline:
            time.sleep(0.05)
            survivors = [p for p in job.seen if alive(p)]
        if survivors:
            problems.append(f"survivors: {survivors}")
        if len(job.seen) < 2 * np:
            problems.append(f"recorded only {len(job.seen)} processes for {np} ranks and their"
                            " children: the check would prove nothing")
        row = (f"| {'SIGKILL dtrain-launch' if fault == 'launcher' else f'{fault} rank {victim}'} | {kind} | "
               f"{np} | {detect:.2f} s | {end:.2f} s | exit {code} | {len(job.seen)} recorded, "
               f"{len(survivors)} left |" if end is not None and detect is not None else name)
        return not problems, row, "\n".join(problems) + ("\n" + out if problems else "")
    finally:
        job.cleanup()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launcher", required=True)
    p.add_argument("--trainer", required=True)
    p.add_argument("--config", required=True)
    p.add_argument("--only", default="", help="run only the cases whose name contains this")
    p.add_argument("--no-mpi", action="store_true", help="a build without MPI: skip mpirun")
    args = p.parse_args()
    args.launcher = os.path.abspath(args.launcher)
    args.trainer = os.path.abspath(args.trainer)
    cases = []
    for kind in ("launch",) if args.no_mpi else ("launch", "mpi"):
        for np in (2, 4):
            for fault in ("SIGKILL", "SIGSEGV", "SIGTERM"):
                cases.append((f"{kind}-np{np}-{fault}", kind, np, fault, np - 1))
        cases.append((f"{kind}-np2-SIGSTOP", kind, 2, "SIGSTOP", 1))
    cases.append(("launch-np2-launcher", "launch", 2, "launcher", -1))
    failed = 0
    print("| fault | launcher | ranks | others ended | job exited | outcome | processes |")
    print("|---|---|---|---|---|---|---|")
    for name, kind, np, fault, victim in cases:
        if args.only and args.only not in name:
            continue
        ok, row, detail = run_case(args, name, kind, np, fault, victim)
        print(row if ok else f"FAILED {name}: {row}\n{detail}", flush=True)
        failed += not ok
    print(f"{failed} case(s) failed" if failed else "all cases passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
