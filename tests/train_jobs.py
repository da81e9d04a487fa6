"""dtrain-train as a job, for the end-to-end tests: in one process, under dtrain-launch or
under mpirun (DTRAIN_BACKEND=mpi), one compute thread per rank; and its metrics file read.

    from train_jobs import run_job
    out = run_job("pp2", "launch", 2, [trainer, "--config", cfg], launcher=path)
"""
import json
import os
import subprocess
import sys


def run_job(name, kind, np, train, launcher=None, expect_rc=0, timeout=600, env=None):
    """Runs `train` (dtrain-train's command line) as `kind` ("one", "launch" or "mpi") on `np`
    ranks, with `env` added to the environment; returns its output, or raises AssertionError
    (the output's tail printed) when it exits with another code than `expect_rc`."""
    if kind == "mpi":
        cmd = ["mpirun", "-np", str(np), "--oversubscribe", "--allow-run-as-root",
               "--bind-to", "none", "-x", "OMP_NUM_THREADS=1", "-x", "DTRAIN_BACKEND=mpi"] + train
    elif kind == "launch":
        cmd = [launcher, "--nproc-per-node", str(np), "--master-port", "0", "--"] + train
    else:
        cmd = train
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    if kind == "mpi":
        # A sanitized build (CI): OpenMPI leaks at exit, and suppressing that by library needs
        # whole stacks (5-10x slower). Under mpirun, memory errors only; the Gloo cases look for
        # leaks (as scripts/examples does).
        env["ASAN_OPTIONS"] = ":".join(filter(None, [env.get("ASAN_OPTIONS"), "detect_leaks=0"]))
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                       timeout=timeout)
    if p.returncode != expect_rc:
        sys.stdout.write(p.stdout[-6000:])
        raise AssertionError(f"{name}: exit {p.returncode}, expected {expect_rc}")
    return p.stdout


def rows(path):
    """A metrics file's losses by step: ({step: loss}, {step: val_loss}), the validation of a
    restored checkpoint left out."""
    train, val = {}, {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if "step" not in r:
                continue
            if "loss" in r:
                train[r["step"]] = r["loss"]
            if "val_loss" in r and not r.get("restored"):
                val[r["step"]] = r["val_loss"]
    return train, val
