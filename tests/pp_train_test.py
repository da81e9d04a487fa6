"""Pipeline parallelism through dtrain-train: one config key, real jobs, against runs without it.

Each case trains configs/tiny/llama_pp.yaml (a 4-layer Llama on the byte corpus, AdamW,
clipping, 4 micro-batches, validation every 10 steps) and compares every logged step's loss, the
validation losses and the trained model (the xxh64 of every parameter, which the run logs at
its end once every rank holds the whole model) with a run of the same job without a pipeline,
made in this test. In fp32 a pipeline computes what one process computes, op for op (the
micro-batches' gradients accumulate in the same order, the clip norm is taken per parameter):
the same bits.

  pp2-1f1b        2 ranks, 2 stages under 1f1b, against one process: bitwise (the run saves the
                  checkpoint at step 10 that ckpt resumes).
  pp4-gpipe       4 ranks, 4 stages of one layer under gpipe: bitwise.
  pp2-interleaved 2 ranks, 4 stages (2 per rank) under interleaved_1f1b: bitwise.
  pp2-split       2 ranks, an uneven split (pp_split [1, 3]): bitwise.
  pp2-recompute   2 ranks, every layer recomputed in backward (model.recompute: full), against
                  one process without recompute: bitwise.
  2x2-ddp         4 ranks: 2 data-parallel pipelines of 2 stages, against DDP over 2 ranks
                  without a pipeline: bitwise (the stage's gradients averaged as DDP's; the run
                  saves the checkpoint that ckpt-2x2 resumes).
  pp2-mpi         2 ranks under mpirun (MPI's point-to-point): bitwise.
  pp2-tp2         4 ranks: 2 stages, each over a tensor-parallel group of 2 with sequence
                  parallelism, against tp 2 without a pipeline: bitwise.
  2x2-fsdp        4 ranks: 4 stages under interleaved_1f1b (2 per rank), each sharded over 2
                  data-parallel ranks (strategy fsdp), with an odd intermediate_size (129 rows:
                  uneven shards), against FSDP over 2 ranks without a pipeline: bitwise (the
                  same shards, the gradients reduce-scattered once per step and the norm taken
                  per parameter over the shards, as FSDP's). It saves at step 10
                  (checkpoint.async), which resumes at 2 x 2 and as FSDP over 2 ranks: bitwise;
                  and its model.save_pretrained writes FSDP's model.safetensors, byte for byte.
  rollback-fsdp   the spike-guard rollback of 2 x 2 sharded stages, against FSDP's: bitwise.
  3d              8 ranks: 2 stages under zero_bubble (each backward in two halves) x 2
                  sharded data-parallel ranks x tp 2 with sequence parallelism and recompute,
                  against FSDP over 2 x tp 2 (sequence parallel, no recompute) at 4 ranks:
                  bitwise.
  pp2-bf16        bf16 autocast, activations sent in bf16, against one process in bf16: within
                  bf16 rounding (the stage boundary rounds the residual stream once).
  pp2-fp16-skip   fp16 with a loss scale that overflows: every stage skips the same steps
                  (the found-inf flag agreed), as one process does.
  ckpt            pp2-1f1b's run saves at step 10 (checkpoint.async) and goes on to 20; its
                  checkpoint resumes at pp 2, in one process and at pp 4: the same losses and
                  the same trained model as the run that saved it, bit for bit.
  ckpt-2x2        the same for 2 data-parallel pipelines of 2 stages, resumed at 2 x 2 and
                  as DDP over 2 ranks without a pipeline.
  rollback        batches that make the loss spike at step 12: the spike guard rolls the pp 2
                  run back to its step-10 checkpoint and skips them, ending with one process's
                  model (which does the same), bit for bit.
  ckpt-tp         pp 2 x tp 2 saves at step 10; resumed at tp 2 without a pipeline and at pp 4
                  x tp 2 (8 ranks): bitwise.
  errors          parallel.pp (or pp x tp) that does not split the ranks, a stage without layers, a
                  pp_split that does not add up, a tied embedding, strategy none, hybrid_shard: each refused
                  before training, exit 2, naming the key.
Usage: pp_train_test.py --launcher PATH --trainer PATH [--only NAME[,NAME...]] [--no-mpi]
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_jobs import rows, run_job  # noqa: E402

CONFIG = "configs/tiny/llama_pp.yaml"


def model_hash(out):
    m = re.findall(r"parameters identical on all \d+ rank\(s\) \(xxh64 ([0-9a-f]+)\)", out)
    assert m, "no parameter hash in the log:\n" + out[-3000:]
    return m[-1]


class Runner:
    def __init__(self, args, work):
        self.args, self.work = args, work

    def run(self, name, kind, np, sets, expect_rc=0, env=None):
        run = os.path.join(self.work, name)
        os.makedirs(run, exist_ok=True)
        train = [self.args.trainer, "--config", CONFIG,
                 "--set", "logging.every_steps=1", "--set", "logging.progress_bar=false",
                 "--set", "logging.sample_tokens=0",
                 "--set", f"logging.metrics_file={run}/metrics.jsonl"]
        for s in sets:
            train += ["--set", s]
        return run, run_job(name, kind, np, train, self.args.launcher, expect_rc, env=env)


def compare(name, got, want, tol=0.0, resumed=False):
    """Losses, validation losses and the trained model of run `got` against `want` (bitwise
    when tol is 0)."""
    (got_dir, got_out), (want_dir, want_out) = got, want
    got_t, got_v = rows(os.path.join(got_dir, "metrics.jsonl"))
    want_t, want_v = rows(os.path.join(want_dir, "metrics.jsonl"))
    assert got_t, f"{name}: no steps logged"
    if resumed:
        assert min(got_t) > 10, f"{name}: did not resume after step 10: {sorted(got_t)}"
        assert set(got_t) <= set(want_t), f"{name}: steps {sorted(got_t)} not in the full run"
        got_v = {s: v for s, v in got_v.items() if s > 10}
        want_v = {s: v for s, v in want_v.items() if s > 10}
    else:
        assert sorted(got_t) == sorted(want_t), f"{name}: logged steps differ"
    assert sorted(got_v) == sorted(want_v) and got_v, f"{name}: validation steps differ"
    worst = max(abs(got_t[s] - want_t[s]) / abs(want_t[s]) for s in got_t)
    worst_v = max(abs(got_v[s] - want_v[s]) / abs(want_v[s]) for s in got_v)
    same_model = model_hash(got_out) == model_hash(want_out)
    print(f"{name}: steps {min(got_t)}-{max(got_t)}, max relative loss difference {worst:.2e}, "
          f"validation {worst_v:.2e}, trained model {'the same bits' if same_model else 'differs'}"
          f" (bound {tol:g})")
    assert worst <= tol, f"{name}: losses differ by {worst:.3e} (bound {tol})"
    assert worst_v <= tol, f"{name}: validation losses differ by {worst_v:.3e} (bound {tol})"
    if tol == 0:
        assert same_model, f"{name}: the trained parameters differ"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--launcher", required=True)
    ap.add_argument("--trainer", required=True)
    ap.add_argument("--only")
    ap.add_argument("--no-mpi", action="store_true")
    args = ap.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.exists(os.path.join(root, CONFIG)):
        os.chdir(root)
    mpi = not args.no_mpi and subprocess.run(["which", "mpirun"], capture_output=True).returncode == 0
    work = tempfile.mkdtemp(prefix="dtrain_pp_")
    r = Runner(args, work)
    one = ["parallel.pp=1", "parallel.strategy=none"]
    want = lambda n: args.only is None or n in args.only.split(",")
    refs = {}

    def ref(key, kind, np, sets):
        if key not in refs:
            refs[key] = r.run("ref-" + key, kind, np, sets)
        return refs[key]

    # The pp 2 and the 2 x 2 runs save a checkpoint at step 10 (pp 2's asynchronously): each is
    # checked against its run without a pipeline (saving changes no bit of the training) and
    # its checkpoint resumed in other layouts (ckpt, ckpt-2x2), one run serving both cases.
    ckpt_pp2, ckpt_2x2 = os.path.join(work, "ckpt"), os.path.join(work, "ckpt-2x2")
    pp2 = lambda: ref("pp2-1f1b", "launch", 2, [
        f"checkpoint.dir={ckpt_pp2}", "checkpoint.every_steps=10", "checkpoint.async=true",
        "checkpoint.keep=5"])
    two_by_two = lambda: ref("2x2-ddp", "launch", 4, [f"checkpoint.dir={ckpt_2x2}",
                                                      "checkpoint.every_steps=10"])

    if want("pp2-1f1b"):
        got = pp2()
        out = got[1]
        for line in ["mesh: pipelines (pp groups, stage 0 first) [0, 1]",
                     "pipeline: 2 stages over 2 ranks, schedule 1f1b, 4 micro-batches",
                     "pipeline: stage 0: the embedding, layers 0-1 on rank 0",
                     "pipeline: stage 1: layers 2-3, the norm and the head on rank 1"]:
            assert line in out, f"pp2-1f1b: '{line}' not in the log:\n{out[-3000:]}"
        compare("pp2-1f1b", got, ref("one", "one", 1, one))
    if want("pp4-gpipe"):
        compare("pp4-gpipe", r.run("pp4-gpipe", "launch", 4,
                                   ["parallel.pp=4", "parallel.pp_schedule=gpipe"]),
                ref("one", "one", 1, one))
    if want("pp2-interleaved"):
        compare("pp2-interleaved",
                r.run("pp2-interleaved", "launch", 2,
                      ["parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=2"]),
                ref("one", "one", 1, one))
    if want("pp2-split"):
        got = r.run("pp2-split", "launch", 2, ["parallel.pp_split=[1, 3]"])
        assert "pipeline: stage 1: layers 1-3, the norm and the head on rank 1" in got[1]
        compare("pp2-split", got, ref("one", "one", 1, one))
    if want("pp2-recompute"):
        got = r.run("pp2-recompute", "launch", 2, ["model.recompute=full"])
        assert "every layer recomputed in backward" in got[1], got[1][-3000:]
        compare("pp2-recompute", got, ref("one", "one", 1, one))
    if want("2x2-ddp"):
        got = two_by_two()
        assert "mesh: data-parallel groups (replicate x shard) [0, 1], [2, 3]" in got[1], got[1][-3000:]
        assert "mesh: pipelines (pp groups, stage 0 first) [0, 2], [1, 3]" in got[1], got[1][-3000:]
        compare("2x2-ddp", got, ref("ddp2", "launch", 2, ["parallel.pp=1"]))
    if want("pp2-mpi") and mpi:
        compare("pp2-mpi", r.run("pp2-mpi", "mpi", 2, []), ref("one", "one", 1, one))
    if want("pp2-tp2"):
        sp = ["parallel.tp=2", "parallel.sequence_parallel=true"]
        got = r.run("pp2-tp2", "launch", 4, sp)
        for line in ["mesh: pp 2 x replicate 1 x shard 1 x tp 2 = 4 rank(s), tp innermost",
                     "mesh: tp groups [0, 1] on node 0, [2, 3] on node 0",
                     "mesh: pipelines (pp groups, stage 0 first) [0, 2], [1, 3]",
                     "pipeline: stage 1: layers 2-3, the norm and the head on ranks 2, 3"]:
            assert line in got[1], f"pp2-tp2: '{line}' not in the log:\n{got[1][-3000:]}"
        compare("pp2-tp2", got, ref("tp2-sp", "launch", 2, ["parallel.pp=1"] + sp))
    fsdp = ["parallel.strategy=fsdp"]
    if want("2x2-fsdp"):
        ckpt = os.path.join(work, "ckpt-fsdp")
        odd = fsdp + ["model.intermediate_size=129"]
        interleaved = ["parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=2"]
        exported = os.path.join(work, "fsdp-hf")
        got = r.run("2x2-fsdp", "launch", 4, odd + interleaved + [
            f"checkpoint.dir={ckpt}", "checkpoint.every_steps=10", "checkpoint.async=true",
            f"model.save_pretrained={exported}"])
        line = ("pipeline: each stage sharded over its 2 data-parallel ranks (parallel.strategy "
                "fsdp, per_parameter): gathered once per step, its gradients reduce-scattered once")
        assert line in got[1], f"2x2-fsdp: '{line}' not in the log:\n{got[1][-3000:]}"
        want_hf = os.path.join(work, "fsdp2-hf")
        compare("2x2-fsdp", got, ref("fsdp2-odd", "launch", 2,
                                     ["parallel.pp=1", f"model.save_pretrained={want_hf}"] + odd))
        # The export gathers every stage's shards (a collective): the same file as FSDP's.
        with open(os.path.join(exported, "model.safetensors"), "rb") as a, \
                open(os.path.join(want_hf, "model.safetensors"), "rb") as b:
            assert a.read() == b.read(), "2x2-fsdp: model.save_pretrained wrote other bytes"
        print("2x2-fsdp: model.save_pretrained wrote FSDP's model.safetensors, byte for byte")
        saved = os.path.join(ckpt, "step_00000010")
        compare("2x2-fsdp-resume-2x2",
                r.run("fsdp-resume-2x2", "launch", 4, odd + [f"checkpoint.resume={saved}"]),
                got, resumed=True)
        compare("2x2-fsdp-resume-fsdp2",
                r.run("fsdp-resume-fsdp2", "launch", 2,
                      odd + [f"checkpoint.resume={saved}", "parallel.pp=1"]), got, resumed=True)
    if want("rollback-fsdp"):
        bad = {"DTRAIN_TEST_BAD_BATCHES": "12:2"}
        guard = fsdp + ["checkpoint.every_steps=5", "train.spike_guard.action=rollback",
                        "train.spike_guard.window=5"]
        got = r.run("rollback-2x2-fsdp", "launch", 4, guard + [
            f"checkpoint.dir={os.path.join(work, 'rollback-2x2-ckpt')}"], env=bad)
        base = r.run("rollback-fsdp2", "launch", 2, guard + ["parallel.pp=1", (
            f"checkpoint.dir={os.path.join(work, 'rollback-fsdp2-ckpt')}")], env=bad)
        assert "rolled back from step" in got[1], got[1][-3000:]
        assert model_hash(got[1]) == model_hash(base[1]), "rollback-fsdp: the trained models differ"
        print("rollback-fsdp: rolled back past the spike; the trained model is FSDP's, bitwise")
    if want("3d"):
        tp = ["parallel.tp=2", "parallel.sequence_parallel=true"] + fsdp
        got = r.run("3d", "launch", 8,
                    tp + ["model.recompute=full", "parallel.pp_schedule=zero_bubble"])
        assert "schedule zero_bubble" in got[1], got[1][-3000:]
        compare("3d", got, ref("fsdp2-tp2-sp", "launch", 4, ["parallel.pp=1"] + tp))
    if want("pp2-bf16"):
        compare("pp2-bf16", r.run("pp2-bf16", "launch", 2, ["precision.policy=bf16"]),
                ref("one-bf16", "one", 1, one + ["precision.policy=bf16"]), tol=5e-3)
    if want("pp2-fp16-skip"):
        fp16 = ["precision.policy=fp16", "precision.scaler.enabled=true",
                "precision.scaler.init_scale=1e30", "train.steps=12"]
        got = r.run("pp2-fp16-skip", "launch", 2, fp16)
        base = ref("one-fp16", "one", 1, one + fp16)
        skipped = lambda out: sorted({int(s) for s in re.findall(
            r"step (\d+): inf/NaN gradients, step skipped", out)})  # each rank warns
        print(f"pp2-fp16-skip: skipped steps {skipped(got[1])}, one process {skipped(base[1])}")
        assert skipped(got[1]) and skipped(got[1]) == skipped(base[1]), "skipped steps differ"
        compare("pp2-fp16-skip", got, base, tol=5e-3)
    if want("ckpt"):
        full = pp2()
        saved = os.path.join(ckpt_pp2, "step_00000010")
        assert os.path.isdir(saved), f"no checkpoint at step 10 in {ckpt_pp2}"
        import torch
        model = torch.load(os.path.join(saved, "model.pt"), weights_only=True)
        optim = torch.load(os.path.join(saved, "optim.pt"), weights_only=True)
        n = len(model)
        assert "model.embed_tokens.weight" in model and "lm_head.weight" in model, sorted(model)
        assert len(optim["state"]) == n, f"optim.pt holds state for {len(optim['state'])} of {n}"
        for pp, kind, np in [(2, "launch", 2), (1, "one", 1), (4, "launch", 4)]:
            sets = [f"checkpoint.resume={saved}", f"parallel.pp={pp}"]
            if pp == 1:
                sets.append("parallel.strategy=none")
            compare(f"ckpt-resume-pp{pp}", r.run(f"resume-pp{pp}", kind, np, sets), full,
                    resumed=True)
    if want("ckpt-2x2"):
        # Two data-parallel pipelines: the first pipeline's first rank writes the checkpoint.
        full = two_by_two()
        saved = os.path.join(ckpt_2x2, "step_00000010")
        compare("ckpt-2x2-resume-2x2",
                r.run("resume-2x2", "launch", 4, [f"checkpoint.resume={saved}"]), full,
                resumed=True)
        compare("ckpt-2x2-resume-ddp2",
                r.run("resume-ddp2", "launch", 2, [f"checkpoint.resume={saved}", "parallel.pp=1"]),
                full, resumed=True)
    if want("ckpt-tp"):
        ckpt = os.path.join(work, "ckpt-tp")
        full = r.run("ckpt-pp2-tp2", "launch", 4, ["parallel.tp=2", f"checkpoint.dir={ckpt}",
                                                   "checkpoint.every_steps=10"])
        saved = os.path.join(ckpt, "step_00000010")
        compare("ckpt-tp-resume-tp2",
                r.run("resume-tp2", "launch", 2, [f"checkpoint.resume={saved}", "parallel.pp=1",
                                                  "parallel.tp=2"]), full, resumed=True)
        compare("ckpt-tp-resume-pp4-tp2",
                r.run("resume-pp4-tp2", "launch", 8, [f"checkpoint.resume={saved}",
                                                      "parallel.pp=4", "parallel.tp=2"]),
                full, resumed=True)
    if want("rollback"):
        bad = {"DTRAIN_TEST_BAD_BATCHES": "12:2"}
        guard = ["checkpoint.every_steps=5", "train.spike_guard.action=rollback",
                 "train.spike_guard.window=5"]
        got = r.run("rollback-pp2", "launch", 2,
                    guard + [f"checkpoint.dir={os.path.join(work, 'rollback-pp2-ckpt')}"], env=bad)
        base = r.run("rollback-one", "one", 1, one + guard + [
            f"checkpoint.dir={os.path.join(work, 'rollback-one-ckpt')}"], env=bad)
        assert "rolled back from step" in got[1], got[1][-3000:]
        assert model_hash(got[1]) == model_hash(base[1]), "rollback: the trained models differ"
        print("rollback: rolled back past the spike; the trained model is one process's, bitwise")
    if want("errors"):
        for name, np, sets, key in [
            ("pp-ranks", 2, ["parallel.pp=4"], "parallel.pp is 4, and the job has 2 rank(s)"),
            ("pp-tp-ranks", 2, ["parallel.tp=2"], "parallel.pp x parallel.tp is 2 x 2"),
            ("pp-empty", 1, ["parallel.pp=8"], "parallel.pp"),
            ("pp-split-sum", 1, ["parallel.pp_split=[1, 2]"], "parallel.pp_split"),
            ("pp-tied", 1, ["model.tie_word_embeddings=true"], "tie_word_embeddings"),
            ("pp-none", 1, ["parallel.strategy=none"], "strategy none has no data-parallel"),
            ("pp-hybrid", 1, ["parallel.strategy=fsdp", "parallel.sharding_strategy=hybrid_shard"],
             "parallel.sharding_strategy"),
            ("pp-interleaved-v1", 1, ["parallel.pp_schedule=interleaved_1f1b"],
             "pp_stages_per_rank"),
        ]:
            _, out = r.run(name, "launch" if np > 1 else "one", np, sets, expect_rc=2)
            assert key in out, f"{name}: the error does not name '{key}':\n{out[-2000:]}"
            print(f"{name}: refused: {[l for l in out.splitlines() if key in l][0][-160:]}")
    print("pp_train_test: passed")


if __name__ == "__main__":
    main()
