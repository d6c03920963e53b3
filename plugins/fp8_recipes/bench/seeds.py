"""One shoot-out under several seeds, side by side: each recipe's gap to BF16 per seed and the mean over the seeds.

    merged = merge_seeds([load_shootout(Path("runs/cmp1234")), load_shootout(Path("runs/cmp4321"))])
    save_seeds(merged, Path("runs/seeds"))      # seeds.json, seeds.md, seeds.png

A single run's gap swings by more than the half-percent a recipe is judged by (BF16 itself ends a percent apart
between two seeds), so a verdict takes two seeds or more. The shoot-outs must be the same experiment: the same
overrides apart from ``trainer.seed`` (compare.json records them), each with its own seed. The numbers are the
shoot-outs' own (compare.json: final loss, eval loss and their gaps); nothing is recomputed from the runs.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Sequence

import yaml

from fp8_recipes.bench.compare import REFERENCE
from fp8_recipes.bench.output import markdown_table, save_outputs
from fp8_recipes.recipe.pack import conf_dir

__all__ = ["load_shootout", "merge_seeds", "plot_seeds", "save_seeds", "summarize_seeds"]

KEY = "--over-seeds"
"""The option every error line names (scripts/compare_recipes.py)."""
SEED_KEY = "trainer.seed"
"""The one override in which the merged shoot-outs may differ."""
GAPS = {"final": "loss_gap_pct", "eval": "val_gap_pct"}
"""The gaps merged (compare.json's fields): final training loss and eval loss, in % of BF16's."""


def load_shootout(path: Path) -> dict[str, Any]:
    """A shoot-out's compare.json: ``path`` itself, or the one in the directory ``path``."""
    file = path / "compare.json" if path.is_dir() else path
    try:
        result = json.loads(file.read_text())
    except OSError:
        raise ValueError(f"{KEY}: '{path}' holds no compare.json; give shoot-out directories (--out of "
                         f"scripts/compare_recipes.py) or their compare.json files") from None
    except ValueError:
        raise ValueError(f"{KEY}: '{file}' is not JSON; give a compare.json written by scripts/compare_recipes.py"
                         ) from None
    runs = result.get("runs") if isinstance(result, dict) else None
    if isinstance(runs, list) and result.get("kind") is None:  # (the run list a shoot-out writes first)
        raise ValueError(f"{KEY}: '{file}' is an unfinished shoot-out's; finish it with --resume (the same arguments) "
                         f"or collect what it logged with --plot-only DIR first")
    if result.get("kind") != "compare" or not isinstance(runs, list) or not all(
            isinstance(r, dict) and isinstance(r.get("name"), str) for r in runs):
        raise ValueError(f"{KEY}: '{file}' is not a shoot-out's compare.json (kind: compare and named runs)")
    result["source"] = str(path)
    return result


def _override(override: str) -> tuple[str, str]:
    """(key, value) of a Hydra override, its +, ++ or ~ prefix dropped."""
    key, _, value = override.lstrip("+~").partition("=")
    return key, value


def _seed(result: dict[str, Any]) -> str:
    """The shoot-out's trainer.seed: its override, else the trainer config's own (conf/trainer/NAME.yaml)."""
    pairs = [_override(o) for o in result.get("overrides") or []]
    seeds = [value for key, value in pairs if key == SEED_KEY]
    if seeds:
        return seeds[-1]
    trainer = next((value for key, value in reversed(pairs) if key == "trainer"), "cpu")  # (conf/train.yaml's)
    try:
        return str(yaml.safe_load((conf_dir() / "trainer" / f"{trainer}.yaml").read_text())["seed"])
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        return "default"


def _without_seed(result: dict[str, Any]) -> list[str]:
    return sorted(o for o in result.get("overrides") or [] if _override(o)[0] != SEED_KEY)


def _check_same_experiment(results: Sequence[dict[str, Any]], seeds: list[str]) -> None:
    """The same overrides but the seed, and no seed twice (``seeds``: the results' own; one line naming the
    shoot-out that differs)."""
    first = results[0]
    common = _without_seed(first)
    for other in results[1:]:
        mine = _without_seed(other)
        if mine != common:
            here = ", ".join(sorted(set(mine) - set(common))) or "no override"
            there = ", ".join(sorted(set(common) - set(mine))) or "no override"
            raise ValueError(f"{KEY}: '{other['source']}' is another experiment than '{first['source']}' (beyond "
                             f"trainer.seed it has {here} where the first has {there}); merge shoot-outs of one "
                             f"experiment")
    twice = sorted({s for s in seeds if seeds.count(s) > 1})
    if twice:
        raise ValueError(f"{KEY}: seed {twice[0]} comes more than once; give each seed's shoot-out once (set "
                         f"trainer.seed=N in each shoot-out's overrides)")


def _mean(values: list[float | None]) -> float | None:
    return None if not values or any(v is None for v in values) else statistics.fmean(values)


def merge_seeds(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Rows per recipe (in the first shoot-out's order): per seed its losses and gaps when the run ended ``ok``, the
    mean gap when every seed's did."""
    if len(results) < 2:
        raise ValueError(f"{KEY}: give two shoot-outs or more (one per seed); one seed is its own compare.md")
    seeds = [_seed(r) for r in results]
    _check_same_experiment(results, seeds)
    names = list(dict.fromkeys(run["name"] for r in results for run in r["runs"]))
    rows = []
    for name in names:
        per_seed = []
        for result in results:
            run = next((x for x in result["runs"] if x["name"] == name and x.get("status") == "ok"), None)
            # (a run that did not end ok, or that this seed's shoot-out lacks: no numbers from it)
            per_seed.append(None if run is None else
                            {"final_loss": run.get("final_loss"), "val_loss": run.get("val_loss"),
                             **{kind: run.get(field) for kind, field in GAPS.items()}})
        means = {kind: _mean([None if s is None else s[kind] for s in per_seed]) for kind in GAPS}
        rows.append({"name": name, "seeds": per_seed, "mean": means})
    return {"kind": "seeds", "seeds": seeds, "sources": [r["source"] for r in results],
            "devices": sorted({r.get("device") or "-" for r in results}),
            "overrides": _without_seed(results[0]),
            "rows": rows}


def _pct(value: float | None) -> str | None:
    return None if value is None else f"{value:+.2f}"


def summarize_seeds(merged: dict[str, Any]) -> str:
    """The Markdown table: per recipe the final and eval gaps per seed and their means (BF16: its losses)."""
    seeds = merged["seeds"]
    header = ["recipe", *(f"final, seed {s}" for s in seeds), "mean", *(f"eval, seed {s}" for s in seeds), "mean"]
    table = []
    for row in merged["rows"]:
        cells = [row["name"]]
        for kind, loss in (("final", "final_loss"), ("eval", "val_loss")):
            if row["name"] == REFERENCE:  # the reference's own losses: what each seed's gaps are taken against
                cells += [None if s is None or s[loss] is None else f"{s[loss]:.4f}" for s in row["seeds"]] + [None]
            else:
                cells += [None if s is None else _pct(s[kind]) for s in row["seeds"]] + [_pct(row["mean"][kind])]
        table.append(cells)
    notes = [f"gaps to BF16 in % (100 x (recipe - BF16) / BF16; the BF16 row: its final and eval losses); mean: over "
             f"the {len(seeds)} seeds, '-' where a seed's run did not end ok or is absent. Overrides: "
             f"{' '.join(merged['overrides']) or '-'}; device: {'; '.join(merged['devices'])}."]
    return markdown_table(header, table) + "\n\n" + "\n".join(notes)


def plot_seeds(merged: dict[str, Any], path: Path) -> Path | None:
    """seeds.png: per recipe, the eval and final gaps of each seed (dots) and their mean (bar), the +-0.5 % band."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"note: matplotlib is not installed: no {path.name}")
        return None
    rows = [r for r in merged["rows"] if r["name"] != REFERENCE]
    fig, axes = plt.subplots(1, 2, figsize=(10, 0.5 * len(rows) + 2.2), dpi=120, sharey=True)
    for ax, kind in zip(axes, ("eval", "final")):
        labelled: set[str] = set()  # (each series named once, by the first point it draws)

        def label(name: str) -> str | None:
            return None if name in labelled or labelled.add(name) else name
        for y, row in enumerate(rows):
            if row["mean"][kind] is not None:
                ax.barh(y, row["mean"][kind], color="tab:blue", alpha=0.45, label=label("mean"))
            for i, (seed, s) in enumerate(zip(merged["seeds"], row["seeds"])):
                if s is not None and s[kind] is not None:
                    ax.plot(s[kind], y, "o", color=f"C{i + 1}", label=label(f"seed {seed}"))
        ax.axvline(0.0, color="black", linewidth=1.2)
        ax.axvspan(-0.5, 0.5, color="grey", alpha=0.15)
        ax.set_xlabel(f"{kind} loss vs BF16 (%)")
        ax.grid(alpha=0.3, axis="x")
    axes[0].set_yticks(range(len(rows)), [r["name"] for r in rows])
    axes[0].invert_yaxis()
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=8)
    fig.suptitle(f"{len(merged['seeds'])} seeds; {'; '.join(merged['devices'])}; grey: +-0.5 %", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def save_seeds(merged: dict[str, Any], out_dir: Path) -> str:
    """seeds.json, seeds.md and seeds.png in ``out_dir``; returns the table."""
    return save_outputs(out_dir, "seeds", merged, summarize_seeds, plot_seeds)
