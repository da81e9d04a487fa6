"""Jobs that stop and resume: preemption, asynchronous checkpoints, and resumes onto another job.

Every case runs dtrain-train (the tiny DDP config, 2 ranks, every step logged) and compares what
the resumed run trains with an uninterrupted reference run of the same command: the loss of
every step after the resume, and the final parameters' hash that dtrain logs
("parameters identical on all 2 rank(s) (xxh64 ...)"), bit for bit.

  preempt-launch   SIGTERM to dtrain-launch at a random step: every rank finishes its step, they
                   agree, save, and the launcher exits 75 (requeue); the same command again
                   resumes and ends where the reference did.
  preempt-mpi      the same under mpirun, SIGTERM to one rank only (the agreement carries it).
  usr1-launch      SIGUSR1 (Slurm's --signal) to the launcher, with checkpoint.async.
  interrupt        Ctrl-C (SIGINT) to the launcher: no save (checkpoint.on_interrupt is off).
  async-crash      checkpoint.async, the process killed while step 20's checkpoint is written
                   in the background (before its meta.json is renamed): the rerun resumes from
                   step 10, the last complete one, and ends where the reference did.
  other-data       a resume onto another corpus: refused before any step (exit 2), naming what
                   changed and checkpoint.allow_data_change; with that key it goes on, and the
                   restored validation loss says it is on other data.
  other-tokenizer  token files of another tokenizer: refused the same way.
  other-model      a resume with another model shape: one message (exit 2), printed once.
  other-world      6 steps at 2 ranks, resumed for 6 more at 3 (a job resized between
                   restarts, the per-rank batch kept): the samples drawn (each rank's record,
                   DTRAIN_TEST_RECORD_SAMPLES) are those of one rank drawing 30 steps' worth,
                   each once, none repeated and none skipped across the change.
Usage: resume_test.py --launcher PATH --trainer PATH --prepare PATH [--only NAME] [--no-mpi]
"""
import argparse
import glob
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

STEPS = 40


def metrics_rows(path):
    rows = {}
    if not os.path.exists(path):
        return rows
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if "loss" in r and "step" in r:
                rows[r["step"]] = r["loss"]
    return rows


def final_hash(out):
    for line in out.splitlines():
        if "parameters identical on all" in line:
            return line.split("xxh64 ")[-1].strip(")")
    return None


class Runner:
    def __init__(self, args, work):
        self.args, self.work = args, work

    def command(self, kind, name, extra, nproc=2):
        run = os.path.join(self.work, name)
        os.makedirs(run, exist_ok=True)
        train = [self.args.trainer, "--config", "configs/tiny/ddp_fp32.yaml",
                 "--set", f"train.steps={STEPS}", "--set", "logging.every_steps=1",
                 "--set", "train.eval_every=0", "--set", "logging.progress_bar=false",
                 "--set", "logging.sample_tokens=0",
                 "--set", f"checkpoint.dir={run}/ckpt", "--set", "checkpoint.every_steps=10",
                 "--set", "checkpoint.keep=10",
                 "--set", f"logging.metrics_file={run}/metrics.jsonl"] + extra
        if kind == "mpi":
            return ["mpirun", "-np", "2", "--oversubscribe", "--allow-run-as-root",
                    "--bind-to", "none", "-x", "OMP_NUM_THREADS=1", "-x", "DTRAIN_BACKEND=mpi"] + train
        return [self.args.launcher, "--nproc-per-node", str(nproc), "--master-port", "0",
                "--"] + train

    def start(self, kind, name, extra=(), env=None, nproc=2):
        e = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
        return subprocess.Popen(self.command(kind, name, list(extra), nproc), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=e,
                                start_new_session=True)

    def run(self, kind, name, extra=(), env=None, timeout=180, nproc=2):
        p = self.start(kind, name, extra, env, nproc)
        out, _ = p.communicate(timeout=timeout)
        return p.returncode, out


