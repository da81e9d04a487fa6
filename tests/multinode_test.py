"""Multi-node jobs on one machine: two "nodes" in Linux network namespaces (Nodes makes more
for tests/elastic_test.py).

Each node is a network namespace with its own address (198.51.100.1 and .2, a documentation
range), joined to the other by a veth pair, and its own host name (a UTS namespace per
process). Each node's /etc/hosts maps its own name to 127.0.1.1, as Debian's and Ubuntu's
do, and the other node's name to that node's address: rank 0's host name resolves to a
loopback address on its own node.

Every job runs 4 ranks (2 per node) on the tiny config for a few steps, each started the way
one cluster launcher starts them:
  launch   dtrain-launch --nnodes 2 on each node
  pytorchjob  RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT only (Kubeflow's PyTorchJob)
  slurm    srun's variables (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NNODES)
  hydra    MPICH/Intel MPI's (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS), with the
           Slurm variables Hydra's ranks inherit under an allocation, which must not win
and its per-step losses must equal, bit for bit, those of the same job on one node (4 ranks
under dtrain-launch): DDP against DDP, hybrid_shard (whose shard groups must be the two real
nodes, learned at the rendezvous) against hybrid_shard with hybrid_group_size 2 on one
node, where the groups are the same. A launcher environment that contradicts the layout
(LOCAL_WORLD_SIZE=4 on nodes of 2) is refused naming both. DTRAIN_STORE_BIND and
GLOO_SOCKET_IFNAME are honoured.

The launchers act as one job: a rank SIGKILLed on node 1 restarts both nodes together, and
the run's losses and final parameters equal an uninterrupted run's bit for bit; a node whose
launcher is SIGKILLed, or whose link goes down, ends the job on the other node, naming it,
with nothing left running.

Needs root (ip netns, unshare --uts). Where namespaces cannot be made, prints
"SKIPPED: <reason>" and exits 0. The namespaces, veth pair and /etc/netns files are removed
on exit, whatever happens; every process runs under a time limit.
Usage: multinode_test.py --launcher PATH --trainer PATH [--keep-going]
"""

import argparse
import atexit
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ADDRS = ["198.51.100.1", "198.51.100.2", "198.51.100.3"]
HOSTS = ["node0", "node1", "node2"]
PORT = 29500  # inside the namespaces nothing else listens
STEPS = 4
JOB_TIMEOUT_S = 120


class Nodes:
    """`count` network namespaces: two joined by a veth pair; more by veth pairs to a bridge in
    a namespace of its own (the switch). Removed by close()."""

    def __init__(self, count=2):
        tag = f"{os.getpid() % 100000}"
        self.count = count
        self.ns = [f"dtn{tag}{'abcdefgh'[i]}" for i in range(count)]
        self.veth = [f"dtv{tag}{'abcdefgh'[i]}" for i in range(count)]
        self.switch = f"dtn{tag}s" if count > 2 else None
        self.made = []

    def sh(self, *args):
        subprocess.run(args, check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, timeout=30)

    def open(self):
        for i, ns in enumerate(self.ns + ([self.switch] if self.switch else [])):
            self.sh("ip", "netns", "add", ns)
            self.made.append(ns)
        if self.switch is None:
            self.sh("ip", "link", "add", self.veth[0], "type", "veth", "peer", "name",
                    self.veth[1])
        else:
            self.sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            self.sh("ip", "-n", self.switch, "link", "set", "br0", "up")
            for v in self.veth:
                self.sh("ip", "link", "add", v, "type", "veth", "peer", "name", v + "s")
                self.sh("ip", "link", "set", v + "s", "netns", self.switch)
                self.sh("ip", "-n", self.switch, "link", "set", v + "s", "master", "br0")
                self.sh("ip", "-n", self.switch, "link", "set", v + "s", "up")
        for i, ns in enumerate(self.ns):
            self.sh("ip", "link", "set", self.veth[i], "netns", ns)
            self.sh("ip", "-n", ns, "addr", "add", f"{ADDRS[i]}/24", "dev", self.veth[i])
            self.sh("ip", "-n", ns, "link", "set", self.veth[i], "up")
            self.sh("ip", "-n", ns, "link", "set", "lo", "up")
            # `ip netns exec` bind-mounts /etc/netns/<ns>/hosts over /etc/hosts.
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            with open(f"/etc/netns/{ns}/hosts", "w") as f:
                f.write("127.0.0.1 localhost\n")
                f.write(f"127.0.1.1 {HOSTS[i]}\n")
                for j in range(self.count):
                    if j != i:
                        f.write(f"{ADDRS[j]} {HOSTS[j]}\n")

    def close(self):
        for ns in self.made:
            subprocess.run(["ip", "netns", "pids", ns], capture_output=True)
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                  text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except OSError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        self.made = []

    def command(self, node, argv):
        """argv run on `node`: in its namespace, with its host name."""
        return ["ip", "netns", "exec", self.ns[node], "unshare", "--uts", "sh", "-c",
                f'hostname {HOSTS[node]} && exec "$@"', "sh"] + argv


