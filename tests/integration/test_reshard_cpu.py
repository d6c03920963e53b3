"""Resuming at another tensor / pipeline / virtual-pipeline layout (training/reshard.py), 2-rank gloo runs on the CPU.

A TP=2 run with the distributed optimizer and a PP=2 run with the plain one each train 3 steps and checkpoint. Then
a chain of resumes, each at another layout than the checkpoint it starts from and each writing checkpoints at its
own layout for the next one:

    TP=2 (distributed optimizer) step 3 -> TP=1 (to step 7, saving step 5) -> TP=2 from step 5
    PP=2 (plain optimizer)       step 3 -> PP=1 (to step 7, saving step 5) -> PP=2 x VPP=2 from step 5 (saving
                                 step 6) -> PP=1 from step 6

and the TP=2 and PP=2 checkpoints evaluated in one process (scripts/eval_checkpoint.py), resharded on load.

In each resume a hook re-saves what the run loaded before it trains, and the two checkpoints, joined into whole
tensors, hold the same weights, fp32 main params and Adam moments bit for bit. Every run goes to step 7 (one LR
schedule), so the steps two runs share train the same losses up to summation order: the TP=1 run's equal a TP=2
continuation of the same checkpoint's, and each later resume's equal those of the run it resumed.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from test_train_cpu import ROOT, dataset  # noqa: F401  (dataset: the shared session fixture)

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

SAVED, MID, END = 3, 5, 7  # the first checkpoints, the ones resumed next, the last step of every resume
# After loading, before training: save what was loaded to argv[1] (a run dir), then train as scripts/train.py does.
RESAVE = r'''
import runpy, sys
from fp8_recipes.training import checkpoint, loop

_load, out = loop.load_checkpoint, sys.argv[1]


def load(path, **kwargs):
    step = _load(path, **kwargs)
    checkpoint.save_checkpoint(out, step, engine=kwargs["engine"], precision=kwargs.get("precision"),
                               scheduler=kwargs.get("scheduler"))
    return step


loop.load_checkpoint = load
sys.argv = ["scripts/train.py", *sys.argv[2:]]
runpy.run_path("scripts/train.py", run_name="__main__")
'''


def _args(data: list[str], run_dir: Path, steps: int, *extra: str) -> list[str]:
    # vocab 512: padded alike at TP=1 and TP=2 (a multiple of 128 x TP)
    return ["+recipe=bf16", *data, f"trainer.max_steps={steps}", "trainer.warmup_steps=2", "trainer.eval_interval=0",
            "trainer.eval_iters=1", "trainer.micro_batch_size=2", "trainer.global_batch_size=4", "model.num_layers=4",
            "model.vocab_size=512", f"run_dir={run_dir}", *extra]


def _launch(argv: list[str], ranks: int, port: int) -> list:
    """``python ARGV`` in one process, or under torchrun with ``ranks`` processes; output to a file (processes
    waiting on each other must not block on a full pipe)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID",
                                                            "SLURM_STEP_NUM_TASKS", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    launcher = ["-m", "torch.distributed.run", f"--nproc-per-node={ranks}", f"--master-port={port}"] if ranks > 1 \
        else []
    log = tempfile.NamedTemporaryFile("w+", prefix="reshard-", suffix=".log")  # noqa: SIM115  (removed once read)
    return [(subprocess.Popen([sys.executable, *launcher, *argv], cwd=ROOT, env=env, text=True, stdout=log,
                              stderr=subprocess.STDOUT), log)]


def _wait(procs: list) -> str:
    out = ""
    try:
        for p, log in procs:
            p.wait(timeout=600)
            log.seek(0)
            text = log.read()
            assert p.returncode == 0, text[-4000:]
            out += text
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
    return out


def _wait_code(procs: list, code: int = 2) -> str:
    (p, log), = procs
    p.wait(timeout=600)
    log.seek(0)
    text = log.read()
    assert p.returncode == code, text[-4000:]
    return text


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if r.get("kind") == "train"}


def _whole(step_dir: Path) -> tuple[dict, dict]:
    from fp8_recipes.training.checkpoint import checkpoint_meta, read_checkpoint
    from fp8_recipes.training.reshard import join_shards

    meta = checkpoint_meta(step_dir)
    layout = (meta["tensor_model_parallel_size"], meta["pipeline_model_parallel_size"],
              meta["virtual_pipeline_model_parallel_size"])
    return join_shards(lambda t, p, _: read_checkpoint(step_dir, t, pp_rank=p), layout, 4, optimizer=True)


