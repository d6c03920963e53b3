"""The recipe shoot-out: one model, one data stream, one seed, trained under BF16 and N FP8 recipes side by side.

    result = compare_recipes(["tensorwise", "blockwise"], ["trainer.max_steps=200"], Path("runs/compare"))
    save(result, Path("runs/compare"))          # compare.json, compare.md, compare.png

Each run is scripts/train.py in a subprocess (its own run dir ``OUT/NAME``, its own Megatron-Core world), through
:func:`child_main`, which for FP8 runs also evaluates the final checkpoint with FP8 and with BF16 GEMMs
(training/evaluate.py: inference parity). Backend, device and peak memory (CUDA: ``torch.cuda.max_memory_allocated``;
CPU: the peak RSS) come from the run's summary.json. ``--parallel N`` runs N at once (several small models fit on one H200;
on several GPUs each run gets one).

What the table says, from each run's own metrics.jsonl:
- final loss: the mean of the last k logged training losses, k = 5% of the rows (at least 1): one step's loss
  is one batch's and swings by more than the gaps sought; gap % = 100 x (recipe - BF16) / BF16;
- tokens/s: the median over the steady state: rows in the run's last precision stage, after the first 10% of rows
  (start-up, allocator warm-up and any BF16 warmup stage left out); with --parallel > 1 the runs share the device,
  so compare tokens/s only within one shoot-out;
- eval loss: the last ``val_loss`` the run logged (same validation batches in every run);
- parity: the FP8-trained checkpoint's eval loss with FP8 and with BF16 GEMMs, and their gap;
- routing (an MoE model): the mean load imbalance over steps and MoE layers and the share of idle expert slots, from
  the run's routing.jsonl (a recipe that moves the router's inputs can move its routing);
- autopilot (a run with ``autopilot=on``): the actions it took (its ``kind: autopilot`` metrics rows, the
  ``cap_reached`` note left out; a dry run's are counted as what it would have done).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from fp8_recipes.bench.output import markdown_table, save_json, save_outputs
from fp8_recipes.megatron.data import prepare_dataset
from fp8_recipes.recipe.pack import (
    check_pack_names, conf_dir, is_recipe_file, project_root, recipe_file_overrides, resolve_recipe_file,
)
from fp8_recipes.rundir import (
    HYDRA, METRICS, ROUTING, last_metrics_step, load_run_config, read_jsonl, read_metrics, read_summary,
)
from fp8_recipes.training.config import check_run_config
from fp8_recipes.training.errors import one_line
from fp8_recipes.training.evaluate import evaluate_checkpoint, format_parity, gap_pct
from fp8_recipes.training.progress import PlainBar
from fp8_recipes.training.run import resolve_recipe

__all__ = ["REFERENCE", "add_gaps", "autopilot_summary", "check_reference", "check_runs", "child_main", "collect",
           "compare_recipes", "final_loss", "plot_curves", "routing_summary", "run_entries", "run_overrides", "save",
           "steady_tokens_per_s", "summarize", "summarize_run"]

REFERENCE = "bf16"        # the run every gap is measured against
FINAL_FRACTION = 0.05     # final loss = mean of the last 5% of logged training losses
WARMUP_FRACTION = 0.10    # tokens/s ignores the first 10% of rows (start-up, allocator warm-up)
PARITY_FILE = "parity.json"


# ----------------------------------------------------------------------------------------------------------
# The numbers (pure: lists of metrics rows in, floats out)


def _finite_losses(rows: Sequence[dict]) -> list[float]:
    """Training losses of the steps that updated the model (a skipped step's loss is non-finite by definition)."""
    values = [float(r["loss"]) for r in rows if "loss" in r and not r.get("skipped")]
    return [v for v in values if math.isfinite(v)]


def final_loss(rows: Sequence[dict], fraction: float = FINAL_FRACTION) -> tuple[float, int]:
    """(mean of the last k training losses, k) with k = max(1, round(fraction x rows)); (nan, 0) without rows."""
    losses = _finite_losses(rows)
    if not losses:
        return math.nan, 0
    k = max(1, round(fraction * len(losses)))
    return statistics.fmean(losses[-k:]), k


def steady_tokens_per_s(rows: Sequence[dict], warmup_fraction: float = WARMUP_FRACTION) -> float:
    """Median tokens/s of the steady state: rows of the last stage, after the first ``warmup_fraction`` of rows
    (at least one row dropped when there are two or more); all rows when that leaves none."""
    rows = [r for r in rows if isinstance(r.get("tokens_per_s"), (int, float))]
    if not rows:
        return math.nan
    drop = max(1, math.ceil(warmup_fraction * len(rows))) if len(rows) > 1 else 0
    last_stage = rows[-1].get("stage")
    steady = [r for r in rows[drop:] if r.get("stage") == last_stage] or rows
    return statistics.median(float(r["tokens_per_s"]) for r in steady)


def routing_summary(rows: Sequence[dict]) -> dict[str, float] | None:
    """An MoE run's routing from its routing.jsonl rows (None without rows: a dense model): the mean load imbalance
    (max / mean tokens per expert, 1.0 = balanced) over steps and MoE layers, and the share of (step, layer, expert)
    slots in which an expert got no token, in %."""
    if not rows:
        return None
    slots = sum(len(r["tokens"]) for r in rows)
    return {"imbalance": statistics.fmean(float(r["imbalance"]) for r in rows),
            "idle_pct": 100 * sum(int(r["idle"]) for r in rows) / slots if slots else 0.0}


def autopilot_summary(config: dict, rows: Sequence[dict]) -> dict[str, Any] | None:
    """A run's autopilot from its resolved config (``.hydra/config.yaml``) and its ``kind: autopilot`` metrics rows:
    None when it was off, else its action count (``cap_reached``, a note, left out) and whether it was a dry run."""
    section = config.get("autopilot") if isinstance(config, dict) else None
    if not isinstance(section, dict) or section.get("enabled") is not True:
        return None
    actions = [r for r in rows if r.get("action") != "cap_reached"]
    return {"actions": len(actions), "dry_run": section.get("dry_run") is True}


def _read_config(run_dir: Path) -> dict:
    """The run's composed config (rundir.load_run_config, as --resume and --reference read it); {} when it cannot be
    read: the table's row then has no autopilot column, where those flags refuse in one line."""
    from omegaconf import OmegaConf

    try:
        return OmegaConf.to_container(load_run_config(run_dir), resolve=False)
    except ValueError:  # (a ConfigError: missing, damaged, not a run's config)
        return {}


def _gap(value: float | None, reference: float | None) -> float | None:
    if value is None or reference is None or not math.isfinite(value) or not math.isfinite(reference):
        return None
    return gap_pct(value, reference)


# ----------------------------------------------------------------------------------------------------------
# One run's outputs -> one row


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def summarize_run(run_dir: Path, name: str) -> dict[str, Any]:
    """One run's row: losses, speed, memory and parity read from its run dir (missing parts are None)."""
    summary = read_summary(run_dir)
    parity = _read_json(run_dir / PARITY_FILE)
    train = read_metrics(run_dir, "train") if (run_dir / METRICS).is_file() else []
    evals = [r for r in (read_metrics(run_dir, "eval") if train else []) if "val_loss" in r]
    loss, k = final_loss(train)
    status = "ok" if summary and not summary.get("stopped") and not summary.get("preempted") else (
        "stopped" if summary.get("stopped") else "preempted" if summary.get("preempted") else
        "failed" if run_dir.exists() else "not run")
    peak_bytes, device = summary.get("peak_memory_bytes"), summary.get("device")
    return {
        "name": name, "run_dir": str(run_dir), "status": status, "recipe": summary.get("recipe", name),
        "backend": summary.get("backend"), "device": device, "steps": len(train),
        "final_loss": loss, "final_k": k, "val_loss": float(evals[-1]["val_loss"]) if evals else None,
        "val_step": evals[-1]["step"] if evals else None, "tokens_per_s": steady_tokens_per_s(train),
        "peak_memory_gib": peak_bytes / 2**30 if peak_bytes else None,
        "peak_memory_kind": None if not peak_bytes else "cpu peak rss" if device == "CPU" else "cuda max allocated",
        "skipped_steps": summary.get("skipped_steps"),
        "routing": routing_summary(read_jsonl(run_dir / ROUTING)) if (run_dir / ROUTING).is_file() else None,
        "autopilot": autopilot_summary(_read_config(run_dir), read_metrics(run_dir, "autopilot") if train else []),
        "parity": {k: parity[k] for k in ("fp8_loss", "bf16_loss", "fp8_ppl", "bf16_ppl", "gap_pct", "eval_step",
                                          "stage", "eval_tokens") if k in parity} or None,
    }


def add_gaps(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row's final-loss and eval-loss gap % and speed ratio against the BF16 row (None without one)."""
    ref = next((r for r in rows if r["name"] == REFERENCE and r["status"] == "ok"), None)
    for r in rows:
        r["loss_gap_pct"] = _gap(r["final_loss"], ref["final_loss"]) if ref else None
        r["val_gap_pct"] = _gap(r["val_loss"], ref["val_loss"]) if ref else None
        speed = ref["tokens_per_s"] if ref else None
        r["tokens_vs_bf16"] = r["tokens_per_s"] / speed if speed and math.isfinite(r["tokens_per_s"]) else None
    return rows


def collect(out_dir: Path, names: Sequence[str] | None = None) -> dict[str, Any]:
    """Every run of a shoot-out directory (``names``, else compare.json's runs, else each subdirectory with
    metrics.jsonl; BF16 first) as table rows, with the gaps filled in."""
    previous = _read_json(out_dir / "compare.json")
    if names is None:
        names = [r["name"] for r in previous.get("runs", [])] or sorted(
            (p.name for p in out_dir.iterdir() if (p / METRICS).is_file()),
            key=lambda n: (n != REFERENCE, n))
    if not names:
        raise ValueError(f"--plot-only: {str(out_dir)!r} holds no run (no */metrics.jsonl); give a directory "
                         "written by compare_recipes.py")
    rows = add_gaps([summarize_run(out_dir / n, n) for n in names])
    device = next((r["device"] for r in rows if r.get("device")), None)
    keep = {k: previous[k] for k in ("command", "overrides", "parallel", "date", "reference") if k in previous}
    return {"kind": "compare", **keep, "device": device, "final_fraction": FINAL_FRACTION,
            "warmup_fraction": WARMUP_FRACTION, "runs": rows}


# ----------------------------------------------------------------------------------------------------------
# Table and plot


def _fmt(value: float | None, spec: str) -> str | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def summarize(result: dict[str, Any]) -> str:
    """The Markdown table: one row per run."""
    header = ["run", "backend", "steps", "final loss", "vs BF16", "eval loss", "vs BF16", "tokens/s", "x BF16",
              "peak GiB", "parity: FP8 eval", "BF16 eval", "FP8 vs BF16", "status"]
    rows = []
    for r in result["runs"]:
        p = r.get("parity") or {}
        rows.append([r["name"], r["backend"], r["steps"], _fmt(r["final_loss"], ".4f"),
                     _fmt(r["loss_gap_pct"], "+.2f") and f"{r['loss_gap_pct']:+.2f}%", _fmt(r["val_loss"], ".4f"),
                     _fmt(r["val_gap_pct"], "+.2f") and f"{r['val_gap_pct']:+.2f}%", _fmt(r["tokens_per_s"], ",.0f"),
                     _fmt(r["tokens_vs_bf16"], ".3f"), _fmt(r["peak_memory_gib"], ".2f"),
                     _fmt(p.get("fp8_loss"), ".4f"), _fmt(p.get("bf16_loss"), ".4f"),
                     _fmt(p.get("gap_pct"), "+.3f") and f"{p['gap_pct']:+.3f}%", r["status"]])
    if any(r.get("routing") for r in result["runs"]):  # an MoE model: how each run routed its tokens
        header[-1:-1] = ["routing imbalance", "idle experts"]
        for row, r in zip(rows, result["runs"]):
            routing = r.get("routing") or {}
            row[-1:-1] = [_fmt(routing.get("imbalance"), ".3f"),
                          _fmt(routing.get("idle_pct"), ".1f") and f"{routing['idle_pct']:.1f}%"]
    if any(r.get("autopilot") for r in result["runs"]):  # autopilot=on: what it did in each run
        header[-1:-1] = ["autopilot actions"]
        for row, r in zip(rows, result["runs"]):
            pilot = r.get("autopilot")
            row[-1:-1] = [None if pilot is None else f"{pilot['actions']}{' (dry run)' * pilot['dry_run']}"]
    kinds = sorted({r["peak_memory_kind"] for r in result["runs"] if r.get("peak_memory_kind")})
    k = max((r["final_k"] for r in result["runs"]), default=0)
    notes = [f"final loss: mean of the last {k} logged training losses ({FINAL_FRACTION:.0%} of the steps); "
             f"gaps: 100 x (recipe - BF16) / BF16; tokens/s: median of the last stage after the first "
             f"{WARMUP_FRACTION:.0%} of steps; peak memory: {', '.join(kinds) or '-'}; parity: the FP8-trained "
             "final checkpoint evaluated with FP8 and with BF16 GEMMs on the run's validation batches."]
    if any(r.get("routing") for r in result["runs"]):
        notes.append("routing imbalance: max / mean tokens per expert (1.000 = balanced), averaged over steps and MoE "
                     "layers (routing.jsonl); idle experts: the share of those slots in which an expert got no token.")
    if any(r.get("autopilot") for r in result["runs"]):
        notes.append("autopilot actions: the kind: autopilot rows of the run's metrics.jsonl (its cap_reached note "
                     "left out); '-': the autopilot was off.")
    if int(result.get("parallel") or 1) > 1:
        notes.append(f"{result['parallel']} runs at a time shared the device: tokens/s compare within this table only.")
    return markdown_table(header, rows) + "\n\n" + "\n".join(notes)


def _smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (the first points average what exists so far)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def _curve(run_dir: Path, window: int) -> tuple[list[int], list[float]]:
    rows = [r for r in read_metrics(run_dir, "train") if not r.get("skipped")]
    pairs = [(r["step"], float(r["loss"])) for r in rows if math.isfinite(float(r["loss"]))]
    return [s for s, _ in pairs], _smooth([v for _, v in pairs], window)


def plot_curves(result: dict[str, Any], path: Path) -> Path | None:
    """compare.png: training loss per run (BF16 bold) above its relative difference to BF16 in % (the layout of
    the NeMo FP8 blog's figure 2); both smoothed by a trailing mean over 2% of the steps."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on GPU nodes; must precede pyplot's import
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"note: matplotlib is not installed: no {path.name}; draw it elsewhere with --plot-only")
        return None
    runs = [r for r in result["runs"] if r["steps"]]
    window = max(1, max((r["steps"] for r in runs), default=1) // 50)
    curves = {r["name"]: _curve(Path(r["run_dir"]), window) for r in runs}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), dpi=120, sharex=True,
                                      gridspec_kw={"height_ratios": [3, 2]})
    ref = curves.get(REFERENCE)
    for r in runs:
        steps, loss = curves[r["name"]]
        is_ref = r["name"] == REFERENCE
        style = dict(color="black", linewidth=2.4, zorder=3) if is_ref else dict(linewidth=1.2)
        line, = top.plot(steps, loss, label=r["name"].upper() if is_ref else r["name"], **style)
        evals = _eval_points(Path(r["run_dir"]))
        if evals[0]:
            top.plot(*evals, "o", color=line.get_color(), markersize=4)
        if ref and not is_ref:
            at = dict(zip(*ref))
            pairs = [(s, 100 * (v - at[s]) / at[s]) for s, v in zip(steps, loss) if s in at and at[s]]
            bottom.plot([s for s, _ in pairs], [d for _, d in pairs], color=line.get_color(), linewidth=1.2)
    if ref:
        skip = len(ref[1]) // 50  # the first steps' losses (~ln vocab) would flatten the rest of the curve
        top.set_ylim(top=max(ref[1][skip:]) * 1.02, bottom=min(ref[1]) * 0.98)
    bottom.axhline(0.0, color="black", linewidth=1.6)
    bottom.axhspan(-0.5, 0.5, color="grey", alpha=0.15, label="±0.5%")
    top.set_ylabel(f"training loss (mean of {window} steps)")
    bottom.set_ylabel("vs BF16 (%)")
    bottom.set_xlabel("step")
    title = f"{result.get('device') or ''}: {', '.join(r['name'] for r in runs)}; dots: eval loss"
    top.set_title("\n".join(textwrap.wrap(title, 100)), fontsize=9)  # (six runs' names overran the figure)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _eval_points(run_dir: Path) -> tuple[list[int], list[float]]:
    rows = [r for r in read_metrics(run_dir, "eval") if "val_loss" in r]
    return [r["step"] for r in rows], [float(r["val_loss"]) for r in rows]


def save(result: dict[str, Any], out_dir: Path) -> str:
    """compare.json, compare.md and compare.png in ``out_dir``; returns the table."""
    return save_outputs(out_dir, "compare", result, summarize, plot_curves)


# ----------------------------------------------------------------------------------------------------------
# Running the shoot-out


def _reserved(overrides: Sequence[str], resume: bool = False) -> None:
    """Keys the shoot-out sets itself may not come in as overrides (one line naming the key)."""
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if key == "trainer.resume" and resume:
            raise ValueError(f"{key}: --resume continues each unfinished run from its checkpoints (trainer.resume="
                             f"auto); drop {o!r}")
        if key == "recipe":
            raise ValueError(f"{key}: chosen by --recipes, not by an override ({o!r}); e.g. --recipes tensorwise")
        if key == "run_dir":
            raise ValueError(f"{key}: each run's directory is OUT/NAME; set --out instead of {o!r}")


def run_entries(recipes: Sequence[str]) -> dict[str, str]:
    """Each run's name -> what its ``+recipe=`` names, BF16 first: a recipe of the pack by its name, a recipe file
    (``PATH.yaml`` anywhere, e.g. an ablation that starts ``defaults: [nvfp4, _self_]``) by its stem, its path made
    absolute. ValueError, one line, for a name of neither kind or two runs of one name."""
    entries = {REFERENCE: REFERENCE}
    for recipe in recipes:
        if is_recipe_file(recipe):
            path = resolve_recipe_file(recipe, "--recipes")
            name, ref = path.stem, str(path.resolve())
            if not re.fullmatch(r"[\w.+-]+", name):
                raise ValueError(f"--recipes: {recipe!r}: its run is named by the file's stem, {name!r}, and a run "
                                 f"name holds letters, digits, '.', '_', '-' and '+' only; rename the file")
        else:
            check_pack_names("--recipes", [recipe])
            name, ref = recipe, recipe
        if entries.get(name, ref) != ref:
            raise ValueError(f"--recipes: two runs would be named {name!r} ({entries[name]}, {ref}): each run's "
                             f"directory is OUT/NAME; rename the file")
        entries[name] = ref
    return entries


def run_overrides(name: str, overrides: Sequence[str], run_dir: Path, recipe: str | None = None) -> list[str]:
    """scripts/train.py's overrides for one run (``recipe``: its ``+recipe=`` value, default `name`). ``recipe.*``
    overrides edit the FP8 recipes only (the BF16 reference has no schedule or policies to edit)."""
    own = [o for o in overrides if name != REFERENCE or not o.lstrip("+~").startswith("recipe.")]
    return [f"+recipe={recipe or name}", *own, f"run_dir={run_dir}"]


def check_runs(runs: Sequence[str] | dict[str, str], overrides: Sequence[str], out_dir: Path, parity: bool,
               resume: bool = False) -> Any:
    """Every run's config composed and checked as scripts/train.py would, before any run starts (a typo costs a
    second, not N trainings); returns the BF16 run's config (for the data to prepare). `runs`: names of the pack,
    or run_entries' mapping. ``resume``: a run dir already in OUT must have run the config this run would
    (--resume). ValueError: one line."""
    from hydra import compose, initialize_config_dir

    entries = runs if isinstance(runs, dict) else run_entries([r for r in runs if r != REFERENCE])
    _reserved(overrides, resume)
    configs = {}
    for name, recipe in entries.items():
        exists = os.path.lexists(out_dir / name)  # (a dangling link too: --reference would fail to link over it)
        if exists and not resume:
            raise ValueError(f"--out: {str(out_dir / name)!r} already exists (a run dir appends to its metrics); "
                             f"choose a new --out, continue the shoot-out with --resume, or redraw with "
                             f"--plot-only {out_dir}")
        try:
            with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
                cfg = compose("train", overrides=recipe_file_overrides(
                    run_overrides(name, overrides, out_dir / name, recipe)))
            check_run_config(cfg)
            resolve_recipe(cfg)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - Hydra's errors, as scripts/train.py reports them
            line = one_line(e)
            if line is None:
                raise
            raise ValueError(line) from None
        if exists:
            same_config(out_dir / name, cfg, "--resume", "give the overrides and recipes it ran with (OUT/compare.json "
                        "has the command), or choose a new --out")
        configs[name] = cfg
    if parity and not configs[REFERENCE].trainer.save_checkpoints:
        raise ValueError("trainer.save_checkpoints: false leaves no checkpoint for the inference-parity evaluation; "
                         "drop the override, or pass --no-parity")
    return configs[REFERENCE]


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config as {dotted key: leaf}; an empty mapping is a leaf."""
    if not isinstance(data, dict) or not data:
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


UNTRAINED_KEYS = ("run_dir", "trainer.resume")
"""Config keys that do not change what a run trains: a reference run may differ in them (its own run dir; a
preempted run resumed with trainer.resume=auto)."""


def check_reference(reference: Path, cfg: Any, out_dir: Path | None = None) -> None:
    """A finished BF16 run dir may stand in for the shoot-out's BF16 run (``--reference``, e.g. a second GPU call's
    recipes against the first call's BF16 run) when it ran the config this shoot-out's would (``cfg``: composed by
    check_runs; run_dir aside). ValueError, one line naming the first key that differs."""
    if out_dir is not None:
        ref, out = reference.resolve(), out_dir.resolve()
        if ref == out or out in ref.parents or ref in out.parents:
            raise ValueError(f"--reference: '{reference}' and --out '{out_dir}' overlap: the shoot-out would write "
                             f"into the reference run (or link it into itself); give another --out")
    summary = read_summary(reference)
    if not summary or summary.get("stopped") or summary.get("preempted") or summary.get("recipe") != REFERENCE:
        raise ValueError(f"--reference: {str(reference)!r} holds no finished BF16 run (its summary.json: "
                         f"{'none' if not summary else 'recipe ' + str(summary.get('recipe'))}); give the run dir "
                         f"of a finished +recipe=bf16 run, e.g. OUT/bf16 of an earlier shoot-out")
    same_config(reference, cfg, "--reference", "give the overrides it ran with, or drop --reference to train BF16 "
                "again")


def same_config(run_dir: Path, cfg: Any, flag: str, fix: str) -> None:
    """ValueError (one line: ``flag``, the first key that differs, ``fix``) unless ``run_dir`` ran the config ``cfg``
    (composed by check_runs), UNTRAINED_KEYS aside."""
    from omegaconf import OmegaConf

    have = _flat(OmegaConf.to_container(load_run_config(run_dir, flag), resolve=False))
    want = _flat(OmegaConf.to_container(cfg, resolve=False))

    def said(value: Any) -> str:
        return "null" if value is None else str(value)

    for key in sorted(set(want) | set(have)):
        if key not in UNTRAINED_KEYS and want.get(key, "(unset)") != have.get(key, "(unset)"):
            raise ValueError(f"{flag}: {str(run_dir)!r} ran {key}={said(have.get(key, '(unset)'))}, this shoot-out "
                             f"runs {key}={said(want.get(key, '(unset)'))}; {fix}")


def _prepare_data(cfg: Any) -> None:
    """Build (or reuse) the dataset once here: N runs starting at once must not all build it in one place."""
    data = cfg.data
    prepare_dataset(data.inputs, data.path, tokenizer_kind=data.tokenizer, vocab_size=int(data.vocab_size),
                    json_key=data.json_key)


def _child_env(slot: int, parallel: int) -> dict[str, str]:
    """One run's environment: the package importable, its share of CPU threads, its GPU when there are several."""
    import torch

    env = dict(os.environ)
    plugins = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (plugins, env.get("PYTHONPATH")) if p)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"):
        env.pop(var, None)  # each run is a world of its own, never a rank of this process's launcher
    gpus = torch.cuda.device_count()  # (NVML: no CUDA context in this process)
    if gpus == 0 and parallel > 1 and "OMP_NUM_THREADS" not in env:  # oversubscribed OpenMP spins (docs/facts.md)
        env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // parallel))
    if gpus > 1 and "CUDA_VISIBLE_DEVICES" not in env:
        env["CUDA_VISIBLE_DEVICES"] = str(slot % gpus)
    return env


