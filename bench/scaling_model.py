#!/usr/bin/env python3
"""A scaling model of dtrain's DDP and FSDP: step time and weak-scaling efficiency from 8 to
1024 GPUs, from a measured step profile and alpha-beta costs of NCCL's collectives.

    bench/scaling_model.py table                        # GPT-2 small and 7B presets, H200 nodes
    bench/scaling_model.py table --nvlink-gbps 450 --ib-gbps 50 --gpus-per-node 8 ...
    bench/scaling_model.py validate --measured M.json   # against runs on this machine
                                                       # (bench/run_scaling_validation.sh)
    bench/scaling_model.py validate-tp --measured M.jsonl  # FSDP x TP (bench/run_tp_bench.sh)
    bench/scaling_model.py layout --model 70b --gpus 64   # the best (dp, tp, pp) layouts

The model
- Collectives, as NCCL implements them, with latency alpha and per-GPU bandwidth B of the
  slowest link the collective crosses (NVLink inside a node, InfiniBand between nodes):
    ring all-reduce      2(p-1) alpha + 2 (p-1)/p n / B
    tree all-reduce      2 log2(p) alpha + 2 n / B          (NCCL's double binary tree)
    all-reduce           the cheaper of the two, as NCCL's tuner picks
    ring all-gather,
    ring reduce-scatter  (p-1) alpha + (p-1)/p n / B        (n: the full, unsharded bytes)
- Overlap, the way dtrain schedules it:
  DDP: gradients are bucketed (bucket_cap_mb, in the order backward produces them); a bucket
  is all-reduced once all its gradients are ready, in bucket order, one at a time on the
  communicator's queue. step = forward + max(end of backward, end of the last all-reduce) +
  optimizer.
  FSDP (FULL_SHARD): forward: unit k's all-gather is issued once at most `prefetch`
  all-gathers are outstanding (limit_all_gathers) and runs on the queue; unit k computes after
  its gather and unit k-1. Backward, in reverse: each unit is gathered again (prefetched the
  same way), computes, then its gradient is reduce-scattered on a second queue (dtrain's
  separate reduce group). step = max(end of backward, end of the last reduce-scatter) +
  optimizer.
- Tensor parallelism (FSDP x TP, t GPUs per TP group inside a node, dp = p/t): a TP group
  takes t GPUs' tokens together, so each GPU's compute is unchanged; each layer adds, on the
  critical path (dtrain waits for TP's collectives where it issues them), 4 all-reduces of the
  group's b s h activations on NVLink (2 forward, 2 backward), or with sequence parallelism 4
  reduce-scatters and 6 all-gathers (Megatron's regather in backward); FSDP then gathers and
  reduce-scatters 1/t of each layer over the dp GPUs, which cross nodes once p > GPUs per node.
- Pipeline parallelism (FSDP x TP x PP, `layout`): pp stages of L/pp layers each, m
  micro-batches under 1F1B, simulated action by action (`pipeline_time`: each stage's
  forwards and backwards in 1F1B's order, each waiting for its inputs, plus one activation
  transfer of one micro-batch, b s h, per message). Each GPU computes what it would without PP
  (weak scaling); the bubble comes out of the simulation ((pp-1)/m of the compute with equal
  stages). As dtrain runs them: a stage's FSDP over the dp GPUs gathers it once before the
  schedule and reduce-scatters once after it, exposed; without PP, FSDP gathers every unit
  again for each micro-batch's forward and backward (FULL_SHARD under no_sync) and
  reduce-scatters with the last. TP's collectives run per micro-batch. Memory per GPU: 16
  bytes per parameter (bf16 parameter and gradient, fp32 master and Adam's two moments) over
  all GPUs, the gathered units (prefetch + 1 of them, bf16, 1/tp each), and activations of
  34 h bytes per token and layer over tp (Korthikanti et al. 2022, flash attention; no
  recompute) for the micro-batches in flight: pp on the first stage under 1F1B, one without
  PP (the same m micro-batches accumulated).
  `layout --cores C` models CPU ranks instead (bench/run_layout_validation.sh): the ranks
  share C cores, each busy rank computing at min(1, C / busy ranks) of one core (processor
  sharing, so a rank idle in the bubble lends its core), and no collective hides under the
  compute (Gloo's copies and reductions run on the same cores).
- Weak scaling: the per-GPU batch is fixed, so compute is the same at every scale;
  efficiency = step without communication / modelled step.
- The step profile (forward, backward, optimizer, when each bucket's gradients are ready, each
  unit's compute) comes from measured traces (logging.trace: one process for the compute, a
  DDP run for the buckets) or, for the presets, from FLOPs:
  6 x parameters x tokens per GPU at a stated fraction (MFU) of the GPU's peak, split 1:2
  between forward and backward.

Validation on this machine (`validate`): the DDP step of a TransformerLM measured at 2, 3 and 4
ranks over MPI and Gloo, against the model fed with the same model's profile (a one-process
trace for compute, a 2-rank trace for the buckets) and the alpha-beta of each backend fitted
to comm_bench's all-reduce times at that rank count. A CPU machine has one more effect a GPU cluster does not: ranks share cores, so the
compute of p ranks x t threads on c cores is stretched by max(1, p t / c), and the
communication thread competes with it (its busy time is added to the critical path while it
overlaps compute, a factor --cpu-share). Both are stated inputs.
"""
import argparse
import json
import math
import sys


