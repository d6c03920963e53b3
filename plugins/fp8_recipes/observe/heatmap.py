"""Heat maps of a run: modules x steps (the recorder's ``numerics_underflow.png``) and MoE experts x steps.

    plot_heatmap({module: {step: value}}, path)                 # what the recorder writes when a run closes
    expert_heatmap(run_dir, stat="scale_gap", out=None)         # `fp8-recipes heatmap RUN_DIR --stat scale_gap`

The expert view has one row per routed expert (``L<layer> E<expert>``, layers then experts in order) and one column
per recorded step, from the run's numerics.jsonl and routing.jsonl (:data:`EXPERT_STATS`):

=================== =======================================================================================
tokens              the tokens the expert received that step (routing.jsonl; every training step)
weight              their mean routing weight (routing.jsonl)
underflow_pct       % of its non-zero values lost to zero, worst of its two linears, for `role` (numerics)
block_underflow_pct NVFP4: % of its non-zero 16-value blocks whose E4M3 scale is 0, worst of its linears
scale_gap           how far its delayed scale is from the current one, |log2(delayed / current)|, worst of its
                    linears and GEMMs for `role` (numerics; 0 = the scale current scaling would pick; 6 = 64x)
=================== =======================================================================================

A blank cell is a step without a value: an expert with no token (no activation or gradient row), a step without
statistics, a scale gap under current scaling (there is none) or a delayed operand's first row (its scale is 1
from an empty history, as in TE: the doctor leaves it out too). A map with no value at all is refused in one line
that says which of these applies (:func:`_nothing_because`); `role` picks the rows of the numerics statistics only.
The rows are read through rundir.py's readers: a damaged row is refused in one line naming its file and line, as
the doctor does. Imports matplotlib (and numpy) only, where it plots.
"""

from __future__ import annotations

import math
import os
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

__all__ = ["EXPERT_STATS", "expert_grid", "expert_heatmap", "plot_heatmap"]

EXPERT_STATS = {"tokens": "tokens", "weight": "mean routing weight", "underflow_pct": "%",
                "block_underflow_pct": "% of blocks", "scale_gap": "|log2(delayed / current scale)|"}
"""The expert view's statistics -> the colour bar's label."""


_NUMERICS = ("underflow_pct", "block_underflow_pct", "scale_gap")
"""The statistics from numerics.jsonl (the others from routing.jsonl)."""


