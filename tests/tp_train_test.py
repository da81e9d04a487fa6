"""Tensor parallelism through dtrain-train: one config key, real jobs, against runs without it.

Each case trains configs/tiny/llama_tp.yaml (a small Llama on the byte corpus, AdamW, clipping,
two micro-batches, validation) and compares every logged step's loss, the validation losses
and the final parameters (the model written by model.save_pretrained, gathered over the TP
groups) with a run of the same job without tensor parallelism, made in this test:

  tp2-sp-launch   2 ranks, one TP group with sequence parallelism (dtrain-launch), against one
                  process: the same batches, so the same numbers within fp32 rounding.
  tp2-ddp-mpi     2 ranks under mpirun, TP without sequence parallelism, strategy ddp.
  2x2-fsdp        4 ranks: FSDP over 2 data-parallel ranks x tp 2 with sequence parallelism,
                  against FSDP over 2 ranks without TP.
  2x2-ddp-mpi     4 ranks under mpirun: DDP x tp 2, against DDP over 2 ranks.
  tp2-bf16        bf16 autocast under TP against one process in bf16 (a looser bound: bf16's
                  rounding moves with the order of additions).
  ckpt-mesh       checkpoints across meshes: a tp 2 run (FSDP over 1, sequence parallel) saves
                  at step 10 and goes on to 20; its step-10 checkpoint (model.pt and optim.pt
                  hold the whole tensors) resumes at tp 2 (the same losses, bit for bit), in
                  one process without TP and at tp 4 over 4 ranks (the same losses within fp32
                  rounding, and the same trained model).
  ckpt-sharded    sharded checkpoints across meshes: FSDP over 2 x tp 2 with sequence
                  parallelism saves sharded at step 10 (each rank's file its FSDP shards of its
                  tp slices) and goes on to 20; the checkpoint resumes at 2 x 2 (bit for bit),
                  at FSDP over 2 without TP (the same losses within fp32 rounding), and at tp 4
                  over 4 ranks and in one process (one data-parallel rank each: the same
                  batches, so each other's losses within rounding).
  errors          parallel.tp that does not split the ranks, that does not divide the heads, a
                  model without a plan, sequence parallelism over a seq_len it does not divide:
                  each refused before training, exit 2, naming the key.
Usage: tp_train_test.py --launcher PATH --trainer PATH [--only NAME[,NAME...]] [--no-mpi]
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_jobs import rows, run_job  # noqa: E402

CONFIG = "configs/tiny/llama_tp.yaml"


class Runner:
    def __init__(self, args, work):
        self.args, self.work = args, work

    def run(self, name, kind, np, sets, expect_rc=0, config=CONFIG):
        run = os.path.join(self.work, name)
        os.makedirs(run, exist_ok=True)
        train = [self.args.trainer, "--config", config,
                 "--set", "logging.every_steps=1", "--set", "logging.progress_bar=false",
                 "--set", f"logging.metrics_file={run}/metrics.jsonl"]
        if config == CONFIG:
            train += ["--set", f"model.save_pretrained={run}/hf"]
        for s in sets:
            train += ["--set", s]
        return run, run_job(name, kind, np, train, self.args.launcher, expect_rc)


def load_safetensors(path):
    from safetensors.torch import load_file
    return load_file(path)


def compare(name, got_dir, want_dir, tol, param_tol):
    got_t, got_v = rows(os.path.join(got_dir, "metrics.jsonl"))
    want_t, want_v = rows(os.path.join(want_dir, "metrics.jsonl"))
    assert sorted(got_t) == sorted(want_t) and got_t, f"{name}: logged steps differ"
    assert sorted(got_v) == sorted(want_v) and got_v, f"{name}: validation steps differ"
    worst = max(abs(got_t[s] - want_t[s]) / abs(want_t[s]) for s in want_t)
    worst_v = max(abs(got_v[s] - want_v[s]) / abs(want_v[s]) for s in want_v)
    got_p = load_safetensors(os.path.join(got_dir, "hf", "model.safetensors"))
    want_p = load_safetensors(os.path.join(want_dir, "hf", "model.safetensors"))
    assert sorted(got_p) == sorted(want_p), f"{name}: saved tensors differ in names"
    worst_p = 0.0
    for k, w in want_p.items():
        g = got_p[k]
        assert g.shape == w.shape, f"{name}: {k} saved as {tuple(g.shape)}, want {tuple(w.shape)}"
        worst_p = max(worst_p, float((g.float() - w.float()).abs().max() / w.float().abs().max()))
    print(f"{name}: {len(want_t)} steps, max relative loss difference {worst:.2e}, "
          f"validation {worst_v:.2e}, saved parameters {worst_p:.2e} (bounds {tol:g}, "
          f"{param_tol:g})")
    assert worst < tol, f"{name}: losses differ by {worst:.3e} (bound {tol})"
    assert worst_v < tol, f"{name}: validation losses differ by {worst_v:.3e} (bound {tol})"
    assert worst_p < param_tol, f"{name}: parameters differ by {worst_p:.3e} (bound {param_tol})"


def compare_resumed(name, got_dir, want_dir, tol, param_tol, bitwise=False):
    """A resumed run's steps against the same steps of the run it was saved from."""
    got_t, _ = rows(os.path.join(got_dir, "metrics.jsonl"))
    want_t, _ = rows(os.path.join(want_dir, "metrics.jsonl"))
    assert got_t and min(got_t) > 10, f"{name}: did not resume after step 10: {sorted(got_t)}"
    assert set(got_t) <= set(want_t), f"{name}: steps {sorted(got_t)} not all in the full run"
    if bitwise:
        differ = [s for s in got_t if got_t[s] != want_t[s]]
        assert not differ, (f"{name}: losses differ at steps {differ}: "
                            f"{[(got_t[s], want_t[s]) for s in differ]}")
    worst = max(abs(got_t[s] - want_t[s]) / abs(want_t[s]) for s in got_t)
    got_p = load_safetensors(os.path.join(got_dir, "hf", "model.safetensors"))
    want_p = load_safetensors(os.path.join(want_dir, "hf", "model.safetensors"))
    assert sorted(got_p) == sorted(want_p), f"{name}: saved tensors differ in names"
    worst_p = max(float((got_p[k].float() - w.float()).abs().max() / w.float().abs().max())
                  for k, w in want_p.items())
    print(f"{name}: steps {min(got_t)}-{max(got_t)} after the resume, max relative loss "
          f"difference {worst:.2e}{' (bitwise)' if bitwise else ''}, saved parameters "
          f"{worst_p:.2e} (bounds {tol:g}, {param_tol:g})")
    assert worst < tol, f"{name}: losses differ by {worst:.3e} (bound {tol})"
    assert worst_p < param_tol, f"{name}: parameters differ by {worst_p:.3e} (bound {param_tol})"


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
    work = tempfile.mkdtemp(prefix="dtrain_tp_")
    r = Runner(args, work)
    off = ["parallel.tp=1", "parallel.sequence_parallel=false"]
    want = lambda n: args.only is None or n in args.only.split(",")
    refs = {}

    def ref(key, kind, np, sets):
        if key not in refs:
            refs[key], _ = r.run("ref-" + key, kind, np, sets)
        return refs[key]

    if want("tp2-sp-launch"):
        got, out = r.run("tp2-sp-launch", "launch", 2, [])
        assert "mesh: tp groups [0, 1] on node 0" in out, out[-3000:]
        compare("tp2-sp-launch", got, ref("one", "one", 1, off + ["parallel.strategy=none"]),
                5e-6, 2e-3)
    if want("tp2-ddp-mpi") and mpi:
        got, _ = r.run("tp2-ddp-mpi", "mpi", 2,
                       ["parallel.strategy=ddp", "parallel.sequence_parallel=false"])
        compare("tp2-ddp-mpi", got, ref("one", "one", 1, off + ["parallel.strategy=none"]),
                5e-6, 2e-3)
    if want("2x2-fsdp"):
        got, out = r.run("2x2-fsdp", "launch", 4, [])
        assert "mesh: data-parallel groups (replicate x shard) [0, 2], [1, 3]" in out, out[-3000:]
        compare("2x2-fsdp", got, ref("fsdp2", "launch", 2, off), 5e-6, 2e-3)
    if want("2x2-ddp-mpi") and mpi:
        got, _ = r.run("2x2-ddp-mpi", "mpi", 4, ["parallel.strategy=ddp"])
        compare("2x2-ddp-mpi", got, ref("ddp2", "mpi", 2, off + ["parallel.strategy=ddp"]),
                5e-6, 2e-3)
    if want("tp2-bf16"):
        got, _ = r.run("tp2-bf16", "launch", 2, ["precision.policy=bf16"])
        compare("tp2-bf16", got,
                ref("one-bf16", "one", 1,
                    off + ["parallel.strategy=none", "precision.policy=bf16"]), 1e-2, 5e-2)
    if want("ckpt-mesh"):
        # num_key_value_heads 4 so that tp 4 divides it; every run the same model.
        kv = ["model.num_key_value_heads=4"]
        ckpt = os.path.join(work, "ckpt-tp2")
        full, _ = r.run("ckpt-tp2", "launch", 2, kv + [f"checkpoint.dir={ckpt}",
                                                      "checkpoint.every_steps=10"])
        saved = os.path.join(ckpt, "step_00000010")
        import torch
        model = torch.load(os.path.join(saved, "model.pt"), weights_only=True)
        q = model["model.layers.0.self_attn.q_proj.weight"]
        assert tuple(q.shape) == (64, 64), f"model.pt holds a slice: q_proj {tuple(q.shape)}"
        optim = torch.load(os.path.join(saved, "optim.pt"), weights_only=True)
        shapes = {tuple(s["exp_avg"].shape) for s in optim["state"].values()}
        assert (64, 64) in shapes and (128, 64) in shapes, f"optim.pt holds slices: {shapes}"
        for name, kind, np, sets, bitwise in [
                ("ckpt-tp2-to-tp2", "launch", 2, [], True),
                ("ckpt-tp2-to-one", "one", 1, off + ["parallel.strategy=none"], False),
                ("ckpt-tp2-to-tp4", "launch", 4, ["parallel.tp=4"], False)]:
            again = os.path.join(work, name + "-ckpt")
            shutil.copytree(saved, os.path.join(again, "step_00000010"))
            got, out = r.run(name, kind, np, kv + sets + [f"checkpoint.dir={again}"])
            assert "resumed from" in out, out[-3000:]
            compare_resumed(name, got, full, 5e-6, 2e-3, bitwise)
    if want("ckpt-sharded"):
        kv = ["model.num_key_value_heads=4"]
        ckpt = os.path.join(work, "ckpt-2x2")
        full, _ = r.run("ckpt-2x2", "launch", 4, kv + [f"checkpoint.dir={ckpt}",
                                                      "checkpoint.every_steps=10",
                                                      "checkpoint.format=sharded"])
        saved = os.path.join(ckpt, "step_00000010")
        meta = json.load(open(os.path.join(saved, "meta.json")))
        assert meta["mode"] == "sharded" and meta["tp"] == 2, {k: meta.get(k) for k in ("mode", "tp")}
        assert not os.path.exists(os.path.join(saved, "model.pt")), os.listdir(saved)
        got = {}
        for name, kind, np, sets in [
                ("ckpt-2x2-to-2x2", "launch", 4, ["checkpoint.format=sharded"]),
                ("ckpt-2x2-to-shard2", "launch", 2, off),
                ("ckpt-2x2-to-tp4", "launch", 4, ["parallel.tp=4"]),
                ("ckpt-2x2-to-one", "one", 1, off + ["parallel.strategy=none"])]:
            again = os.path.join(work, name + "-ckpt")
            shutil.copytree(saved, os.path.join(again, "step_00000010"))
            got[name], out = r.run(name, kind, np, kv + sets + [f"checkpoint.dir={again}"])
            assert "resumed from" in out and "(sharded, written at 4 rank(s))" in out, out[-3000:]
        compare_resumed("ckpt-2x2-to-2x2", got["ckpt-2x2-to-2x2"], full, 5e-6, 2e-3, True)
        compare_resumed("ckpt-2x2-to-shard2", got["ckpt-2x2-to-shard2"], full, 5e-6, 2e-3)
        compare_resumed("ckpt-2x2-to-tp4 (against one process)", got["ckpt-2x2-to-tp4"],
                        got["ckpt-2x2-to-one"], 5e-6, 2e-3)
    if want("errors"):
        cases = [
            (["parallel.tp=4", "model.num_key_value_heads=4"],
             "parallel.tp is 4, and the job has 2 rank(s)"),
            (["parallel.tp=8", "model.num_key_value_heads=4", "model.num_attention_heads=4"],
             "parallel.tp: tensor parallelism over 8 ranks cuts model.num_attention_heads (4)"),
            (["parallel.tp=2", "configs/tiny/fsdp_fp32.yaml"], "model.type transformer has no "
             "tensor-parallel plan"),
            (["model.seq_len=31"], "sequence_parallel: splits each sequence of model.seq_len 31"),
        ]
        for sets, text in cases:
            config = [s for s in sets if s.endswith(".yaml")] or [CONFIG]
            _, out = r.run("error", "launch", 2, [s for s in sets if not s.endswith(".yaml")],
                           expect_rc=2, config=config[0])
            assert text in out, f"error case {sets}: '{text}' not in:\n{out[-3000:]}"
            print(f"errors: {' '.join(sets)}: refused, exit 2: ...{text}...")
    print("tp_train_test: all cases passed")


if __name__ == "__main__":
    main()
