"""A run directory with one owner, end to end (issue 19; the pieces are unit-tested in tests/unit/test_rundir.py):
scripts/train.py refuses another run's directory in one line before Hydra writes into it, alone and under torchrun;
the default run_dir keeps a hostile recipe name inside runs/; a run resumed after a kill keeps one metrics row per
step."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fp8_recipes.rundir import LOCK, METRICS, read_metrics
from test_resume_cpu import train_run
from test_train_cpu import ROOT, compose_train, dataset, small_run  # noqa: F401  (dataset: the shared fixture)

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def _old_run(run_dir: Path) -> dict[str, bytes]:
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text("old: config\n")
    (run_dir / "train.log").write_text("the old run's log\n")
    (run_dir / METRICS).write_text('{"kind": "train", "step": 1, "loss": 3.0}\n')
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}


@pytest.mark.parametrize("launcher", [[], ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]],
                         ids=["one-process", "torchrun"])
def test_a_fresh_start_into_another_runs_directory_is_refused_untouched(tmp_path, launcher):
    run_dir = tmp_path / "old"
    before = _old_run(run_dir)
    proc = subprocess.run([sys.executable, *launcher, "scripts/train.py", f"run_dir={run_dir}"], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr or launcher  # (torchrun reports a failed worker with its own traceback)
    assert "fp8_recipes" not in proc.stderr.split("Traceback")[-1] or not launcher, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: run_dir: '{run_dir}' already holds another run ({METRICS}); choose another run_dir, "
                      f"or continue that run with trainer.resume=auto"], proc.stderr[-3000:]
    after = {str(p.relative_to(run_dir)): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert after == before  # neither Hydra's files nor the run's were rewritten or removed


def test_a_run_dir_inside_another_runs_checkpoints_is_refused(tmp_path, dataset):  # noqa: F811
    """A hostile-input sweep: run_dir=runs/a/checkpoints/x trained a run among runs/a's step_N folders and `latest`.
    Refused in one line naming run_dir before Hydra creates it; the other run stays as it was."""
    old = tmp_path / "old"
    _old_run(old)
    (old / "checkpoints" / "step_1").mkdir(parents=True)
    (old / "checkpoints" / "latest").write_text("step_1\n")
    before = {str(p.relative_to(old)): p.read_bytes() for p in old.rglob("*") if p.is_file()}
    run_dir = old / "checkpoints" / "x"
    proc = subprocess.run([sys.executable, "scripts/train.py", *dataset, *small_run(run_dir, num_layers=1, steps=1)],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert errors == [f"error: run_dir: '{run_dir}' is inside checkpoints/ of the run in '{old}'; choose a run_dir "
                      f"outside that run's directory (e.g. beside it)"], proc.stderr[-3000:]
    assert not run_dir.exists()
    assert {str(p.relative_to(old)): p.read_bytes() for p in old.rglob("*") if p.is_file()} == before


def test_the_default_run_dir_keeps_a_hostile_recipe_name_in_runs():
    cfg = compose_train(["+recipe=hybrid", "recipe.name=../../x"])
    run_dir = Path(cfg.run_dir)
    assert run_dir.parent == Path("runs") and run_dir.name.startswith("x-"), run_dir
    assert cfg.run_dir == cfg.run_dir  # resolved once: reading it again gives the same name


def test_a_resume_after_a_kill_keeps_one_row_per_step(dataset, tmp_path):  # noqa: F811
    run_dir = tmp_path / "run"
    train_run("delayed", run_dir, dataset, "trainer.save_checkpoints=true", "trainer.save_interval=2", steps=4)
    reference = {r["step"]: r["loss"] for r in read_metrics(run_dir, "train")}
    # what kill -9 after step 4's row, before its checkpoint, leaves: rows 1-4 (and half a fifth), checkpoint step 2
    ckpts = run_dir / "checkpoints"
    shutil.rmtree(ckpts / "step_4")
    (ckpts / "latest").write_text("step_2\n")
    with open(run_dir / METRICS, "a") as f:
        f.write('{"kind": "train", "st')
    (run_dir / "summary.json").unlink()
    train_run("delayed", run_dir, dataset, "trainer.save_checkpoints=true", "trainer.save_interval=2",
              "trainer.resume=auto", steps=4)
    rows = read_metrics(run_dir, "train")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert {r["step"]: r["loss"] for r in rows} == reference  # the re-run steps replaced, bit for bit
    assert not (run_dir / LOCK).exists() or json.loads((run_dir / LOCK).read_text())["pid"] == os.getpid()


TORCHRUN_4 = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]


@pytest.mark.slow
def test_a_refused_fresh_start_under_four_ranks_leaves_nothing(tmp_path):
    """issue 27 (class 6): each rank once let Hydra create run_dir, .hydra/ and a train.log handler at its own pace,
    and rank 0's clean-up of a refused start raced them: about 1 start in 8 left .hydra/ or train.log behind, or a
    rank printed a logging traceback for the directory rank 0 had just removed. 12 starts, each into a fresh
    run_dir, 3 at a time (the contention for 2 cores varies the ranks' pace); the refusal comes before any model
    is built."""
    for batch in range(4):
        run_dirs = [tmp_path / f"run{batch}-{i}" for i in range(3)]
        procs = [subprocess.Popen([sys.executable, *TORCHRUN_4, "scripts/train.py", "trainer.global_batch_size=7",
                                   f"run_dir={run_dir}"], cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True) for run_dir in run_dirs]
        for run_dir, proc in zip(run_dirs, procs):
            stderr = proc.communicate(timeout=120)[1]
            assert proc.returncode != 0, stderr[-3000:]
            errors = [line for line in stderr.splitlines() if line.startswith("error:")]
            assert len(errors) == 1 and errors[0].startswith("error: trainer.global_batch_size=7"), stderr[-3000:]
            # torchrun's own report of a failed worker is its one traceback; none from a worker
            assert stderr.count("Traceback") == stderr.count("ChildFailedError:"), stderr[-3000:]
            assert not run_dir.exists(), (run_dir.name, sorted(p.name for p in run_dir.rglob("*")))
