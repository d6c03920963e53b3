"""Where a run's statistics live, torch-free (the recorder writes them, the doctor reads them): numerics.jsonl, and for
a pipelined run one file per further stage, numerics.stageN.jsonl (each stage's first rank writes its own modules'
rows; module names are global, so the files read as one)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["numerics_name", "numerics_files"]


def numerics_name(stage: int | None) -> str:
    """The statistics file of pipeline stage ``stage`` (None or 0: numerics.jsonl)."""
    return "numerics.jsonl" if not stage else f"numerics.stage{stage}.jsonl"


def numerics_files(run_dir: str | os.PathLike) -> list[Path]:
    """A run's statistics files that exist, stage by stage: numerics.jsonl, numerics.stage1.jsonl, ..."""
    run_dir = Path(run_dir)
    stages = []
    for path in run_dir.glob("numerics.stage*.jsonl"):
        number = path.name.split(".")[1].removeprefix("stage")
        if number.isdigit():
            stages.append((int(number), path))
    first = run_dir / "numerics.jsonl"
    return ([first] if first.is_file() else []) + [p for _, p in sorted(stages)]
