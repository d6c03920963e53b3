"""Where training numbers go: ``metrics.jsonl`` (one JSON object per row), TensorBoard, ``summary.json``, ``loss.png``.

Rows carry ``kind`` ("train" or "eval") and ``step`` (optimizer steps completed), so a reader can filter
without guessing from the keys. Only rank 0 writes; on other ranks the writer is a no-op. The files' names and
their readers live in :mod:`fp8_recipes.rundir`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

from fp8_recipes.rundir import (
    LOSS_PLOT,
    METRICS,
    TENSORBOARD,
    jsonable,
    read_metrics,
)

__all__ = ["MetricsWriter", "plot_loss"]


class MetricsWriter:
    """Append rows to ``run_dir/metrics.jsonl`` and scalars to TensorBoard (``run_dir/tb``)."""

    def __init__(self, run_dir: str | os.PathLike, *, enabled: bool = True, tensorboard: bool = True):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self._tb = None
        self._stage: dict[str, str] = {}  # the last precision stage written to TensorBoard, per kind
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.run_dir / METRICS, "a", encoding="utf-8")  # append: a resumed run continues
        if tensorboard:
            try:  # tensorboard is a declared dependency, but a missing one should not stop training
                from torch.utils.tensorboard import SummaryWriter
                self._tb = SummaryWriter(log_dir=str(self.run_dir / TENSORBOARD))
            except Exception as e:  # noqa: BLE001
                print(f"metrics: TensorBoard disabled ({type(e).__name__}: {e})")

    def log(self, row: dict[str, Any]) -> None:
        """Write one row; numeric fields also go to TensorBoard as ``<kind>/<key>`` at ``row['step']``, and the
        precision ``stage`` (a label: "bf16 warmup", "fp8 w+a", ...) as the text ``<kind>/stage`` where it changes."""
        if not self.enabled:
            return
        self._file.write(json.dumps({k: jsonable(v) for k, v in row.items()}) + "\n")
        self._file.flush()  # a crashed run keeps every row written so far
        if self._tb is not None:
            kind = row.get("kind", "train")
            for key, value in row.items():
                if key not in ("step", "kind") and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(f"{kind}/{key}", value, row["step"])
            if isinstance(row.get("text"), str):  # a row's one line, e.g. an autopilot action
                self._tb.add_text(f"{kind}/text", row["text"], row["step"])
            stage = row.get("stage")
            if isinstance(stage, str) and stage and stage != self._stage.get(kind):
                self._tb.add_text(f"{kind}/stage", stage, row["step"])
                self._stage[kind] = stage

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _series(rows: Iterable[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pairs = [(r["step"], float(r[key])) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def plot_loss(run_dir: str | os.PathLike) -> Path:
    """Plot train loss, validation loss and full-precision validation loss from metrics.jsonl to ``loss.png``."""
    import matplotlib
    matplotlib.use("Agg")  # no display on cluster nodes; must precede pyplot's import
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for key, style, label in (("loss", "-", "train"), ("val_loss", "o-", "validation"),
                              ("val_loss_full_precision", "s--", "validation, full precision")):
        steps, values = _series(rows, key)
        if steps:
            ax.plot(steps, values, style, label=label, linewidth=1.2, markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(run_dir) / LOSS_PLOT
    fig.savefig(path)
    plt.close(fig)
    return path