def rank_pids(root):
    """dtrain-train processes below root, by rank."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if os.path.basename(argv[0]) != b"dtrain-train":
            continue
        for key in (b"RANK", b"OMPI_COMM_WORLD_RANK"):
            if key in env and os.getsid(int(entry)) == os.getsid(root):
                found[int(env[key])] = int(entry)
    return found


def wait_for_step(metrics, step, proc, limit=120):
    deadline = time.time() + limit
    while time.time() < deadline and proc.poll() is None:
        if max(metrics_rows(metrics), default=0) >= step:
            return True
        time.sleep(0.05)
    return False


def same_after(ref_rows, rows, start):
    """Steps > start equal the reference's, bit for bit; returns a problem or None."""
    for s in range(start + 1, STEPS + 1):
        if s not in rows:
            return f"no loss logged at step {s}"
        if rows[s] != ref_rows[s]:
            return f"step {s}: loss {rows[s]!r}, the reference's {ref_rows[s]!r}"
    return None


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launcher", required=True)
    p.add_argument("--trainer", required=True)
    p.add_argument("--prepare", required=True)
    p.add_argument("--only", default="")
    p.add_argument("--no-mpi", action="store_true")
    p.add_argument("--seed", type=int, default=int(time.time()))
    a = p.parse_args()
    for k in ("launcher", "trainer", "prepare"):
        setattr(a, k, os.path.abspath(getattr(a, k)))
    rng = random.Random(a.seed)
    print(f"seed {a.seed} (--seed to repeat)")
    work = tempfile.mkdtemp(prefix="resume_test.", dir=os.environ.get("TEST_TMPDIR"))
    r = Runner(a, work)
    failures = []

    def check(ok, what, detail=""):
        print(("ok   " if ok else "FAIL ") + what, flush=True)
        if not ok:
            failures.append(what)
            print(detail[-6000:])

    def want(name):
        return not a.only or a.only in name

    code, ref_out = r.run("launch", "reference")
    ref_rows = metrics_rows(f"{work}/reference/metrics.jsonl")
    ref_hash = final_hash(ref_out)
    check(code == 0 and len(ref_rows) == STEPS and ref_hash, "the reference run trains 40 steps",
          ref_out)

    def preempt(name, kind, sig, to_launcher, extra=()):
        # The signal lands some steps after the step the test saw logged (it polls the metrics
        # file every 50 ms, a step takes ~7 ms): 20 steps leave room for it before the end
        # (with 8, a loaded machine once saw the run finish first).
        stop_after = rng.randint(3, STEPS - 20)
        proc = r.start(kind, name, extra)
        metrics = f"{work}/{name}/metrics.jsonl"
        if not wait_for_step(metrics, stop_after, proc):
            proc.kill()
            check(False, f"{name}: reached step {stop_after}", proc.communicate()[0])
            return
        if to_launcher:
            os.kill(proc.pid, sig)
        else:
            os.kill(rank_pids(proc.pid)[1], sig)
        out, _ = proc.communicate(timeout=180)
        rows = metrics_rows(metrics)
        stopped = max(rows, default=0)
        check(proc.returncode == 75 and f"step_{stopped:08d}" in os.listdir(f"{work}/{name}/ckpt")
              and stopped < STEPS and "saving a checkpoint at step" in out,
              f"{name}: {signal.Signals(sig).name} at step {stop_after}: stopped after step "
              f"{stopped} with its checkpoint, exit {proc.returncode} (75: requeue)", out)
        for s in range(1, stopped + 1):
            if rows.get(s) != ref_rows.get(s):
                check(False, f"{name}: step {s} before the stop equals the reference", out)
                return
        code, out2 = r.run(kind, name, extra)
        rows2 = metrics_rows(metrics)
        problem = same_after(ref_rows, rows2, stopped)
        check(code == 0 and problem is None and final_hash(out2) == ref_hash,
              f"{name}: the rerun resumes at step {stopped} and trains as the uninterrupted run "
              f"(final xxh64 {final_hash(out2)} vs {ref_hash}){': ' + problem if problem else ''}",
              out2)

    if want("preempt-launch"):
        preempt("preempt-launch", "launch", signal.SIGTERM, True)
    if want("preempt-mpi") and not a.no_mpi:
        preempt("preempt-mpi", "mpi", signal.SIGTERM, False)
    if want("usr1-launch"):
        preempt("usr1-launch", "launch", signal.SIGUSR1, True, ["--set", "checkpoint.async=true"])

    if want("interrupt"):
        proc = r.start("launch", "interrupt")
        metrics = f"{work}/interrupt/metrics.jsonl"
        wait_for_step(metrics, 12, proc)
        os.kill(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        saved = sorted(os.listdir(f"{work}/interrupt/ckpt"))
        check(proc.returncode not in (0, 75) and saved == ["step_00000010"] and
              "saving a checkpoint" not in out,
              f"interrupt: Ctrl-C ends the run unsaved (exit {proc.returncode}, checkpoints "
              f"{saved})", out)

    if want("async-crash"):
        name = "async-crash"
        code, out = r.run("launch", name, ["--set", "checkpoint.async=true"],
                          env={"DTRAIN_TEST_CRASH_BEFORE_RENAME": "step_00000020/meta.json"})
        ckpt = f"{work}/{name}/ckpt"
        complete = sorted(d for d in os.listdir(ckpt) if os.path.exists(f"{ckpt}/{d}/COMPLETE"))
        check(code != 0 and complete == ["step_00000010"] and
              max(metrics_rows(f"{work}/{name}/metrics.jsonl"), default=0) >= 20,
              f"{name}: killed while step 20's checkpoint was written in the background "
              f"(exit {code}); complete: {complete}", out)
        code, out2 = r.run("launch", name, ["--set", "checkpoint.async=true"])
        problem = same_after(ref_rows, metrics_rows(f"{work}/{name}/metrics.jsonl"), 10)
        check(code == 0 and "resumed from" in out2 and "step_00000010" in out2 and
              problem is None and final_hash(out2) == ref_hash,
              f"{name}: the rerun resumes from step 10 and trains as the uninterrupted run"
              f"{': ' + problem if problem else ''}", out2)

    def refused(name, out, code, needles):
        """Exit 2, every needle in the message, which the ranks print once (the launcher
        prints the first rank's and counts the others), and no step trained."""
        said = [l for l in out.splitlines() if l.startswith("[rank") and " error " in l]
        return (code == 2 and all(n in out for n in needles) and len(said) == 1 and
                " info step " not in out)

    if want("other-data"):
        name = "other-data"
        corpus = f"{work}/corpus.txt"
        shutil.copy("/usr/share/common-licenses/GPL-3", corpus)
        code, out = r.run("launch", name, ["--set", f"data.path={corpus}",
                                           "--set", "train.steps=10"])
        with open(corpus, "a") as f:
            f.write("\nA line the first run never saw.\n")
        code, out = r.run("launch", name, ["--set", f"data.path={corpus}",
                                           "--set", "train.steps=20"])
        rows = metrics_rows(f"{work}/{name}/metrics.jsonl")
        check(refused(name, out, code, ["was trained on other data", "checkpoint.allow_data_change",
                                        "corpus of"]) and max(rows, default=0) == 10,
              f"{name}: a resume onto a changed corpus is refused before any step (exit {code})",
              out)
        code, out = r.run("launch", name, ["--set", f"data.path={corpus}",
                                           "--set", "train.steps=20", "--set",
                                           "checkpoint.allow_data_change=true",
                                           "--set", "train.eval_every=5"])
        check(code == 0 and "(restored, on this run's other data)" in out and
              max(metrics_rows(f"{work}/{name}/metrics.jsonl")) == 20,
              f"{name}: with checkpoint.allow_data_change it goes on, saying so", out)

    if want("other-tokenizer"):
        name = "other-tokenizer"
        tokens = f"{work}/tokens"
        subprocess.run([a.prepare, "--tokenizer", "bytes", "--out", tokens,
                        "/usr/share/common-licenses/GPL-3"], check=True, capture_output=True)
        extra = ["--set", "data.source=tokens", "--set", f"data.path={tokens}/*.bin",
                 "--set", "train.steps=10"]
        code, out = r.run("launch", name, extra)
        check(code == 0, f"{name}: trains on bytes-tokenizer token files", out)
        with open(f"{tokens}/meta.json") as f:
            meta = f.read()
        with open(f"{tokens}/meta.json", "w") as f:
            f.write(meta.replace('"tokenizer": "bytes"', '"tokenizer": "another"'))
        code, out = r.run("launch", name, extra[:-1] + ["train.steps=20"])
        check(refused(name, out, code, ["another tokenizer", "checkpoint.allow_data_change"]),
              f"{name}: a resume onto another tokenizer's tokens is refused (exit {code})", out)

    if want("other-model"):
        name = "other-model"
        r.run("launch", name, ["--set", "train.steps=10"])
        code, out = r.run("launch", name, ["--set", "train.steps=20", "--set", "model.d_ff=128"])
        check(refused(name, out, code, ["holds another model", "model.* settings",
                                        "checkpoint.resume: never"]) and
              "no intact checkpoint" not in out,
              f"{name}: a resume with another model shape is one message, exit 2 (exit {code})",
              out)

    if want("other-world"):
        name = "other-world"

        def drawn(prefix):
            """Every sample id the ranks' records hold (DTRAIN_TEST_RECORD_SAMPLES)."""
            ids = []
            for path in sorted(glob.glob(prefix + ".*")):
                with open(path) as f:
                    ids += [int(x) for line in f for x in line.split()[2:]]
            return ids

        def resized(tag, steps, nproc):
            return r.run("launch", name, ["--set", f"train.steps={steps}",
                                          "--set", "checkpoint.every_steps=6"],
                         env={"DTRAIN_TEST_RECORD_SAMPLES": f"{work}/{name}.{tag}"}, nproc=nproc)

        code1, out1 = resized("before", 6, 2)
        code2, out2 = resized("after", 12, 3)
        ours = drawn(f"{work}/{name}.before") + drawn(f"{work}/{name}.after")
        code3, out3 = r.run("launch", name + "-one-rank", ["--set", "train.steps=30"],
                            env={"DTRAIN_TEST_RECORD_SAMPLES": f"{work}/{name}.one"}, nproc=1)
        one = drawn(f"{work}/{name}.one")
        repeated = len(ours) - len(set(ours))
        check(code1 == 0 and code2 == 0 and code3 == 0 and "written at 2 ranks, this run has 3"
              in out2 and len(one) == 240 and len(set(one)) == 240 and sorted(ours) == sorted(one),
              f"{name}: 2 ranks for 6 steps, then 3 for 6: {len(ours)} samples, {repeated} "
              f"repeated, {len(set(one) - set(ours))} of one rank's 240 never drawn",
              out1 + out2 + out3)

    shutil.rmtree(work, ignore_errors=True)
    print(f"{len(failures)} failure(s)" if failures else "PASS")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
