"""Non-finite steps through scripts/train.py: a NaN seen by one rank of two skips the step on both, identically;
``trainer.on_nonfinite=stop`` ends the run with exit code 3 and one line, keeping its outputs.

NaNs are injected by a test-only sitecustomize that patches the engine's training loss (training/engine.py): the loss
*value* of the chosen training forwards becomes NaN while its gradients stay finite, so only the rank that computed
it can tell.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fp8_recipes.rundir import read_metrics
from test_train_cpu import DUMP_HOOK, dataset, small_run  # noqa: F401  (the shared tiny dataset fixture)

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

ROOT = Path(__file__).resolve().parents[2]

# FP8_TEST_NAN="RANK:FIRST[-LAST];...": training forwards (0-based, one per step here) whose loss turns NaN.
NAN_HOOK = r'''
import os
if os.environ.get("FP8_TEST_NAN") and (os.environ.get("RANK") is not None or os.environ.get("FP8_TEST_NAN_SINGLE")):
    from fp8_recipes.training.engine import Engine

    _rank = int(os.environ.get("RANK", 0))
    _steps = set()
    for _part in os.environ["FP8_TEST_NAN"].split(";"):
        _r, _s = _part.split(":")
        _lo, _, _hi = _s.partition("-")
        if int(_r) == _rank:
            _steps |= set(range(int(_lo), int(_hi or _lo) + 1))
    _train_loss, _calls = Engine._train_loss, [0]

    def _nan_train_loss(self, loss_mask, losses):  # training forwards only (evaluation has its own loss)
        loss, reported = _train_loss(self, loss_mask, losses)
        if _calls[0] in _steps:
            loss = loss + loss.detach() * float("nan")  # the value only: grads stay finite
            reported = {"loss": reported["loss"] * float("nan")}
        _calls[0] += 1
        return loss, reported

    Engine._train_loss = _nan_train_loss
'''


def hooked_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(DUMP_HOOK + NAN_HOOK)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "OMP_NUM_THREADS")}
    env.update(PYTHONPATH=os.pathsep.join([str(hook), env.get("PYTHONPATH", "")]).rstrip(os.pathsep), **extra)
    return env


@pytest.mark.slow
def test_nan_on_one_rank_skips_on_both(dataset, tmp_path):  # noqa: F811
    dump = tmp_path / "dump"
    dump.mkdir()
    run_dir = tmp_path / "run"
    env = hooked_env(tmp_path, FP8_TEST_DUMP=str(dump), FP8_TEST_NAN="1:2")  # rank 1's third step only
    overrides = ["+recipe=delayed", *dataset, *small_run(run_dir, steps=6), "trainer.micro_batch_size=2"]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "scripts/train.py", *overrides], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr
    rows = read_metrics(run_dir, "train")
    assert [r["skipped"] for r in rows] == [False, False, True, False, False, False]
    assert rows[2]["loss"] == "nan" and rows[3]["lr"] == rows[2]["lr"]
    assert proc.stdout.count("optimizer step skipped (1 in a row, 1 in all)") == 1  # rank 0 reports it
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["skipped_steps"] == 1 and summary["bf16_fallbacks"] == 0
    r0, r1 = (json.loads((dump / f"rank{i}.json").read_text()) for i in (0, 1))
    # Rank 0 saw a finite loss and finite grads, yet skipped too: the replicas and their delayed scales agree.
    assert r0["params"] == r1["params"] and r0["scales"] == r1["scales"] and r0["histories"] == r1["histories"]


def test_stop_mode_exits_with_one_line(dataset, tmp_path):  # noqa: F811
    run_dir = tmp_path / "run"
    env = hooked_env(tmp_path, FP8_TEST_NAN="0:1-99", FP8_TEST_NAN_SINGLE="1")
    overrides = [*dataset, *small_run(run_dir, num_layers=1, steps=6), "trainer.on_nonfinite=stop",
                 "trainer.max_consecutive_skips=2"]
    proc = subprocess.run([sys.executable, "scripts/train.py", *overrides], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out[-4000:]
    assert "Traceback" not in out
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0] == [line for line in proc.stderr.splitlines() if line.strip()][-1]
    assert errors[0].startswith("error: trainer.max_consecutive_skips: 2 steps in a row (to step 3)")
    assert "trainer.on_nonfinite=stop" in errors[0]
    assert [r["skipped"] for r in read_metrics(run_dir, "train")] == [False, True, True]  # outputs are kept
    assert json.loads((run_dir / "summary.json").read_text())["stopped"] == errors[0].removeprefix("error: ")


def test_stop_checkpoints_the_last_good_state_and_resumes_with_a_lower_lr(dataset, tmp_path, monkeypatch):  # noqa: F811
    """on_nonfinite=stop writes checkpoints/step_N (N = the last step run) holding the state of the last good step,
    names it in its one line, and a run resumed from it under a lower trainer.lr trains at that LR."""
    from test_resume_cpu import assert_same, payload
    from test_train_cpu import compose_train

    from fp8_recipes.training.run import run_training

    run_dir = tmp_path / "run"
    env = hooked_env(tmp_path, FP8_TEST_NAN="0:1-99", FP8_TEST_NAN_SINGLE="1")  # every step from the second on
    overrides = [*dataset, *(o for o in small_run(run_dir, num_layers=1, steps=6) if "save_checkpoints" not in o),
                 "trainer.on_nonfinite=stop", "trainer.max_consecutive_skips=2", "trainer.save_interval=1"]
    proc = subprocess.run([sys.executable, "scripts/train.py", *overrides], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 3, (proc.stdout + proc.stderr)[-4000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    ckpts = run_dir / "checkpoints"
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: trainer.max_consecutive_skips: 2 steps in a row (to "
                                                     "step 3)"), proc.stderr[-3000:]
    assert errors[0].endswith(f"the weights from before step 2 are checkpointed in {ckpts / 'step_3'} (continue "
                              f"with trainer.resume={ckpts / 'step_3'} and a lower trainer.lr or another recipe)")
    assert (ckpts / "latest").read_text().strip() == "step_3" and not list(ckpts.glob(".*.tmp"))
    last_good, stopped = payload(ckpts / "step_1"), payload(ckpts / "step_3")  # step_2: save_interval's, skipped
    assert stopped["step"] == 3
    for key in ("model", "optimizer", "scheduler"):  # the skipped steps changed nothing
        assert_same(stopped[key], last_good[key])
    assert json.loads((ckpts / "step_3" / "meta.json").read_text())["consumed_samples"] == 3 * 4  # past the bad data

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(var, raising=False)  # in this process: one rank
    # Continue (no NaNs now) under a lower LR: steps 4-6, at the new peak LR's schedule (step 4 is the schedule's
    # second step, still warming up: lr x 2/2), not the checkpoint's 2e-3.
    summary = run_training(compose_train([*overrides, "trainer.resume=auto", "trainer.lr=5e-4"]))
    rows = read_metrics(run_dir, "train")
    assert summary["steps"] == 6 and summary["stopped"] is None
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and [r["skipped"] for r in rows[3:]] == [False] * 3
    assert rows[3]["lr"] == 5e-4 and rows[0]["lr"] == 1e-3  # (the first run's step 1: 2e-3 x 1/2)