def skip_reason():
    if os.geteuid() != 0:
        return "needs root for ip netns and unshare"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"'{tool}' is not installed"
    probe = f"dtnprobe{os.getpid() % 100000}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return "cannot create a network namespace: " + r.stderr.strip()
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    r = subprocess.run(["unshare", "--uts", "true"], capture_output=True, text=True)
    if r.returncode != 0:
        return "cannot create a UTS namespace: " + r.stderr.strip()
    return None


def train_args(trainer, out, strategy, extra=(), steps=STEPS):
    args = [trainer, "--config", "configs/tiny/ddp_fp32.yaml",
            "--set", f"train.steps={steps}", "--set", "logging.every_steps=1",
            "--set", "logging.progress_bar=false", "--set", "parallel.backend=gloo",
            "--set", f"logging.metrics_file={out}/metrics.jsonl",
            "--set", "parallel.timeout_s=60"]
    if strategy == "hsdp":
        args += ["--set", "parallel.strategy=fsdp",
                 "--set", "parallel.sharding_strategy=hybrid_shard"]
    return args + list(extra)


def run_all(procs, what):
    """Waits for every process (each under JOB_TIMEOUT_S); returns (codes, output)."""
    deadline = time.time() + JOB_TIMEOUT_S
    outputs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
            out = (out or "") + f"\n[{what}: killed after {JOB_TIMEOUT_S} s]"
        outputs.append(out)
    return [p.returncode for p in procs], "\n".join(outputs)