# --- collectives -------------------------------------------------------------------------------

class Links:
    """Latency (s) and per-GPU bandwidth (bytes/s) inside a node and between nodes."""

    def __init__(self, intra_alpha, intra_bw, inter_alpha, inter_bw, gpus_per_node):
        self.intra_alpha, self.intra_bw = intra_alpha, intra_bw
        self.inter_alpha, self.inter_bw = inter_alpha, inter_bw
        self.gpus_per_node = gpus_per_node

    def of(self, p):
        if p <= self.gpus_per_node:
            return self.intra_alpha, self.intra_bw
        return max(self.intra_alpha, self.inter_alpha), min(self.intra_bw, self.inter_bw)


def all_reduce(n, p, links, span=None):
    """`span`: the GPUs the job spans, which decides the link (default p: a group of
    consecutive GPUs)."""
    if p == 1:
        return 0.0
    a, b = links.of(span or p)
    ring = 2 * (p - 1) * a + 2 * (p - 1) / p * n / b
    tree = 2 * math.log2(p) * a + 2 * n / b
    return min(ring, tree)


def gather_or_scatter(n, p, links, span=None):
    if p == 1:
        return 0.0
    a, b = links.of(span or p)
    return (p - 1) * a + (p - 1) / p * n / b


# --- profiles ----------------------------------------------------------------------------------

class Profile:
    """One GPU's step: forward, backward, optimizer seconds; DDP: gradient bytes in the order
    backward produces them with the fraction of backward at which each is ready; FSDP: per
    unit, its parameter bytes (as gathered) and forward/backward seconds."""

    def __init__(self, name, forward, backward, optimizer, grads, units):
        self.name, self.forward, self.backward, self.optimizer = name, forward, backward, optimizer
        self.grads = grads  # [(bytes, ready_fraction)], backward order
        self.units = units  # [(bytes, forward_s, backward_s)], forward order

    @property
    def compute(self):
        return self.forward + self.backward + self.optimizer


def transformer_preset(name, params, layers, tokens_per_gpu, tflops, mfu, grad_bytes=2,
                       hidden=0):
    """A decoder-only transformer on a GPU: FLOPs = 6 N T at `mfu` of `tflops`; parameters
    evenly over `layers` blocks (embeddings with the first); gradients (bf16) ready evenly
    over backward, last layer first."""
    total = 6 * params * tokens_per_gpu / (tflops * 1e12 * mfu)
    forward, backward = total / 3, 2 * total / 3
    optimizer = params * 16 / 3.0e12  # fused AdamW: ~16 bytes/parameter through HBM
    per_layer = params * grad_bytes / layers
    grads = [(per_layer, (i + 1) / layers) for i in range(layers)]
    units = [(per_layer, forward / layers, backward / layers) for _ in range(layers)]
    prof = Profile(name, forward, backward, optimizer, grads, units)
    prof.hidden, prof.tokens, prof.layers = hidden, tokens_per_gpu, layers
    return prof


def tp_profile(prof, t, p, links, sp=False, act_bytes=2, micro=1):
    """The per-GPU profile of FSDP x TP with t GPUs per TP group (see the module's notes): each
    layer's unit 1/t of its parameters, its compute the same, plus TP's collectives on the
    group's t GPUs (inside a node: NVLink), which wait on the critical path: each of the step's
    `micro` micro-batches runs its own, of 1/micro of the activations."""
    n = t * prof.tokens * prof.hidden * act_bytes / micro  # the group's activations, b s h
    if sp:
        fwd_c = 2 * gather_or_scatter(n, t, links) + 2 * gather_or_scatter(n, t, links)
        bwd_c = 4 * gather_or_scatter(n, t, links) + 2 * gather_or_scatter(n, t, links)
    else:
        fwd_c = bwd_c = 2 * all_reduce(n, t, links)
    fwd_c, bwd_c = fwd_c * micro, bwd_c * micro
    units = [(b / t, f + fwd_c, bw + bwd_c) for b, f, bw in prof.units]
    out = Profile(f"{prof.name}, tp {t}", prof.forward + len(units) * fwd_c,
                  prof.backward + len(units) * bwd_c, prof.optimizer, [], units)
    out.tp_comm = len(units) * (fwd_c + bwd_c)
    return out