@pytest.mark.slow
def test_resume_at_another_tensor_and_pipeline_layout(dataset, tmp_path, free_port):  # noqa: F811
    (tmp_path / "resave.py").write_text(RESAVE)
    tp2, pp2 = tmp_path / "tp2", tmp_path / "pp2"
    dist = "trainer.use_distributed_optimizer=true"
    # one run at a time: runs started together would each have rank 0 re-check the shared dataset
    _wait(_launch(["scripts/train.py", *_args(dataset, tp2, SAVED, "trainer.tensor_model_parallel_size=2", dist)], 2,
                  free_port()))
    _wait(_launch(["scripts/train.py", *_args(dataset, pp2, SAVED, "trainer.pipeline_model_parallel_size=2")], 2,
                  free_port()))
    # (run, the checkpoint it resumes, ranks, its layout and optimizer, its save_interval); in order: each resumes
    # a checkpoint that an earlier one wrote at its own layout
    chain = [("tp2-at-1", tp2 / "checkpoints" / f"step_{SAVED}", 1, [dist], MID),
             ("pp2-at-1", pp2 / "checkpoints" / f"step_{SAVED}", 1, [], MID),
             ("tp1-at-2", tmp_path / "tp2-at-1" / "checkpoints" / f"step_{MID}", 2,
              ["trainer.tensor_model_parallel_size=2", dist], 0),
             ("pp1-at-vpp", tmp_path / "pp2-at-1" / "checkpoints" / f"step_{MID}", 2,
              ["trainer.pipeline_model_parallel_size=2", "trainer.virtual_pipeline_model_parallel_size=2"], MID + 1),
             ("vpp-at-1", tmp_path / "pp1-at-vpp" / "checkpoints" / f"step_{MID + 1}", 1, [], 0)]
    for name, step_dir, ranks, extra, interval in chain:
        loaded = tmp_path / f"{name}-loaded"
        out = _wait(_launch([str(tmp_path / "resave.py"), str(loaded), *_args(
            dataset, tmp_path / name, END, f"trainer.resume={step_dir}", f"trainer.save_interval={interval}",
            *extra)], ranks, free_port() if ranks > 1 else 0))
        assert "resume: resharded" in out and "Traceback" not in out, (name, out[-3000:])

        model, states = _whole(step_dir)
        model2, states2 = _whole(loaded / "checkpoints" / step_dir.name)
        assert model.keys() == model2.keys() and states.keys() == states2.keys(), name
        assert all(torch.equal(model[k], model2[k]) for k in model), name
        keys = {k for s in states.values() for k in s}
        assert {"exp_avg", "exp_avg_sq", "param"} <= keys, (name, keys)
        for k, per_key in states.items():
            assert per_key.keys() == states2[k].keys() and all(
                torch.equal(v, states2[k][key]) for key, v in per_key.items()), (name, k)
        assert all(torch.any(s["exp_avg"] != 0) for s in states.values()), name  # trained moments, not fresh ones
    # scripts/eval_checkpoint.py evaluates in one process: a TP=2 or PP=2 checkpoint is resharded on load and
    # evaluates exactly as the same weights saved at TP=1 PP=1 (what the resumes above loaded and re-saved)
    from fp8_recipes.training.evaluate import evaluate_checkpoint

    for saved_by, run in [(tp2, "tp2-at-1"), (pp2, "pp2-at-1")]:
        split = evaluate_checkpoint(saved_by, recipe="tensorwise")
        whole = evaluate_checkpoint(tmp_path / run, checkpoint=tmp_path / f"{run}-loaded" / "checkpoints" /
                                    f"step_{SAVED}", recipe="tensorwise")
        assert split["trained_steps"] == whole["trained_steps"] == SAVED, (split, whole)
        assert (split["fp8_loss"], split["bf16_loss"]) == (whole["fp8_loss"], whole["bf16_loss"]), (split, whole)
        assert split["fp8_loss"] != split["bf16_loss"] and math.isfinite(split["fp8_loss"]), split

    # the reference of the first resume: the TP=2 run continued at its own layout from the same checkpoint
    _wait(_launch(["scripts/train.py", *_args(dataset, tmp_path / "tp2-at-2", END, f"trainer.resume={chain[0][1]}",
                                              "trainer.tensor_model_parallel_size=2", dist,
                                              "trainer.save_checkpoints=false")], 2, free_port()))

    # a vocabulary padded otherwise at TP=1 (257 tokens: 512 rows at TP=2, 384 at TP=1): one line, nothing written
    refused = _wait_code(_launch(["scripts/train.py", *_args(dataset, tmp_path / "refused", END,
                                                             f"trainer.resume={chain[0][1]}", dist,
                                                             "model.vocab_size=null")], 1, 0))
    assert [line for line in refused.splitlines() if line.startswith("error:")] == [(
        f"error: trainer.tensor_model_parallel_size: 1 pads the vocabulary to 384 rows, the checkpoint's 2 to 512 "
        f"({chain[0][1]}); resume with trainer.tensor_model_parallel_size=2, or a size that pads it alike "
        f"(to a multiple of 128 x TP)")], refused[-3000:]
    assert "Traceback" not in refused and not (tmp_path / "refused" / "metrics.jsonl").exists()

    # (run, the run whose losses it must train at the steps both ran): the same checkpoint's other continuation,
    # or the run it resumed; summation order differs (TP's all-reduce, the stages' order)
    for run, reference in [("tp2-at-1", "tp2-at-2"), ("tp1-at-2", "tp2-at-1"), ("pp1-at-vpp", "pp2-at-1"),
                           ("vpp-at-1", "pp1-at-vpp")]:
        losses, ref = _losses(tmp_path / run), _losses(tmp_path / reference)
        start = int(next(step_dir for name, step_dir, *_ in chain if name == run).name[5:])
        assert sorted(losses) == list(range(start + 1, END + 1)) and all(map(math.isfinite, losses.values())), run
        assert max(abs(losses[s] - ref[s]) / abs(ref[s]) for s in losses) < 1e-3, (run, losses, ref)