def _last_error(log: Path) -> str:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()] if log.is_file() else []
    return next((ln for ln in reversed(lines) if ln.startswith("error:")), lines[-1] if lines else "no output")


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _term_with_parent() -> None:
    """In a run's process before it starts (Linux): SIGTERM when the shoot-out's process dies, so that a run
    outlives it by no more than its checkpoint (elsewhere nothing: the runs then go on to their end)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _run_all(jobs: dict[str, list[str]], parallel: int, out_dir: Path, append: bool = False) -> dict[str, int]:
    """Run the commands, ``parallel`` at a time, under a progress bar over runs; each run's output goes to
    ``OUT/logs/NAME.log`` (appended to with ``append``: a resumed shoot-out keeps the earlier attempt's). The runs
    have a session of their own, so a signal to the shoot-out's process group (Ctrl-C at a terminal, ``timeout -s
    INT``) reaches the shoot-out only; it (or SIGTERM, a batch job's preemption) passes SIGTERM on to the runs,
    which checkpoint and stop (exit 4, resumable: --resume). Returns exit codes."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # a bare GPU image may lack it: a line per finished run only
        tqdm = functools.partial(PlainBar, disable=True)

    previous = {}  # SIGINT too: a shell ignores it in the commands it starts in the background (`cmd &` in a
    # script), and Python then leaves it ignored, so `timeout -s INT` would not stop such a shoot-out
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}

    logs = out_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    pending, running, codes = list(jobs), {}, {}
    free_slots = list(range(parallel))
    bar = tqdm(total=len(jobs), desc="runs", unit="run", dynamic_ncols=True)
    try:
        while pending or running:
            while pending and free_slots:
                name, slot = pending.pop(0), free_slots.pop(0)
                with open(logs / f"{name}.log", "a" if append else "w") as log:
                    proc = subprocess.Popen(jobs[name], stdout=log, stderr=subprocess.STDOUT,
                                            env=_child_env(slot, parallel), start_new_session=True,
                                            preexec_fn=_term_with_parent)
                running[name] = (proc, slot, time.perf_counter())
            time.sleep(1.0)
            for name, (proc, slot, t0) in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[name]
                free_slots.append(slot)
                codes[name] = proc.returncode
                what = "done" if proc.returncode == 0 else \
                    f"FAILED (exit {proc.returncode}): {_last_error(logs / f'{name}.log')}"
                bar.write(f"{name}: {what} ({time.perf_counter() - t0:.0f}s; log {logs / f'{name}.log'})")
                bar.update(1)
            bar.set_postfix_str(" | ".join(f"{n} step {last_metrics_step(out_dir / n) or 0}" for n in running),
                                refresh=False)
    except KeyboardInterrupt:
        for proc, _, _ in running.values():
            proc.terminate()
        for proc, _, _ in running.values():
            proc.wait()
        raise
    finally:
        bar.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return codes


