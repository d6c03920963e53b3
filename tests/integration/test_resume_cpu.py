"""Checkpoint / resume on the CPU (issue 6 item 3): ``trainer.resume=auto|<dir>`` continues a run bit-exactly.

The reference is one uninterrupted 10-step run that checkpoints at step 6 (``save_interval=6``). That step_6
directory is exactly what a run killed after step 6 leaves behind; it is copied into a fresh run dir next to a
half-written checkpoint (``.step_8.tmp``) and a ``step_8`` that ``latest`` does not name yet (a crash between
the rename and the pointer update), and ``trainer.resume=auto`` must pick step 6 and reproduce steps 7-10:
losses and gradient norms equal, final weights and FP8 scaling state equal.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from fp8_recipes.training.checkpoint import find_resume
from fp8_recipes.training.metrics import read_metrics
from test_train_cpu import compose_train, dataset, small_run  # noqa: F401  (dataset: the shared fixture)

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

STEPS, SAVED = 10, 6
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS")


def train_run(recipe: str, run_dir: Path, dataset: list[str], *extra: str, steps: int = STEPS) -> dict:
    from fp8_recipes.training.run import run_training

    overrides = [o for o in small_run(run_dir, steps=steps) if not o.startswith("trainer.save_checkpoints=")]
    overrides += [f"+recipe={recipe}", f"trainer.save_interval={SAVED}", *dataset, *extra]
    with pytest.MonkeyPatch.context() as mp:
        for var in LAUNCH_VARS:
            mp.delenv(var, raising=False)
        return run_training(compose_train(overrides))


def rows(run_dir: Path) -> dict[int, tuple[float, float]]:
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in read_metrics(run_dir, "train")}


def payload(step_dir: Path) -> dict:
    return torch.load(step_dir / "tp_00.pt", weights_only=True)


def assert_same(a, b) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif torch.is_tensor(a):
        assert torch.equal(a, b)
    else:
        assert a == b


@pytest.fixture(scope="module")
def reference(dataset, tmp_path_factory) -> dict[str, Path]:
    """recipe -> the run dir of an uninterrupted 10-step run with checkpoints step_6 and step_10 (made on demand)."""
    runs: dict[str, Path] = {}

    def get(recipe: str) -> Path:
        if recipe not in runs:
            runs[recipe] = tmp_path_factory.mktemp(f"full_{recipe}")
            train_run(recipe, runs[recipe], dataset)
        return runs[recipe]

    return get


@pytest.mark.parametrize("recipe", ["delayed", "bf16"])
def test_resume_is_bit_exact_and_skips_unfinished_checkpoints(recipe, reference, dataset, tmp_path):
    full = reference(recipe)
    assert (full / "checkpoints" / "latest").read_text().strip() == f"step_{STEPS}"
    if recipe == "delayed":  # the scaling state carries real amax histories and scales into the resumed run
        scalers = payload(full / "checkpoints" / f"step_{SAVED}")["precision"]["scalers"]
        assert scalers and any(float(sd["history"].abs().sum()) > 0 for r in scalers.values() for sd in r.values())

    # What a run killed after step 8's save began (but before `latest` moved) leaves: resume must use step 6.
    ckpts = tmp_path / "checkpoints"
    shutil.copytree(full / "checkpoints" / f"step_{SAVED}", ckpts / f"step_{SAVED}")
    (ckpts / "latest").write_text(f"step_{SAVED}\n")
    for unfinished in (".step_8.tmp", "step_8"):
        (ckpts / unfinished).mkdir()
        (ckpts / unfinished / "tp_00.pt").write_bytes(b"half-written")
    summary = train_run(recipe, tmp_path, dataset, "trainer.resume=auto")

    assert summary["steps"] == STEPS
    resumed, reference_rows = rows(tmp_path), rows(full)
    assert sorted(resumed) == list(range(SAVED + 1, STEPS + 1))
    assert resumed == {s: reference_rows[s] for s in resumed}  # loss and grad norm, bit for bit
    a, b = payload(full / "checkpoints" / f"step_{STEPS}"), payload(ckpts / f"step_{STEPS}")
    for key in ("model", "optimizer", "master_params", "precision", "scheduler"):
        assert_same(a[key], b[key])


@pytest.mark.parametrize("recipe", ["tensorwise", "bf16"])
def test_resume_under_another_recipe_resets_scaling_state(recipe, reference, dataset, tmp_path, caplog):
    step_dir = reference("delayed") / "checkpoints" / f"step_{SAVED}"
    with caplog.at_level(logging.INFO, logger="fp8_recipes"):
        summary = train_run(recipe, tmp_path, dataset, f"trainer.resume={step_dir}")
    said = [r.getMessage() for r in caplog.records if "scaling state reset" in r.getMessage()]
    assert len(said) == 1 and f"'delayed', this run uses '{recipe}'" in said[0], said
    assert summary["steps"] == STEPS and sorted(rows(tmp_path)) == list(range(SAVED + 1, STEPS + 1))
    assert all(torch.isfinite(torch.tensor(v)).all() for v in rows(tmp_path).values())


def test_resume_auto_without_checkpoint_starts_fresh(dataset, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="fp8_recipes"):
        summary = train_run("bf16", tmp_path, dataset, "trainer.resume=auto", steps=2)
    assert summary["steps"] == 2 and sorted(rows(tmp_path)) == [1, 2]
    assert any("no checkpoint" in r.getMessage() and "starting fresh" in r.getMessage() for r in caplog.records)


def test_resume_refuses_unfinished_or_missing_checkpoints(tmp_path):
    from fp8_recipes.training.config import TrainerConfig

    tmp = tmp_path / "checkpoints" / ".step_8.tmp"
    tmp.mkdir(parents=True)
    (tmp / "tp_00.pt").write_bytes(b"half-written")
    for where in (tmp, tmp_path, tmp_path / "checkpoints"):  # no `latest`: nothing finished to resume from
        with pytest.raises(ValueError, match=r"^trainer\.resume: "):
            find_resume(str(where), tmp_path)
    assert find_resume("auto", tmp_path) is None and find_resume(None, tmp_path) is None
    with pytest.raises(ValueError, match=r"^trainer\.resume='/no/such/run': no such directory"):
        TrainerConfig.from_cfg({"resume": "/no/such/run"})
    with pytest.raises(ValueError, match=r"^trainer\.resume: 3 is not a string"):
        TrainerConfig.from_cfg({"resume": 3})


def test_batches_start_at_an_offset_exactly():
    from fp8_recipes.megatron.data import batches

    dataset = [{k: torch.full((3,), i) for k in ("tokens", "labels", "loss_mask", "position_ids")} for i in range(10)]
    full = batches(dataset, 3, seed=7)  # 3 batches per epoch (one sample dropped): skips cross epochs
    stream = [next(full)["tokens"] for _ in range(12)]
    for skip in (0, 2, 3, 7):
        it = batches(dataset, 3, seed=7, skip=skip)
        assert all(torch.equal(next(it)["tokens"], want) for want in stream[skip:])
