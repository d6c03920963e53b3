"""Writing benchmark results: JSON, a Markdown table, and bar charts when matplotlib is installed.

A bare GPU image may lack matplotlib: the JSON is always written, and ``python scripts/bench_*.py --plot-only
FILE.json`` draws the PNG later wherever matplotlib is (e.g. the CPU machine's .venv).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

__all__ = ["RESULTS", "bar_chart", "load_result", "markdown_table", "save_json", "save_outputs"]


RESULTS: dict[str, tuple[str, tuple[str, ...], str, tuple[str, ...]]] = {
    # kind: (the script writing it, its keys, the key of its rows, every row's keys)
    "train": ("bench_train", ("device", "seq", "mbs", "warmup", "steps", "seconds", "rows"), "rows",
              ("model", "config")),
    "gemm": ("bench_gemm", ("device", "te", "warmup", "iters", "configs", "rows"), "rows",
             ("shape", "bf16_ms", "bf16_tflops", "configs")),
    "stats": ("bench_stats", ("interval", "steps", "repeats", "rows"), "rows",
              ("recipe", "step_s_off", "step_s_on", "overhead_pct", "in_run_overhead_pct")),
    "parallel": ("bench_parallel", ("date", "runs"), "runs", ("layout", "recipe", "gpus")),
}
"""What ``--plot-only`` reads of each benchmark's result (its ``kind``). Results written before the key ``kind``
(bench_stats', bench_parallel's in docs/bench) are told by their keys."""
MEASURED_TRAIN_ROW = ("te_recipe", "tokens_per_s", "peak_mem_gib")
"""A bench_train row's keys unless it was skipped or failed (:func:`unmeasured`)."""


def unmeasured(row: dict[str, Any]) -> str | None:
    """Why a bench_train row holds no measurement: ``skipped: <reason>`` (decided before it ran) or ``failed:
    <error>`` (its process ended in an error; the others ran on), else None."""
    for key in ("skipped", "failed"):
        if key in row:
            return f"{key}: {row[key]}"
    return None


def load_result(path: Path, kind: str) -> dict[str, Any]:
    """A benchmark's result JSON of ``kind`` (:data:`RESULTS`) for ``--plot-only``; a missing, unreadable or
    non-JSON file, or one another script (or none) wrote, exits with one ``error: --plot-only: ...`` line (exit
    code 2) before anything is drawn."""
    import sys

    from fp8_recipes.checks import clipped

    fix = f"give the .json a run of scripts/{RESULTS[kind][0]}.py wrote"
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0] if str(e) else \
            type(e).__name__
        problem = f"cannot read '{path}' as a result JSON ({why})"
    else:
        problem, fix = _result_problem(path, data, kind) or (None, fix)
    if problem:
        print(clipped(f"error: --plot-only: {problem}; {fix}"), file=sys.stderr)
        sys.exit(2)
    return data


def _result_problem(path: Path, data: Any, kind: str) -> tuple[str, str] | None:
    """(why ``data`` is no ``kind`` result --plot-only can draw: another benchmark's, a foreign file; the fix), or
    None."""
    script, keys, rows_key, row_keys = RESULTS[kind]
    fix = f"give the .json a run of scripts/{script}.py wrote"
    if not isinstance(data, dict):
        return f"'{path}' holds a {type(data).__name__}, not a benchmark result", fix
    found = data.get("kind") if isinstance(data.get("kind"), str) else None
    found = found or next((k for k, spec in RESULTS.items() if all(key in data for key in spec[1])), None)
    if found != kind and found in RESULTS:
        other = RESULTS[found][0]
        return f"'{path}' is a {other} result, not a {script} one", \
            f"redraw it with scripts/{other}.py --plot-only {path}"
    if found != kind:
        return f"'{path}' is not a {script} result" + (f" (its kind is {found!r})" if found else ""), fix
    missing = [key for key in keys if key not in data]
    rows = data.get(rows_key)
    if missing or not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        return f"'{path}' is not a complete {script} result (" + (
            f"no {missing[0]!r})" if missing else f"{rows_key!r} is not a list of rows)"), fix
    for i, row in enumerate(rows):
        need = row_keys + (MEASURED_TRAIN_ROW if kind == "train" and unmeasured(row) is None else ())
        lacking = [key for key in need if key not in row]
        if lacking:
            return f"'{path}' is not a complete {script} result ({rows_key}[{i}] has no {lacking[0]!r})", fix
    return None


def save_json(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return path


def save_outputs(out_dir: Path, stem: str, result: Any, summarize: Callable[[Any], str],
                 plot: Callable[[Any, Path], Any]) -> str:
    """STEM.json (the result), STEM.md (its table) and STEM.png (its plot) in ``out_dir``; returns the table."""
    save_json(out_dir / f"{stem}.json", result)
    table = summarize(result)
    (out_dir / f"{stem}.md").write_text(table + "\n")
    plot(result, out_dir / f"{stem}.png")
    return table


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


def _pyplot(path: Path) -> Any:
    """matplotlib's pyplot on the Agg backend (no display on GPU nodes); None, with a note naming ``path``, where
    matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # must precede pyplot's import
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"note: matplotlib is not installed: no {path.name}; draw it elsewhere with --plot-only")
        return None
    return plt


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches="tight")  # (the legend beside the axes, a long title: all kept)
    plt.close(fig)
    return path


def bar_chart(path: Path, groups: list[str], series: dict[str, list[float]], *, ylabel: str, title: str,
              baseline: float | None = 1.0) -> Path | None:
    """Grouped bars (one group per x label, one bar per series); None (and a note) without matplotlib."""
    plt = _pyplot(path)
    if plt is None:
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
    return _save(fig, path)


def stacked_bars(path: Path, labels: list[str], parts: dict[str, list[float]], *, xlabel: str,
                 title: str) -> Path | None:
    """One horizontal bar per label (top to bottom), made of ``parts`` (name: a value per label) stacked left to
    right; None (and a note) without matplotlib."""
    plt = _pyplot(path)
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(10.0, 1.2 + 0.45 * len(labels)), dpi=120)
    left = [0.0] * len(labels)
    ys = range(len(labels))
    for name, values in parts.items():
        ax.barh(ys, values, left=left, label=name)
        left = [a + b for a, b in zip(left, values, strict=True)]
    ax.set_yticks(ys, labels, fontsize=8)
    ax.invert_yaxis()  # (the first label on top)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)