def _events(path, rank):
    doc = json.load(open(path))
    ev = [e for e in doc["traceEvents"] if e.get("ph") == "X" and e.get("pid") == rank]
    steps = sorted((e for e in ev if e["cat"] == "step"), key=lambda e: e["ts"])
    if not steps:
        sys.exit(f"scaling_model: {path} has no traced step for rank {rank}")
    return ev, steps


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def profile_from_traces(local_path, ddp_path, rank=0):
    """Compute from a one-process trace (strategy none: no communication, no competition for
    the cores), the median of its traced steps; the gradient buckets (bytes, and when in
    backward each was ready) from a DDP trace."""
    ev, steps = _events(local_path, rank)
    per = {"forward": [], "backward": [], "optimizer": []}
    for s in steps:
        inside = [e for e in ev if e["cat"] == "compute" and s["ts"] <= e["ts"] <= s["ts"] + s["dur"]]
        for k in per:
            per[k].append(sum(e["dur"] for e in inside if e["name"].split()[0] == k) / 1e6)
    ev, steps = _events(ddp_path, rank)
    grads = []
    for s in steps[-1:]:
        bwd = sorted((e for e in ev if e["cat"] == "compute" and e["name"].startswith("backward")
                      and s["ts"] <= e["ts"] <= s["ts"] + s["dur"]), key=lambda e: e["ts"])[-1]
        buckets = sorted((e for e in ev if e["cat"] == "comm" and e["name"].startswith("ddp bucket")
                          and bwd["ts"] <= e["args"]["enqueued_ts"] <= bwd["ts"] + bwd["dur"]),
                         key=lambda e: e["args"]["enqueued_ts"])
        span = max(1, buckets[-1]["args"]["enqueued_ts"] - bwd["ts"]) if buckets else 1
        grads = [(e["args"]["bytes"], (e["args"]["enqueued_ts"] - bwd["ts"]) / span)
                 for e in buckets]
    return Profile(f"{local_path} + {ddp_path}", _median(per["forward"]),
                   _median(per["backward"]), _median(per["optimizer"]), grads, [])


# --- schedules ---------------------------------------------------------------------------------

def ddp_step(prof, p, links, bucket_bytes=25e6, stretch=1.0, cpu_share=0.0):
    """Step time and exposed communication of DDP at p GPUs."""
    fwd, bwd, opt = prof.forward * stretch, prof.backward * stretch, prof.optimizer * stretch
    # Re-bucket the gradients: consecutive gradients up to bucket_bytes.
    buckets, size, ready = [], 0.0, 0.0
    for nbytes, frac in prof.grads:
        size, ready = size + nbytes, frac
        if size >= bucket_bytes:
            buckets.append((size, ready))
            size = 0.0
    if size > 0:
        buckets.append((size, ready))
    t, busy_in_backward = fwd, 0.0
    end_bwd = fwd + bwd
    queue = 0.0
    for nbytes, frac in buckets:
        start = max(fwd + frac * bwd, queue)
        queue = start + all_reduce(nbytes, p, links)
        busy_in_backward += max(0.0, min(queue, end_bwd) - start)
    # On a CPU machine the communication thread takes cycles from backward.
    end_bwd += cpu_share * busy_in_backward
    t = max(end_bwd, queue) + opt
    return t, max(0.0, queue - end_bwd)


def fsdp_step(prof, p, links, prefetch=2, stretch=1.0, span=None, micro=1, overlap=True):
    """Step time and exposed communication of FSDP (FULL_SHARD) at p GPUs (a shard group of p
    GPUs within a job of `span`: the link is the one `span` GPUs cross). With `micro`
    micro-batches, each gathers every unit again in its forward and its backward (FULL_SHARD
    reshards after each), and the last reduce-scatters. overlap=False: every collective waits
    on the compute's cores (a CPU's: nothing runs beside them)."""
    units = prof.units
    if not units:
        sys.exit("scaling_model: an FSDP model needs per-unit figures (a preset)")
    if not overlap:
        gathers = sum(gather_or_scatter(u[0], p, links, span) for u in units)
        return prof.compute * stretch + (2 * micro + 1) * gathers, (2 * micro + 1) * gathers
    def phase(order, compute_of, start, reduce_after):
        gather_q = start
        done = []  # compute end per position
        t = start
        reduce_q, reduce_end = start, start
        for k, u in enumerate(order):
            # At most `prefetch` gathers outstanding: gather k waits for unit k - prefetch.
            issue = max(gather_q, done[k - prefetch] if k >= prefetch else start)
            gather_q = issue + gather_or_scatter(u[0], p, links, span)
            t = max(t, gather_q) + compute_of(u) * stretch
            done.append(t)
            if reduce_after:
                reduce_q = max(reduce_q, t) + gather_or_scatter(u[0], p, links, span)
                reduce_end = reduce_q
        return t, reduce_end

    t, red_end = 0.0, 0.0
    for k in range(micro):
        fwd_end, _ = phase(units, lambda u: u[1] / micro, t, False)
        t, red_end = phase(list(reversed(units)), lambda u: u[2] / micro, fwd_end, k == micro - 1)
    t = max(t, red_end) + prof.optimizer * stretch
    return t, t - prof.compute * stretch


# --- commands ----------------------------------------------------------------------------------

SCALES = [8, 16, 32, 64, 128, 256, 512, 1024]