def _child_command(name: str, recipe: str, overrides: Sequence[str], out_dir: Path, train_script: Path,
                   parity: bool, parity_iters: int | None) -> list[str]:
    run_dir = out_dir / name
    cmd = [sys.executable, "-c", "from fp8_recipes.bench.compare import child_main; child_main()",
           "--script", str(train_script), "--run-dir", str(run_dir)]
    if parity and name != REFERENCE:
        cmd += ["--parity"] + (["--parity-iters", str(parity_iters)] if parity_iters else [])
    return cmd + ["--", *run_overrides(name, overrides, run_dir, recipe)]


def compare_recipes(recipes: Sequence[str], overrides: Sequence[str], out_dir: Path, *, parallel: int = 1,
                    parity: bool = True, parity_iters: int | None = None, train_script: Path | None = None,
                    command: str | None = None, reference: Path | None = None, resume: bool = False) -> dict[str, Any]:
    """Train BF16 and each recipe with the same overrides (so the same model, data and seed), then collect.
    `reference`: a finished BF16 run of the same config, linked as OUT/bf16 instead of training BF16 again.
    `resume`: continue a shoot-out in OUT (see run_states). User errors (a bad recipe name or override, an existing
    run dir without `resume`) are ValueErrors of one line, raised before any run starts. A failed run becomes a row
    with status ``failed`` (its log says why)."""
    if parallel < 1:
        raise ValueError(f"--parallel: {parallel} must be >= 1")
    entries = run_entries([r for r in recipes if r != REFERENCE])
    names = list(entries)
    script = train_script or (project_root() or Path(".")) / "scripts" / "train.py"
    if not script.is_file():
        raise ValueError(f"--train-script: {str(script)!r} does not exist; run from a checkout of fp8-recipes")
    reference_cfg = check_runs(entries, overrides, out_dir, parity, resume)
    if reference is not None:
        check_reference(reference, reference_cfg, out_dir)
    if resume and reference is None and (out_dir / REFERENCE).is_symlink():  # (linked by an earlier call's)
        reference = (out_dir / REFERENCE).resolve()
    states = run_states(out_dir, names, reference, parity)
    _prepare_data(reference_cfg)
    jobs = {n: _child_command(n, entries[n], [*overrides, *(["trainer.resume=auto"] if states[n] == "resume" else [])],
                              out_dir, script, parity, parity_iters)
            for n in names if states[n] in ("new", "resume") and (reference is None or n != REFERENCE)}
    if reference is not None and states[REFERENCE] == "new":
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / REFERENCE).symlink_to(reference.resolve(), target_is_directory=True)
        except OSError as e:
            raise ValueError(f"--out: cannot link '{out_dir / REFERENCE}' to the reference run "
                             f"({e.strerror or e}); choose another --out") from None
    meta = {"command": command, "overrides": list(overrides), "parallel": parallel,
            "reference": str(reference.resolve()) if reference is not None else None,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "runs": [{"name": n} for n in names]}
    save_json(out_dir / "compare.json", meta)  # the run list first, so --plot-only works on a cut-short shoot-out
    codes = _run_all(jobs, min(parallel, len(jobs)), out_dir, append=resume) if jobs else {}
    codes.update({n: 0 for n in names if states[n] == "done"})  # (finished before: kept as they are)
    if reference is not None:
        codes[REFERENCE] = 0  # (it finished: check_reference read its summary)
    result = collect(out_dir, names)
    for row in result["runs"]:  # trained, then failed after (the parity evaluation): not a clean row either
        if row["status"] == "ok" and codes.get(row["name"]) != 0:
            row["status"] = f"exit {codes.get(row['name'])}"
    return result