def plot_heatmap(heat: dict[str, dict[int, float]], path: Path, what: str = "underflow % of fprop activations",
                 unit: str = "%", strip: str = "decoder."):
    """Rows (in the mapping's order) x steps (columns), colour = `what`; blank where a row has no value. The PNG is
    written atomically: a plot that fails half-way leaves nothing (and an earlier file as it was)."""
    import matplotlib
    matplotlib.use("Agg")  # no display on cluster nodes; must precede pyplot's import
    import matplotlib.pyplot as plt
    import numpy as np

    path = Path(path)
    modules = list(heat)
    steps = sorted({s for per in heat.values() for s in per})
    grid = np.full((len(modules), len(steps)), np.nan)
    for i, m in enumerate(modules):
        for j, s in enumerate(steps):
            grid[i, j] = heat[m].get(s, np.nan)
    fig, ax = plt.subplots(figsize=(min(4 + 0.35 * len(steps), 16), min(2 + 0.3 * len(modules), 20)), dpi=110)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        im = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest")
        ax.set_yticks(range(len(modules)), [m.removeprefix(strip) for m in modules], fontsize=7)
        ticks = list(range(0, len(steps), max(1, len(steps) // 12)))
        ax.set_xticks(ticks, [str(steps[j]) for j in ticks], fontsize=7)
        ax.set_xlabel("step")
        ax.set_title(what, fontsize=9)
        fig.colorbar(im, ax=ax, label=unit)
        fig.tight_layout()
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return path


def _expert_label(layer: int, expert: int) -> str:
    return f"L{layer} E{expert}"


def expert_grid(numerics: list[dict[str, Any]], routing: list[dict[str, Any]], stat: str = "scale_gap",
                role: str = "activations") -> dict[str, dict[int, float]]:
    """{"L<layer> E<expert>": {step: value}} for :func:`plot_heatmap` (see the module docstring); every expert of
    the routing rows has a row, even one without a value."""
    from fp8_recipes.observe.doctor_experts import expert_of  # (pure: no torch)
    from fp8_recipes.observe.doctor_findings import _usable_rows
    from fp8_recipes.rundir import json_number

    if stat not in EXPERT_STATS:
        raise ValueError(f"--stat: {stat!r} is not one of {' | '.join(EXPERT_STATS)}")
    grid: dict[tuple[int, int], dict[int, float]] = defaultdict(dict)
    for r in routing:
        values = r.get("weight") if stat == "weight" else r.get("tokens")
        for e, v in enumerate(values or []):
            cell = grid[(int(r["layer"]), e)]
            value = json_number(v) if stat in ("tokens", "weight") else None  # ("nan", "inf": blank, as below)
            if value is not None and math.isfinite(value):
                cell[int(r["step"])] = value
    if stat in _NUMERICS:
        # the doctor's rows: a delayed operand's first row (scale 1 from an empty history, as TE) says nothing
        kept = [r for (module, r_role), rows in _usable_rows(numerics).items()
                if r_role == role and expert_of(module) is not None for r in rows]
        for r in kept:
            who = expert_of(str(r.get("module", "")))
            if stat == "scale_gap":
                ratio = r.get("scale_ratio")
                value = abs(math.log2(ratio)) if isinstance(ratio, (int, float)) and ratio > 0 else None
            else:
                value = r.get(stat)
            if isinstance(value, (int, float)) and math.isfinite(value):
                cell = grid[(who[1], who[2])]
                step = int(r["step"])
                cell[step] = max(cell.get(step, -math.inf), float(value))
    return {_expert_label(*k): grid[k] for k in sorted(grid)}


def expert_heatmap(run_dir: str | os.PathLike, stat: str = "scale_gap", role: str = "activations",
                   out: str | os.PathLike | None = None) -> Path:
    """Write the experts x steps heat map of `run_dir` (default ``<run_dir>/experts_<stat>.png``); ValueError
    (one line) when the run has no routing rows (not an MoE run), a damaged row, nothing to plot, or `stat` is
    unknown."""
    from fp8_recipes.rundir import ROUTING, RunFileError, read_numerics, read_routing

    run_dir = Path(run_dir)
    if stat not in EXPERT_STATS:
        raise ValueError(f"--stat: {stat!r} is not one of {' | '.join(EXPERT_STATS)}")
    if not ((run_dir / ROUTING).exists() or (run_dir / ROUTING).is_symlink()):  # (a directory there is named)
        raise ValueError(f"RUN_DIR: '{run_dir}' has no {ROUTING} (the heat map by expert needs an MoE run, e.g. "
                         f"model=tiny_moe)")
    try:
        routing = read_routing(run_dir)
        numerics = read_numerics(run_dir) if stat in _NUMERICS else []
    except RunFileError as e:  # the doctor's refusal of a damaged row, in the same words
        raise ValueError(f"RUN_DIR: {e}; give a run directory written by scripts/train.py") from None
    if stat in _NUMERICS and not numerics:
        raise ValueError(f"--stat {stat}: '{run_dir}' has no numerics.jsonl (train with ++debug.interval=N), or "
                         f"plot --stat tokens")
    grid = expert_grid(numerics, routing, stat, role)
    if not any(grid.values()):
        why = _nothing_because(numerics, routing, stat, role)
        raise ValueError(f"--stat {stat}: '{run_dir}' has nothing to plot: {why}")
    path = _out_path(out) if out is not None else run_dir / f"experts_{stat}.png"
    what = EXPERT_STATS[stat] if stat in ("tokens", "weight") else f"{stat} of the experts' {role}"
    try:
        with warnings.catch_warnings():  # numpy overflowing inside matplotlib: a wrong picture, not a warning
            warnings.simplefilter("error", RuntimeWarning)
            return plot_heatmap(grid, path, what=f"{what} (experts x steps)", unit=EXPERT_STATS[stat], strip="")
    except OSError as e:
        raise ValueError(f"--out: cannot write '{path}' ({e.strerror or type(e).__name__}); give a writable "
                         f".png path") from None
    except (ArithmeticError, ValueError, RuntimeWarning):  # matplotlib's own words name nothing of ours
        values = [v for cells in grid.values() for v in cells.values()]
        source = "routing.jsonl" if stat in ("tokens", "weight") else "numerics.jsonl"
        raise ValueError(f"--stat {stat}: '{run_dir}' has values from {min(values):.3g} to {max(values):.3g}, too "
                         f"far apart for a colour bar (a damaged or hand-edited {source}); give a run directory "
                         f"written by scripts/train.py") from None


def _nothing_because(numerics: list[dict[str, Any]], routing: list[dict[str, Any]], stat: str, role: str) -> str:
    """Why the grid of `stat` is empty, with the way out: the reason that applies, checked from the rows up."""
    from fp8_recipes.observe.doctor_experts import expert_of

    if stat in ("tokens", "weight"):
        if not routing:
            return "its routing.jsonl has no row (a run that took no training step); let the run take steps"
        return "no routing row has a weight (every expert idle, or rows without weights); plot --stat tokens"
    experts = [r for r in numerics if expert_of(str(r.get("module", ""))) is not None]
    if not experts:
        return "numerics.jsonl has no row of a routed expert's linear; plot --stat tokens"
    roles = sorted({r["role"] for r in experts if isinstance(r.get("role"), str)})
    mine = [r for r in experts if r.get("role") == role]
    if not mine:
        return (f"the experts' numerics rows have no role {role!r} (they have {', '.join(roles)}); pick --role "
                f"{roles[0]}" if roles else "the experts' numerics rows name no role (not written by "
                "scripts/train.py); give a run directory written by scripts/train.py")
    key = "scale_ratio" if stat == "scale_gap" else stat
    policies = sorted({str(r.get("policy", "?")).split(" ")[0] for r in mine})
    if not any(r.get(key) is not None for r in mine):  # a statistic of another scaling than the experts ran
        of = {"scale_gap": "delayed scaling's", "block_underflow_pct": "NVFP4's"}.get(stat, "a")
        other = "tokens" if stat == "underflow_pct" else "underflow_pct"
        return (f"{stat} is {of} statistic and the experts' {role} ran {' / '.join(policies)}; pick another "
                f"--stat, e.g. {other}")
    return (f"a delayed operand's first row is left out (its scale is 1 from an empty history) and no other row of "
            f"the experts' {role} has a finite {key}; record more steps, or pick another --stat or --role")


def _out_path(out: str | os.PathLike) -> Path:
    """--out as given: a .png file in a directory that exists (what is printed is what was written)."""
    path = Path(out)
    if path.name in ("", ".", ".."):  # "", "/", "dir/..": no file named (with_suffix() below would raise)
        raise ValueError(f"--out: {str(out)!r} names no file; give a .png file path, e.g. experts.png")
    if path.suffix.lower() != ".png":
        raise ValueError(f"--out: '{out}' is not a .png file path; give one, e.g. {path.with_suffix('.png')}")
    if path.is_dir() or not path.parent.is_dir():
        raise ValueError(f"--out: '{out}' is a directory or its directory does not exist; give a .png file path "
                         f"in an existing directory")
    return path