def table(args):
    links = Links(args.nvlink_us * 1e-6, args.nvlink_gbps * 1e9, args.ib_us * 1e-6,
                  args.ib_gbps * 1e9, args.gpus_per_node)
    presets = [
        transformer_preset("GPT-2 small (124M), 8 x 1024 tokens/GPU", 124e6, 12, 8 * 1024,
                           args.tflops, args.mfu),
        transformer_preset("7B, 4 x 4096 tokens/GPU", 6.7e9, 32, 4 * 4096, args.tflops, args.mfu),
    ]
    print(f"Links: NVLink {args.nvlink_gbps} GB/s/GPU, {args.nvlink_us} us; InfiniBand "
          f"{args.ib_gbps} GB/s/GPU, {args.ib_us} us; {args.gpus_per_node} GPUs/node; compute "
          f"{args.tflops} TFLOP/s x MFU {args.mfu}\n")
    curves = []
    for prof in presets:
        curves.append((prof.name, [prof.compute / ddp_step(prof, p, links, args.bucket_mb * 1e6)[0]
                                   for p in SCALES],
                       [prof.compute / fsdp_step(prof, p, links, args.prefetch)[0]
                        for p in SCALES]))
        print(f"### {prof.name}: compute {prof.compute * 1e3:.1f} ms/step\n")
        print("| GPUs | DDP step (ms) | DDP exposed (ms) | DDP efficiency | "
              "FSDP step (ms) | FSDP exposed (ms) | FSDP efficiency |")
        print("|---|---|---|---|---|---|---|")
        stop = {"DDP": None, "FSDP": None}
        for p in SCALES:
            d, de = ddp_step(prof, p, links, args.bucket_mb * 1e6)
            f, fe = fsdp_step(prof, p, links, args.prefetch)
            for k, exposed, step in (("DDP", de, d), ("FSDP", fe, f)):
                if stop[k] is None and exposed > 0.05 * step:
                    stop[k] = p
            print(f"| {p} | {d * 1e3:.1f} | {de * 1e3:.1f} | {prof.compute / d:.1%} | "
                  f"{f * 1e3:.1f} | {fe * 1e3:.1f} | {prof.compute / f:.1%} |")
        print()
        for k in ("DDP", "FSDP"):
            if stop[k] is None:
                print(f"- {k}: communication stays hidden (exposed <= 5% of the step) up to "
                      f"{SCALES[-1]} GPUs.")
                continue
            p = stop[k]
            fixes = []
            if k == "DDP":
                for mb in (1, 5, 10, 25, 50, 100, 200, 400):
                    s, e = ddp_step(prof, p, links, mb * 1e6)
                    if e <= 0.05 * s:
                        fixes.append(f"bucket_cap_mb {mb}")
            else:
                for depth in (1, 2, 3, 4, 8):
                    s, e = fsdp_step(prof, p, links, depth)
                    if e <= 0.05 * s:
                        fixes.append(f"prefetch depth (limit_all_gathers) {depth}")
            print(f"- {k}: communication stops hiding at {p} GPUs (exposed > 5% of the step); "
                  + (f"hidden again there with: {', '.join(fixes)}." if fixes else
                     "no bucket size or prefetch depth hides it there: the link is the limit."))
        print()
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for (name, ddp, fsdp), color in zip(curves, ("#4c72b0", "#dd8452")):
            ax.plot(SCALES, [100 * e for e in ddp], marker="o", color=color, label=f"DDP, {name}")
            ax.plot(SCALES, [100 * e for e in fsdp], marker="s", linestyle="--", color=color,
                    label=f"FSDP, {name}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.set_ylabel("weak-scaling efficiency (%)")
        ax.set_ylim(0, 105)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title(f"dtrain's schedule, modelled: {args.gpus_per_node} GPUs/node, NVLink "
                     f"{args.nvlink_gbps:g} GB/s, IB {args.ib_gbps:g} GB/s per GPU", fontsize=10)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)
        print(f"wrote {args.plot}")


TP_SCALES = [8, 16, 32, 64, 128, 256, 512]