def run_states(out_dir: Path, names: Sequence[str], reference: Path | None = None,
               parity: bool = False) -> dict[str, str]:
    """Each run's state in OUT before the shoot-out trains: ``new`` (no run dir), ``done`` (a summary.json of a run
    that ended on its own: finished, or stopped by its own checks; kept as it is), ``resume`` (a run dir without one,
    or a preempted run: it continues from its newest intact checkpoint, trainer.resume=auto, or starts again without
    one; with ``parity`` also a finished FP8 run without its parity.json, whose resume trains nothing and evaluates).
    With ``reference``, OUT/bf16 must be that run (linked) or absent: ValueError, one line."""
    states = {}
    for name in names:
        run_dir = out_dir / name
        if not os.path.lexists(run_dir):
            states[name] = "new"
            continue
        if name == REFERENCE and reference is not None and run_dir.resolve() != reference.resolve():
            raise ValueError(f"--reference: '{run_dir}' holds another BF16 run than '{reference}'; drop --reference "
                             f"to keep it, or choose a new --out")
        summary = read_summary(run_dir)
        done = summary and not summary.get("preempted") and (
            not parity or name == REFERENCE or summary.get("stopped") or (run_dir / PARITY_FILE).is_file())
        states[name] = "done" if done else "resume"
    return states


# ----------------------------------------------------------------------------------------------------------
# Inside each run's subprocess


def child_main(argv: Sequence[str] | None = None) -> None:
    """One run of the shoot-out: scripts/train.py as __main__ (its exit codes, errors and outputs unchanged),
    then, with --parity, the inference parity into RUN_DIR/parity.json."""
    import runpy

    p = argparse.ArgumentParser(prog="compare child")
    p.add_argument("--script", type=Path, required=True)
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--parity", action="store_true")
    p.add_argument("--parity-iters", type=int)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    sys.argv = [str(args.script), *args.overrides]
    runpy.run_path(str(args.script), run_name="__main__")  # SystemExit (errors, preemption) passes through
    if args.parity:
        result = evaluate_checkpoint(args.run_dir, eval_iters=args.parity_iters)
        save_json(args.run_dir / PARITY_FILE, result)
        print(f"parity: {format_parity(result)}", flush=True)
