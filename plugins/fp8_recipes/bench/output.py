"""Writing benchmark results: JSON, a Markdown table, and a bar chart when matplotlib is installed.

A bare GPU image may lack matplotlib: the JSON is always written, and ``python scripts/bench_*.py --plot-only
FILE.json`` draws the PNG later wherever matplotlib is (e.g. the CPU machine's .venv).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

__all__ = ["bar_chart", "markdown_table", "save_json"]


def load_result(path: Path) -> dict[str, Any]:
    """A benchmark's result JSON for ``--plot-only``; a missing, unreadable or non-JSON file exits with one
    ``error: --plot-only: ...`` line (exit code 2)."""
    import sys

    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0] if str(e) else \
            type(e).__name__
        print(f"error: --plot-only: cannot read '{path}' as a result JSON ({why}); give the .json a run of this "
              f"script wrote", file=sys.stderr)
        sys.exit(2)
    if not isinstance(data, dict):
        print(f"error: --plot-only: '{path}' holds a {type(data).__name__}, not a benchmark result; give the .json a "
              f"run of this script wrote", file=sys.stderr)
        sys.exit(2)
    return data


def save_json(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return path


def _cell(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return f"{v:.3g}" if abs(v) < 1 else (f"{v:.2f}" if abs(v) < 100 else f"{v:,.0f}")
    return "-" if v is None else str(v)


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def bar_chart(path: Path, groups: list[str], series: dict[str, list[float]], *, ylabel: str, title: str,
              baseline: float | None = 1.0) -> Path | None:
    """Grouped bars (one group per x label, one bar per series); None (and a note) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on GPU nodes; must precede pyplot's import
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"note: matplotlib is not installed: no {path.name}; draw it elsewhere with --plot-only")
        return None
    width = 0.8 / max(len(series), 1)
    fig, ax = plt.subplots(figsize=(max(7.0, 1.1 * len(groups) + 3.5), 4.0), dpi=120)
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [v if v is not None else math.nan for v in values], width, label=name)
    if baseline is not None:
        ax.axhline(baseline, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)), groups, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, never over them
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