def tp_table(args):
    """FSDP alone against FSDP x TP (t = 2, 4, 8 inside a node) at 8-512 GPUs."""
    links = Links(args.nvlink_us * 1e-6, args.nvlink_gbps * 1e9, args.ib_us * 1e-6,
                  args.ib_gbps * 1e9, args.gpus_per_node)
    presets = [
        transformer_preset("GPT-2 small (124M), 8 x 1024 tokens/GPU", 124e6, 12, 8 * 1024,
                           args.tflops, args.mfu, hidden=768),
        transformer_preset("7B, 4 x 4096 tokens/GPU", 6.7e9, 32, 4 * 4096, args.tflops,
                           args.mfu, hidden=4096),
        transformer_preset("70B, 1 x 4096 tokens/GPU", 70e9, 80, 4096, args.tflops, args.mfu,
                           hidden=8192),
    ]
    degrees = [t for t in (1, 2, 4, 8) if t <= args.gpus_per_node]
    print("FSDP alone (tp 1) and FSDP x TP, TP inside a node (NVLink), FSDP over the rest; "
          "weak scaling (tokens per GPU fixed, a TP group takes its GPUs' tokens together); "
          "efficiency = compute / step; bf16 activations; no sequence parallelism.\n")
    for prof in presets:
        print(f"### {prof.name}: forward + backward {(prof.forward + prof.backward) * 1e3:.1f} "
              "ms/step\n")
        print("| GPUs | " + " | ".join(f"tp {t} step (ms), efficiency" for t in degrees) +
              " | best |")
        print("|---|" + "---|" * len(degrees) + "---|")
        wins = []
        for p in TP_SCALES:
            # Either way each GPU steps the optimizer on 1/p of the parameters.
            base = Profile(prof.name, prof.forward, prof.backward, prof.optimizer / p, [],
                           prof.units)
            base.hidden, base.tokens, base.layers = prof.hidden, prof.tokens, prof.layers
            cells, best = [], None
            for t in degrees:
                tp = tp_profile(base, t, p, links) if t > 1 else base
                step, _ = fsdp_step(tp, p // t, links, args.prefetch, span=p)
                cells.append(f"{step * 1e3:.1f}, {base.compute / step:.1%}")
                if best is None or step < best[1]:
                    best = (t, step)
            if best[0] > 1:
                wins.append(p)
            print(f"| {p} | " + " | ".join(cells) + f" | tp {best[0]} |")
        print()
        print("- 2-D beats FSDP alone at " + (", ".join(map(str, wins)) + " GPUs." if wins else
                                                "none of these scales.") + "\n")


def one_f_one_b(pp, m):
    """1F1B's order of actions per stage: ("F" or "B", micro-batch)."""
    orders = []
    for st in range(pp):
        warm = min(pp - st - 1, m)
        acts = [("F", i) for i in range(warm)]
        f, b = warm, 0
        while b < m:
            if f < m:
                acts.append(("F", f))
                f += 1
            acts.append(("B", b))
            b += 1
        orders.append(acts)
    return orders


def pipeline_time(pp, m, fwd, bwd, hop, latency=0.0, copies=1, cores=0):
    """The makespan of one 1F1B step: per stage and micro-batch `fwd` and `bwd` seconds of
    compute at a full core (or GPU), plus `latency` seconds that take no core (collectives
    waited inside it); `hop` seconds per message between stages. cores > 0: `copies`
    identical pipelines (dp x tp ranks each) share `cores` cores, each busy rank running at
    min(1, cores / busy ranks) (processor sharing), so a rank idle in the bubble lends its core
    to the others. cores = 0: every rank has its own."""
    orders = one_f_one_b(pp, m)
    done = {}  # (kind, stage, micro) -> end time
    nxt = [0] * pp
    left = [None] * pp  # per stage: [work left, latency left] of its running action
    t = 0.0
    while any(nxt[st] < len(orders[st]) for st in range(pp)):
        # Start every action whose inputs have arrived.
        wake = math.inf
        for st in range(pp):
            if left[st] is not None or nxt[st] >= len(orders[st]):
                continue
            kind, mb = orders[st][nxt[st]]
            deps = [done.get(("F", st - 1, mb))] if kind == "F" and st > 0 else []
            if kind == "B":
                deps.append(done.get(("F", st, mb)))
                if st < pp - 1:
                    deps.append(done.get(("B", st + 1, mb)))
            if any(d is None for d in deps):
                continue
            ready = max([t] + [d + (hop if k > 0 or kind == "F" else 0.0)
                               for k, d in enumerate(deps)])
            if ready > t:
                wake = min(wake, ready)
                continue
            left[st] = [fwd if kind == "F" else bwd, latency]
        busy = [st for st in range(pp) if left[st] is not None and left[st][0] > 0]
        rate = 1.0 if cores <= 0 or not busy else min(1.0, cores / (copies * len(busy)))
        # Advance to the next end of a compute, of a latency, or an arrival.
        step = wake - t
        for st in range(pp):
            if left[st] is None:
                continue
            w, lat = left[st]
            step = min(step, w / rate if w > 0 else lat)
        if step == math.inf:
            raise RuntimeError("pipeline_time: the schedule is stuck")
        t += step
        for st in range(pp):
            if left[st] is None:
                continue
            if left[st][0] > 0:
                left[st][0] = max(0.0, left[st][0] - step * rate)
            else:
                left[st][1] = max(0.0, left[st][1] - step)
            if left[st][0] <= 1e-15 and left[st][1] <= 1e-15:
                kind, mb = orders[st][nxt[st]]
                done[(kind, st, mb)] = t
                left[st] = None
                nxt[st] += 1
    return t


def pp_layout(prof, gpus, dp, tp, pp, m, links, prefetch=2, act_bytes=2, cores=0):
    """Step (s) and memory per GPU (bytes) of FSDP over dp x TP over tp x PP over pp stages with
    m micro-batches (1F1B), as dtrain runs them: without a pipeline FSDP gathers each unit for
    every micro-batch's forward and backward; a pipeline stage is gathered once before the
    schedule and reduce-scattered once after it. cores > 0: the GPUs are CPU ranks sharing
    `cores` cores (prof's compute is at one core): compute stretches by the ranks busy per core,
    and no collective hides under it."""
    base = Profile(prof.name, prof.forward, prof.backward, prof.optimizer / gpus, [], prof.units)
    base.hidden, base.tokens, base.layers = prof.hidden, prof.tokens, prof.layers
    tokens = prof.tokens * tp * pp  # one pipeline's: its GPUs' tokens together
    staged = tp_profile(base, tp, gpus, links, act_bytes=act_bytes, micro=m) if tp > 1 else base
    tp_comm = getattr(staged, "tp_comm", 0.0)
    stretch = max(1.0, gpus / cores) if cores > 0 else 1.0
    if pp == 1:
        if cores > 0:
            # The TP collectives wait on the critical path; only the compute shares the cores.
            compute = Profile(base.name, base.forward, base.backward, base.optimizer, [],
                              [(b / tp, f, bw) for b, f, bw in base.units])
            step, _ = fsdp_step(compute, dp, links, prefetch, stretch, gpus, m, overlap=False)
            step += tp_comm
        else:
            step, _ = fsdp_step(staged, dp, links, prefetch, span=gpus, micro=m)
    else:
        per = len(staged.units) // pp
        stage_bytes = sum(b for b, _, _ in staged.units[:per])
        a, bw = links.of(tp * pp)
        hop = a + tokens / m * prof.hidden * act_bytes / bw
        # A stage: its layers, each computing pp times its share (the GPU's compute unchanged).
        fwd, bwd = base.forward / m, base.backward / m
        latency = tp_comm / (2 * m)  # each action's TP collectives, forward and backward alike
        if cores > 0:
            run = pipeline_time(pp, m, fwd, bwd, hop, latency, copies=dp * tp, cores=cores)
        else:
            run = pipeline_time(pp, m, fwd + latency, bwd + latency, hop)
        shard = 2 * gather_or_scatter(stage_bytes, dp, links, gpus) if dp > 1 else 0.0
        step = shard + run + base.optimizer * stretch
    params = sum(b for b, _, _ in prof.units) / 2  # the units hold bf16 bytes
    states = 16 * params / gpus
    gathered = (prefetch + 1) * (params * 2 / prof.layers) / tp if dp > 1 else 0
    # Micro-batches in flight: pp on the first stage under 1F1B; one without PP (gradient
    # accumulation over the same m micro-batches).
    in_flight = min(pp, m)
    per_layers = prof.layers // pp
    acts = in_flight * tokens / m * per_layers * 34 * prof.hidden / tp
    return step, states + gathered + acts


MODELS = {
    "gpt2": ("GPT-2 small (124M)", 124e6, 12, 768, 12),
    "7b": ("7B", 6.7e9, 32, 4096, 32),
    "70b": ("70B", 70e9, 80, 8192, 64),
    # bench/run_layout_validation.sh's Llama, trained here (CPU ranks as the "GPUs").
    "llama58m": ("Llama 58M", 58.47e6, 8, 512, 8),
}


def layout(args):
    """Every (dp, tp, pp) of a cluster for one model, by modelled step; the best that fits."""
    links = Links(args.nvlink_us * 1e-6, args.nvlink_gbps * 1e9, args.ib_us * 1e-6,
                  args.ib_gbps * 1e9, args.gpus_per_node)
    name, params, layers, hidden, heads = MODELS[args.model]
    n = args.gpus
    tokens_per_gpu = args.global_tokens // n if args.global_tokens else args.tokens_per_gpu
    prof = transformer_preset(name, params, layers, tokens_per_gpu, args.tflops, args.mfu,
                              grad_bytes=args.param_bytes, hidden=hidden)
    rows = []
    for tp in (t for t in (1, 2, 4, 8) if t <= args.gpus_per_node and heads % t == 0):
        for pp in (q for q in range(1, layers + 1) if layers % q == 0):
            if n % (tp * pp):
                continue
            dp = n // (tp * pp)
            m = max(args.micro_batches, pp)
            step, mem = pp_layout(prof, n, dp, tp, pp, m, links, args.prefetch,
                                  act_bytes=args.param_bytes, cores=args.cores)
            rows.append((step, dp, tp, pp, m, mem))
    rows.sort()
    if args.json:
        for step, dp, tp, pp, m, mem in rows:
            print(json.dumps({"step_s": step, "dp": dp, "tp": tp, "pp": pp, "micro_batches": m,
                              "memory_bytes": mem}))
        return 0
    limit = args.gpu_gib * 2**30
    fits = [r for r in rows if r[5] <= limit]
    compute = prof.forward + prof.backward + prof.optimizer / n
    if args.cores > 0:  # each rank's compute at its share of the cores
        compute *= max(1.0, n / args.cores)
    print(f"{name} on {n} GPUs ({args.gpus_per_node} per node), {tokens_per_gpu} tokens "
          f"per GPU, 1F1B with max(pp, {args.micro_batches}) micro-batches; memory limit "
          f"{args.gpu_gib:g} GiB per GPU\n")
    print("| dp | tp | pp | micro-batches | step (ms) | efficiency | memory per GPU (GiB) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for step, dp, tp, pp, m, mem in rows[:args.top]:
        note = "" if mem <= limit else " (does not fit)"
        print(f"| {dp} | {tp} | {pp} | {m} | {step * 1e3:.1f} | {compute / step:.1%} | "
              f"{mem / 2**30:.1f}{note} |")
    if fits:
        step, dp, tp, pp, m, mem = fits[0]
        print(f"\nbest that fits: dp {dp} x tp {tp} x pp {pp} ({m} micro-batches): "
              f"{step * 1e3:.1f} ms, {mem / 2**30:.1f} GiB per GPU")
    else:
        print("\nno layout fits: more GPUs, fewer tokens per GPU, or recompute")
    return 0


def _fit(points):
    return fit_alpha_beta([(b, t) for b, t in points])


def validate_tp(args):
    """tp_bench's JSON lines (bench/run_tp_bench.sh): for each tp degree t and rank count p, p
    ranks side by side each computing alone what a rank of tp t computes (--local-of t: heads,
    KV heads, intermediate size and vocabulary / t, no collectives: the cores shared as in the
    real run), and the 2-D runs with --probe-comm. Predicted step of each run: that forward
    and backward; the optimizer over dp; TP's all-reduces (per layer 2
    forward and 2 backward, the embedding's and the head's, the loss's 3 small ones) and
    FSDP's all-gathers (each layer forward and backward, the root once) and reduce-scatters
    (each layer and the root), at the alpha-beta fitted to the run's own probes, added to the
    critical path: on 2 cores shared by 4 ranks a collective's thread takes the cycles compute
    needs, so overlap buys nothing here (the GPU table's schedule overlaps FSDP's)."""
    rows = [json.loads(l) for l in open(args.measured) if l.startswith("{")]
    # Each kind of run may come from several rounds (a noisy machine): medians over them.
    local = {}
    for r in rows:
        if r.get("local_of", 0) > 0:
            local.setdefault((r["local_of"], r["world"]), []).append(r)
    for key, rs in local.items():
        local[key] = {k: _median([r[k] for r in rs])
                      for k in ("forward_s", "backward_s", "median_step_s")}
    for (t, p), r in sorted(local.items()):
        print(f"{p} rank(s) each computing a tp {t} rank's part alone: forward "
              f"{r['forward_s']:.4f} s, backward {r['backward_s']:.4f} s, step "
              f"{r['median_step_s']:.4f} s")
    print()
    results = {}
    print("| mesh | ranks | predicted (s) | measured (s) | error | of it TP comm (s) | "
          "FSDP comm (s) |")
    print("|---|---|---|---|---|---|---|")
    worst = 0.0
    for r in rows:
        if r.get("local_of", 0) > 0 or r.get("sp"):
            continue
        t, dp, p = r["tp"], r["dp"], r["world"]
        h, L, hd = r["hidden"], r["layers"], r["hidden"] // r["heads"]
        layer = h * r["heads"] * hd * 2 + 2 * h * r["kv_heads"] * hd + 3 * h * r["ffn"] + 2 * h
        root = 2 * r["vocab"] * h + h
        if (t, p) not in local:
            sys.exit(f"validate-tp: no run of {p} ranks with --local-of {t}")
        one = local[(t, p)]
        f1, b1 = one["forward_s"], one["backward_s"]
        o1 = max(0.0, one["median_step_s"] - f1 - b1)
        compute = f1 + b1 + o1 / dp
        tp_c = 0.0
        if t > 1:
            a, b = _fit(r["tp_all_reduce"])
            bsh = r["batch"] * r["seq"] * h * 4
            tp_c = (4 * L + 2) * (a + b * bsh) + 3 * (a + b * r["batch"] * r["seq"] * 4)
        dp_c = 0.0
        if dp > 1:
            ga, gb = _fit(r["dp_all_gather"])
            ra, rb = _fit(r["dp_reduce_scatter"])
            unit, rootb = layer / t * 4, root / t * 4
            dp_c = (2 * L * (ga + gb * unit) + (ga + gb * rootb) + L * (ra + rb * unit) +
                    (ra + rb * rootb))
        results.setdefault((dp, t, p), []).append((compute + tp_c + dp_c, r["median_step_s"], tp_c,
                                                   dp_c))
    for (dp, t, p), rs in sorted(results.items(), key=lambda kv: (kv[0][2], -kv[0][1])):
        pred, meas = _median([x[0] for x in rs]), _median([x[1] for x in rs])
        err = (pred - meas) / meas
        worst = max(worst, abs(err))
        print(f"| shard {dp} x tp {t} | {p} | {pred:.4f} | {meas:.4f} | {err:+.1%} | "
              f"{_median([x[2] for x in rs]):.4f} | {_median([x[3] for x in rs]):.4f} |")
    print(f"\nlargest error: {worst:.1%} (target: within 15%)")
    return 0 if worst <= 0.15 else 1


def fit_alpha_beta(points):
    """Least squares t = a + b n over (n, t)."""
    n = len(points)
    sx = sum(x for x, _ in points)
    sy = sum(y for _, y in points)
    sxx = sum(x * x for x, _ in points)
    sxy = sum(x * y for x, y in points)
    b = (n * sxy - sx * sy) / (n * sxx - sx * sx)
    a = (sy - b * sx) / n
    return max(a, 0.0), b


def validate(args):
    """measured JSON: {"local_trace": PATH, "ddp_trace": PATH, "cores": 2, "threads": 1,
    "runs": [{"backend": "mpi", "ranks": 2, "step_s": 0.35,
              "all_reduce": [[bytes, seconds], ...]}, ...]}"""
    m = json.load(open(args.measured))
    prof = profile_from_traces(m["local_trace"], m["ddp_trace"])
    print(f"profile: one process (median of its traced steps) forward {prof.forward:.4f} s, "
          f"backward {prof.backward:.4f} s, optimizer {prof.optimizer:.4f} s; "
          f"{len(prof.grads)} bucket(s) of {sum(b for b, _ in prof.grads) / 1e6:.1f} MB, ready "
          f"at {', '.join(f'{f:.2f}' for _, f in prof.grads)} of backward (2-rank trace)\n")
    print("| backend | ranks | alpha (us) | bandwidth (GB/s) | predicted step (s) | "
          "measured step (s) | error |")
    print("|---|---|---|---|---|---|---|")
    worst = 0.0
    for r in m["runs"]:
        p = r["ranks"]
        # t = a + b n for the whole all-reduce: per ring step alpha, bus bandwidth B.
        a, b = fit_alpha_beta(r["all_reduce"])
        alpha = a / (2 * (p - 1))
        bw = 2 * (p - 1) / p / b
        links = Links(alpha, bw, alpha, bw, p)
        # The profile is one process's; p ranks of t threads on c cores stretch it.
        stretch = max(1.0, p * m["threads"] / m["cores"])
        pred, _ = ddp_step(prof, p, links, bucket_bytes=m.get("bucket_bytes", 25e6),
                           stretch=stretch, cpu_share=args.cpu_share)
        err = (pred - r["step_s"]) / r["step_s"]
        worst = max(worst, abs(err))
        print(f"| {r['backend']} | {p} | {alpha * 1e6:.1f} | {bw / 1e9:.2f} | {pred:.4f} | "
              f"{r['step_s']:.4f} | {err:+.1%} |")
    print(f"\nlargest error: {worst:.1%} (target: within 15%)")
    return 0 if worst <= 0.15 else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("table", help="GPT-2 small and 7B at 8 to 1024 GPUs")
    t.add_argument("--nvlink-gbps", type=float, default=450, help="per GPU, one direction")
    t.add_argument("--nvlink-us", type=float, default=3)
    t.add_argument("--ib-gbps", type=float, default=50, help="per GPU (one 400 Gb/s NIC each)")
    t.add_argument("--ib-us", type=float, default=8)
    t.add_argument("--gpus-per-node", type=int, default=8)
    t.add_argument("--tflops", type=float, default=989, help="bf16 dense peak (H100/H200)")
    t.add_argument("--mfu", type=float, default=0.4)
    t.add_argument("--bucket-mb", type=float, default=25)
    t.add_argument("--prefetch", type=int, default=2)
    t.add_argument("--plot", help="also draw the efficiencies into this PNG")
    tt = sub.add_parser("tp-table", help="FSDP alone against FSDP x TP at 8 to 512 GPUs")
    for name, default in (("nvlink-gbps", 450), ("nvlink-us", 3), ("ib-gbps", 50), ("ib-us", 8),
                          ("tflops", 989), ("mfu", 0.4)):
        tt.add_argument("--" + name, type=float, default=default)
    tt.add_argument("--gpus-per-node", type=int, default=8)
    tt.add_argument("--prefetch", type=int, default=2)
    vt = sub.add_parser("validate-tp", help="FSDP x TP predicted against tp_bench's runs here")
    vt.add_argument("--measured", required=True, help="tp_bench's JSON lines")
    vt.add_argument("--cores", type=float, default=2)
    ly = sub.add_parser("layout", help="the best (dp, tp, pp) for a model on a cluster")
    ly.add_argument("--model", choices=sorted(MODELS), default="7b")
    ly.add_argument("--gpus", type=int, default=64)
    ly.add_argument("--tokens-per-gpu", type=int, default=8192)
    ly.add_argument("--global-tokens", type=int, default=0,
                    help="a fixed global batch instead (tokens per GPU = this / GPUs)")
    ly.add_argument("--micro-batches", type=int, default=8)
    ly.add_argument("--gpu-gib", type=float, default=141, help="memory per GPU (H200: 141)")
    ly.add_argument("--top", type=int, default=8)
    for name, default in (("nvlink-gbps", 450), ("nvlink-us", 3), ("ib-gbps", 50), ("ib-us", 8),
                          ("tflops", 989), ("mfu", 0.4)):
        ly.add_argument("--" + name, type=float, default=default)
    ly.add_argument("--gpus-per-node", type=int, default=8)
    ly.add_argument("--prefetch", type=int, default=2)
    ly.add_argument("--cores", type=float, default=0,
                    help="CPU ranks sharing this many cores (--tflops: one core's); 0: GPUs")
    ly.add_argument("--param-bytes", type=int, default=2,
                    help="bytes per gathered parameter and activation (bf16: 2; fp32: 4)")
    ly.add_argument("--json", action="store_true",
                    help="every layout as a JSON line (step_s, dp, tp, pp, m, memory) instead")
    v = sub.add_parser("validate", help="predicted against measured on this machine")
    v.add_argument("--measured", required=True)
    v.add_argument("--cpu-share", type=float, default=1.0,
                   help="fraction of the communication thread's busy time during backward "
                        "that backward loses (1: it takes a core backward needed)")
    a = ap.parse_args()
    if a.cmd == "table":
        table(a)
        return 0
    if a.cmd == "tp-table":
        tp_table(a)
        return 0
    if a.cmd == "validate-tp":
        return validate_tp(a)
    if a.cmd == "layout":
        return layout(a)
    return validate(a)


if __name__ == "__main__":
    sys.exit(main())