def losses(out):
    with open(f"{out}/metrics.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r["loss"] for r in rows if "step" in r]


def base_env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "PMI_", "OMPI_", "PMIX_", "MPI_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                         "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    env["DTRAIN_JOB_TOKEN"] = "multinode-test-token"
    return env


def one_node(args, strategy, out, extra=(), steps=STEPS):
    extra = list(extra)
    if strategy == "hsdp":
        extra += ["--set", "parallel.hybrid_group_size=2"]
    p = subprocess.Popen([args.launcher, "--nproc-per-node", "4", "--master-port", "0", "--"]
                         + train_args(args.trainer, out, strategy, extra, steps),
                         env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    codes, output = run_all([p], "one node")
    return codes, output


def start_two_nodes(nodes, args, style, strategy, out, extra_env=None, node_env=None,
                    launch=(), extra=(), steps=STEPS, nproc=2):
    procs = []
    for node in range(2):
        env = base_env()
        env.update(extra_env or {})
        if style == "launch":
            argv = [args.launcher, "--nnodes", "2", "--node-rank", str(node),
                    "--nproc-per-node", str(nproc), "--master-addr", HOSTS[0],
                    "--master-port", str(PORT), "--run-id", "mn"] + list(launch) + ["--"]
            procs.append(subprocess.Popen(
                nodes.command(node, argv + train_args(args.trainer, out, strategy, extra, steps)),
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            continue
        for local in range(2):
            rank = 2 * node + local
            e = dict(env)
            e.update({"MASTER_ADDR": HOSTS[0], "MASTER_PORT": str(PORT)})
            if style == "pytorchjob":
                e.update({"RANK": str(rank), "WORLD_SIZE": "4"})
            elif style == "slurm":
                e.update({"SLURM_PROCID": str(rank), "SLURM_NTASKS": "4",
                          "SLURM_LOCALID": str(local), "SLURM_NNODES": "2",
                          "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0"})
            elif style == "hydra":
                # Under a Slurm allocation Hydra's proxies are Slurm's tasks: one per node.
                e.update({"PMI_RANK": str(rank), "PMI_SIZE": "4",
                          "MPI_LOCALRANKID": str(local), "MPI_LOCALNRANKS": "2",
                          "SLURM_PROCID": str(node), "SLURM_NTASKS": "2",
                          "SLURM_LOCALID": "0", "SLURM_NNODES": "2", "SLURM_JOB_ID": "4243"})
            else:
                raise ValueError(style)
            e.update((node_env or [{}, {}])[node])
            # Only rank 0 writes the metrics file.
            procs.append(subprocess.Popen(
                nodes.command(node, train_args(args.trainer, out, strategy, extra, steps)),
                env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def two_nodes(*a, **kw):
    return run_all(start_two_nodes(*a, **kw), a[2])


def final_checksum(output):
    found = re.findall(r"parameters identical on all \d+ rank\(s\) \(xxh64 ([0-9a-f]+)\)", output)
    return found[-1] if found else None


def wait_training(procs, out, limit_s=60):
    """Until rank 0 has logged two steps (or a process ended, or limit_s passed)."""
    deadline = time.time() + limit_s
    while time.time() < deadline and all(p.poll() is None for p in procs):
        if os.path.exists(f"{out}/metrics.jsonl") and len(losses(out)) >= 2:
            return
        time.sleep(0.1)


def namespace_pids(nodes):
    pids = []
    for ns in nodes.ns:
        pids += subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                               text=True).stdout.split()
    return pids


def setup(count, prefix):
    """A test's start: its arguments (--launcher, --trainer), then `count` nodes and a work
    folder, both removed on exit whatever happens; None (after printing SKIPPED and the
    reason) where namespaces cannot be made."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--launcher", required=True)
    ap.add_argument("--trainer", required=True)
    args = ap.parse_args()
    args.launcher = os.path.abspath(args.launcher)
    args.trainer = os.path.abspath(args.trainer)
    reason = skip_reason()
    if reason:
        print(f"SKIPPED: {reason}")
        return None
    nodes = Nodes(count)
    atexit.register(nodes.close)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: sys.exit(1))
    work = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, work, True)
    nodes.open()
    return args, nodes, work


def main():
    ready = setup(2, "dtrain_multinode_")
    if ready is None:
        return 0
    args, nodes, work = ready
    failures = []

    def check(ok, what, output=""):
        print(("ok   " if ok else "FAIL ") + what, flush=True)
        if not ok:
            failures.append(what)
            print(output[-6000:], flush=True)

    started = time.time()
    reference = {}
    for strategy in ("ddp", "hsdp"):
        out = f"{work}/one_{strategy}"
        os.makedirs(out)
        codes, output = one_node(args, strategy, out)
        check(codes == [0], f"one node, 4 ranks, {strategy}: exit {codes}", output)
        reference[strategy] = losses(out) if codes == [0] else None

    rows = [("launch", "ddp"), ("launch", "hsdp"), ("pytorchjob", "hsdp"),
            ("slurm", "hsdp"), ("hydra", "ddp")]
    for style, strategy in rows:
        out = f"{work}/{style}_{strategy}"
        os.makedirs(out)
        t0 = time.time()
        codes, output = two_nodes(nodes, args, style, strategy, out)
        what = f"2 nodes x 2 ranks, {style}, {strategy}"
        check(all(c == 0 for c in codes), f"{what}: exit codes {codes}", output)
        if not all(c == 0 for c in codes):
            continue
        got = losses(out)
        want = reference[strategy]
        check(want is not None and len(got) == STEPS and got == want,
              f"{what}: losses {got} equal one node's {want} bit for bit "
              f"({time.time() - t0:.1f} s)", output)
        if strategy == "hsdp":
            check("shard groups of 2 rank(s) (one per node, as the rendezvous found them), "
                  "2 replica(s)" in output, f"{what}: the shard groups are the nodes", output)
        if style == "launch":
            check("the store listens on 0.0.0.0:" in output,
                  f"{what}: rank 0's host name resolves to 127.0.1.1 there, so the store "
                  "listens on every interface", output)

    # Node 0's ranks meet at MASTER_ADDR=127.0.0.1, node 1's at node0: the store would listen
    # on loopback only; DTRAIN_STORE_BIND=0.0.0.0 opens it to node 1. GLOO_SOCKET_IFNAME names
    # each node's interface.
    out = f"{work}/pinned"
    os.makedirs(out)
    codes, output = two_nodes(nodes, args, "pytorchjob", "ddp", out,
                              {"DTRAIN_STORE_BIND": "0.0.0.0"},
                              [{"GLOO_SOCKET_IFNAME": nodes.veth[0], "MASTER_ADDR": "127.0.0.1"},
                               {"GLOO_SOCKET_IFNAME": nodes.veth[1]}])
    ok = all(c == 0 for c in codes)
    check(ok and losses(out) == reference["ddp"] and
          f"the store listens on 0.0.0.0:{PORT} (DTRAIN_STORE_BIND)" in output,
          f"DTRAIN_STORE_BIND=0.0.0.0 and GLOO_SOCKET_IFNAME: exit {codes}, losses equal "
          "one node's", output)

    # A launcher's environment that contradicts the layout is refused on every rank.
    out = f"{work}/contradiction"
    os.makedirs(out)
    codes, output = two_nodes(nodes, args, "pytorchjob", "ddp", out,
                              {"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "0"})
    check(all(c != 0 for c in codes) and
          "says local rank 0 of 4, but the ranks that met from its node" in output,
          f"LOCAL_WORLD_SIZE=4 on nodes of 2 ranks is refused naming both: exit {codes}",
          output)

    # Job-wide restart: rank 3 (on node 1) is SIGKILLed after its step-4 checkpoint. Both
    # nodes' launchers stop their ranks and restart them together at attempt 1, which resumes
    # from step 4: the losses and the final parameters equal an uninterrupted one-node run's.
    steps = 6
    ckpt = ["--set", "checkpoint.every_steps=2"]
    ref = f"{work}/one_restart"
    os.makedirs(ref)
    codes, output = one_node(args, "ddp", ref, ckpt + ["--set", f"checkpoint.dir={ref}/ckpt"],
                             steps)
    check(codes == [0], f"one node, {steps} steps with checkpoints: exit {codes}", output)
    want_losses, want_sum = losses(ref), final_checksum(output)
    out = f"{work}/restart"
    os.makedirs(out)
    t0 = time.time()
    codes, output = two_nodes(nodes, args, "launch", "ddp", out,
                              {"DTRAIN_TEST_KILL_AT_STEP": "4:3"}, launch=["--max-restarts", "1"],
                              extra=ckpt + ["--set", f"checkpoint.dir={out}/ckpt"], steps=steps)
    what = "SIGKILL of rank 3 on node 1 at step 4, --max-restarts 1"
    print("\n".join(l for l in output.splitlines() if "dtrain-launch]" in l), flush=True)
    check(codes == [0, 0] and output.count("restarting every node's ranks (restart 1 of 1") == 2
          and "rank 3 on node 1 was killed by signal 9; stopping this node's ranks" in output
          and f"resumed from {out}/ckpt/step_00000004 at step 4" in output,
          f"{what}: both nodes restart together and resume from step 4 (exit {codes}, "
          f"{time.time() - t0:.1f} s)", output)
    got_losses = losses(out) if os.path.exists(f"{out}/metrics.jsonl") else None
    check(got_losses == want_losses and want_sum is not None
          and final_checksum(output) == want_sum,
          f"{what}: losses {got_losses} and final parameters (xxh64 {final_checksum(output)}) "
          f"equal the uninterrupted run's ({want_sum}) bit for bit", output)

    # Rank 0 SIGKILLed from outside mid-run (one rank per node; node 0 holds the store): node
    # 1's rank stops as a consequence within milliseconds and its launcher may hear of it
    # before node 0's sees its rank die, but both nodes name rank 0 and the signal, in each of
    # three runs (node 0 named "rank 1 on node 1 exited with code 3" in 4 of 7 runs before).
    for attempt in range(3):
        out = f"{work}/kill0_{attempt}"
        os.makedirs(out)
        procs = start_two_nodes(nodes, args, "launch", "ddp", out, launch=["--max-restarts", "0"],
                                steps=400, nproc=1)
        wait_training(procs, out)
        time.sleep(0.3 + 0.3 * attempt)
        victim = None
        for pid in subprocess.run(["ip", "netns", "pids", nodes.ns[0]], capture_output=True,
                                  text=True).stdout.split():
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = f.read().split(b"\0")
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if b"RANK=0" in env and b"dtrain-train" in cmd and b"dtrain-launch" not in cmd:
                victim = int(pid)
        if victim is not None:
            os.kill(victim, signal.SIGKILL)
        codes, output = run_all(procs, "kill0")
        lines = [l for l in output.splitlines() if "dtrain-launch]" in l]
        print("\n".join(lines), flush=True)
        check(victim is not None and all(c != 0 for c in codes)
              and any("rank 0 (pid" in l and "was killed by signal 9" in l for l in lines)
              and "rank 0 on node 0 was killed by signal 9" in output
              and not any("exited with code 3" in l for l in lines),
              f"SIGKILL of rank 0 mid-run (run {attempt + 1} of 3): both nodes name rank 0 and "
              f"the signal, none a consequence (exit {codes})", output)

    # Loss of a whole node: node 1's dtrain-launch is SIGKILLed mid-run. Node 0 names it, ends
    # its ranks and exits within the collective timeout (60 s) plus 10 s; nothing is left.
    out = f"{work}/lost"
    os.makedirs(out)
    procs = start_two_nodes(nodes, args, "launch", "ddp", out, launch=["--max-restarts", "2"],
                            steps=100000)
    wait_training(procs, out)
    t0 = time.time()
    procs[1].kill()
    codes, output = run_all(procs, "lost node")
    took = time.time() - t0
    left = []
    for _ in range(50):
        left = namespace_pids(nodes)
        if not left:
            break
        time.sleep(0.1)
    print("\n".join(l for l in output.splitlines() if "dtrain-launch]" in l), flush=True)
    check(codes[0] == 1 and took < 70
          and "node 1 is lost: its dtrain-launch closed the connection" in output
          and "the job ends on every node: node 1 is lost" in output
          and "restarting" not in output and not left,
          f"node 1's dtrain-launch SIGKILLed: node 0 exits {codes[0]} in {took:.1f} s naming "
          f"node 1, no restart, processes left in the namespaces: {left}", output)

    # A node that goes silent (its link down: no FIN, no reset): the launchers' keepalive
    # notices within about 15 s, before the ranks' collective timeout (30 s here), and both
    # nodes end, each naming the other.
    out = f"{work}/silent"
    os.makedirs(out)
    procs = start_two_nodes(nodes, args, "launch", "ddp", out, steps=100000,
                            extra=["--set", "parallel.timeout_s=30"])
    wait_training(procs, out)
    t0 = time.time()
    subprocess.run(["ip", "-n", nodes.ns[1], "link", "set", nodes.veth[1], "down"], check=True,
                   timeout=30)
    codes, output = run_all(procs, "silent node")
    took = time.time() - t0
    subprocess.run(["ip", "-n", nodes.ns[1], "link", "set", nodes.veth[1], "up"], timeout=30)
    print("\n".join(l for l in output.splitlines() if "dtrain-launch]" in l), flush=True)
    check(codes == [1, 1] and took < 40
          and "node 1 is lost: its dtrain-launch stopped answering" in output
          and "node 0 is lost: its dtrain-launch at node0:29501 stopped answering" in output,
          f"node 1's link down: both nodes exit {codes} in {took:.1f} s, each naming the other",
          output)

    print(f"multinode: {len(failures)} failure(s), {time.time() - started:.0f} s", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
