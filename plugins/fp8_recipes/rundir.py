"""A run directory's files: their names and how they are read and written, in one place.

    run_dir/
      .hydra/                 Hydra's composed config of the run (config.yaml, overrides.yaml)
      train.log               the log, with timestamps (Hydra's job logging)
      plan.txt                the resolved per-layer precision plan (``explain``)
      recipe.yaml             the resolved recipe the run trained with
      metrics.jsonl           one JSON object per row: ``{"kind": "train" | "eval", "step": N, ...}``
      numerics.jsonl          statistics (debug.interval); a pipelined run adds numerics.stageN.jsonl per stage
      tb/                     TensorBoard
      summary.json            the run's results (written atomically, at the end and on a stop)
      loss.png                train and validation loss
      checkpoints/step_N/     checkpoints (training/checkpoint.py)

Training writes these files; the doctor, the benchmarks, the Slurm launcher and evaluation read them. Imports
nothing of ours but the guarded YAML reader (neither torch nor Hydra): any floor may use it.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from fp8_recipes.yaml_guard import load_yaml

__all__ = [
    "CHECKPOINTS",
    "HYDRA",
    "LOSS_PLOT",
    "METRICS",
    "NUMERICS",
    "PLAN",
    "RECIPE",
    "RUN_OUTPUTS",
    "SUMMARY",
    "TENSORBOARD",
    "TRAIN_LOG",
    "RunFileError",
    "jsonable",
    "last_metrics_step",
    "numerics_files",
    "numerics_name",
    "read_jsonl",
    "read_metrics",
    "read_numerics",
    "read_recipe",
    "read_summary",
    "write_summary",
    "write_text",
]

HYDRA = ".hydra"
TRAIN_LOG = "train.log"
PLAN = "plan.txt"
RECIPE = "recipe.yaml"
METRICS = "metrics.jsonl"
NUMERICS = "numerics.jsonl"
TENSORBOARD = "tb"
SUMMARY = "summary.json"
LOSS_PLOT = "loss.png"
CHECKPOINTS = "checkpoints"

RUN_OUTPUTS = (HYDRA, TRAIN_LOG, PLAN, RECIPE, METRICS, TENSORBOARD, SUMMARY, LOSS_PLOT)
"""What Hydra and a run write into run_dir besides checkpoints and statistics: a run that failed on its input loses
exactly these (training/errors.py: remove_partial_run_dir), nothing else."""


class RunFileError(ValueError):
    """A line of a run's JSONL file that is not JSON; ``str()`` names the file and the line."""

    def __init__(self, path: Path, line: int, msg: str):
        super().__init__(f"{path} line {line} is not JSON ({msg})")
        self.path, self.line, self.msg = path, line, msg


def jsonable(value: Any) -> Any:
    """``value`` as JSON can hold it: JSON has no NaN/inf, so they stay visible as strings rather than invalid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every row of a JSONL file (blank lines skipped); RunFileError at the first line that is not JSON."""
    path = Path(path)
    rows = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise RunFileError(path, i, e.msg) from None
    return rows


def read_metrics(run_dir: str | os.PathLike, kind: str | None = None) -> list[dict[str, Any]]:
    """All rows of ``run_dir/metrics.jsonl`` (optionally only one ``kind``)."""
    return [r for r in read_jsonl(Path(run_dir) / METRICS) if kind is None or r.get("kind") == kind]


def last_metrics_step(run_dir: str | os.PathLike) -> int | None:
    """The step of the last metrics row, reading only the file's tail (a progress bar over a running run); None
    when there is none yet."""
    try:
        with open(Path(run_dir) / METRICS, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 4096))
            last = f.read().splitlines()[-1]
        return int(json.loads(last)["step"])
    except (OSError, ValueError, IndexError, KeyError):
        return None


def numerics_name(stage: int | None) -> str:
    """The statistics file of pipeline stage ``stage`` (None or 0: numerics.jsonl): each stage's first rank writes its
    own modules' rows to its own file; module names are global, so the files read as one."""
    return NUMERICS if not stage else f"numerics.stage{stage}.jsonl"


def numerics_files(run_dir: str | os.PathLike) -> list[Path]:
    """A run's statistics files that exist, stage by stage: numerics.jsonl, numerics.stage1.jsonl, ..."""
    run_dir = Path(run_dir)
    stages = []
    for path in run_dir.glob("numerics.stage*.jsonl"):
        number = path.name.split(".")[1].removeprefix("stage")
        if number.isdigit():
            stages.append((int(number), path))
    first = run_dir / NUMERICS
    return ([first] if first.is_file() else []) + [p for _, p in sorted(stages)]


def read_numerics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every row of the run's statistics (numerics.jsonl and, for a pipelined run, each stage's file)."""
    return [row for path in numerics_files(run_dir) for row in read_jsonl(path)]


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``path`` atomically (a reader, or a run killed meanwhile, never leaves half a file)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


def write_summary(run_dir: str | os.PathLike, summary: dict[str, Any]) -> Path:
    """Write ``run_dir/summary.json`` (atomically: a reader never sees half a file)."""
    return write_text(Path(run_dir) / SUMMARY,
                      json.dumps({k: jsonable(v) for k, v in summary.items()}, indent=2) + "\n")


def read_summary(run_dir: str | os.PathLike) -> dict[str, Any]:
    """``run_dir/summary.json``, or {} when there is none or it cannot be read (a run killed before its end)."""
    try:
        summary = json.loads((Path(run_dir) / SUMMARY).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}


def read_recipe(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The resolved recipe a run trained with (``run_dir/recipe.yaml``) as plain YAML data, None when the run has
    none; yaml_guard.UnsafeYAML when the file is not a safe YAML document."""
    path = Path(run_dir) / RECIPE
    if not path.is_file():
        return None
    data = load_yaml(path.read_bytes(), str(path))
    return data if isinstance(data, dict) else {}
