"""Reading a run directory for the doctor, and what comes out of it: the printed report and the patched recipe.

    run = load_run("runs/delayed-...")        # DoctorInputError (one line, RUN_DIR: ...) when it cannot be read
    print(format_report(diagnose(run)))
    patched_recipe(d)                         # the recipe dict with the applied proposals, validated; or None
    write_recipe(Path("fixed.yaml"), patched)  # atomically

The rules live in :mod:`fp8_recipes.observe.doctor`. The run's files are read with :mod:`fp8_recipes.rundir`; a bad
line is a user error, not a traceback. Imports PyYAML and our schema only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fp8_recipes.observe.autopilot_config import ACTION_KINDS
from fp8_recipes.observe.doctor_autopilot import action_outcomes, applied_actions, ended_with
from fp8_recipes.observe.doctor import Diagnosis, DoctorInputError, Finding, RunData, _value
from fp8_recipes.observe.doctor_experts import describe_modules
from fp8_recipes.rundir import (
    METRICS,
    RECIPE,
    RunFileError,
    json_number,
    read_jsonl,
    read_numerics,
    read_recipe,
    read_routing,
    read_summary,
    step_problem,
)
from fp8_recipes.recipe.schema import ROLES, Recipe, RecipeError
from fp8_recipes.recipe.yaml_guard import UnsafeYAML

__all__ = ["format_report", "load_run", "patched_recipe", "write_recipe"]


def load_run(run_dir: str | Path, key: str = "RUN_DIR") -> RunData:
    """Read a run directory; `key` names the argument in the one-line error (RUN_DIR, --baseline)."""
    path = Path(run_dir)
    if not path.is_dir():
        raise DoctorInputError(f"{key}: '{run_dir}' is not a directory (give a training run directory, e.g. "
                               f"runs/delayed-<time>)")
    if not (path / METRICS).is_file():
        raise DoctorInputError(f"{key}: '{run_dir}' has no {METRICS} (give the run_dir of a scripts/train.py run)")
    try:
        rows = read_jsonl(path / METRICS, _metrics_row_problem)
        numerics = read_numerics(path)
        routing = read_routing(path)  # an MoE run's
    except RunFileError as e:
        raise DoctorInputError(f"{key}: {e}; give a run directory written by scripts/train.py") from None
    stepless = next((i for i, r in enumerate(rows, 1) if r.get("kind") in ("train", "eval")
                     and not (isinstance(r.get("step"), int) and not isinstance(r.get("step"), bool))), None)
    if stepless is not None:
        raise DoctorInputError(f"{key}: '{run_dir}'/{METRICS} row {stepless} has no integer \"step\" (not written by "
                               f"scripts/train.py); give a run directory written by scripts/train.py")
    train = sorted((r for r in rows if r.get("kind") == "train"), key=lambda r: r.get("step", 0))
    evals = sorted((r for r in rows if r.get("kind") == "eval" and "val_loss" in r), key=lambda r: r.get("step", 0))
    if not train:
        raise DoctorInputError(f"{key}: '{run_dir}'/{METRICS} has no training step yet (let the run take steps)")
    if all(_value(r, "loss") is None for r in train):  # (every rule starts from the loss)
        raise DoctorInputError(f"{key}: '{run_dir}'/{METRICS} has no \"loss\" in its train rows (not written by "
                               f"scripts/train.py); give a run directory written by scripts/train.py")
    try:
        data = read_recipe(path)
    except UnsafeYAML as e:
        raise DoctorInputError(f"{key}: '{run_dir}'/{RECIPE}: {e} (restore it from the run)") from None
    recipe, problem = None, ""
    if data:  # through the schema; a recipe.yaml that does not validate is read as unknown, and the report says why
        try:
            recipe = Recipe.from_dict(data)
        except RecipeError as e:
            problem = e.problems[0] + (f"; +{len(e.problems) - 1} more" if len(e.problems) > 1 else "")
    summary = read_summary(path)  # {} for a run killed while writing it: the metrics rows say enough
    autopilot = [r for r in rows if r.get("kind") == "autopilot"]
    ended, why = None, ""
    if recipe is not None and applied_actions(autopilot):  # the recipe the run ended with: what --write patches
        try:
            ended = ended_with(recipe, autopilot)
        except (RecipeError, TypeError, KeyError, AttributeError) as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
    return RunData(path, train, numerics, recipe, summary, evals, recipe_problem=problem, routing=routing,
                   autopilot=autopilot, ended_with=ended, autopilot_problem=why)


_READ = {"train": ("loss", "grad_norm", "lr"), "eval": ("val_loss", "val_loss_full_precision")}
"""metrics.jsonl: the values the doctor reads, per row kind."""


def _metrics_row_problem(row: dict[str, Any]) -> str | None:
    """What makes a metrics.jsonl row unreadable for the doctor, or None: a value it reads that is no number (nor
    null, nor a string jsonable() writes for NaN and inf: "NaN" is refused here as in numerics.jsonl), an autopilot
    row of an action training never takes, without an integer step (such a row was dropped, and --write patched
    a recipe the run never ended with) or whose changes are no mapping (Action.to_dict() writes one, {} if none)."""
    kind, step = row.get("kind"), row.get("step")
    bad = next((k for k in _READ.get(kind, ()) if row.get(k) is not None and json_number(row[k]) is None), None)
    if bad:
        return f"{bad!r} of a {kind} row is {row[bad]!r:.60}, not a number"
    if kind in _READ and isinstance(step, int) and step_problem(step):  # (no integer at all: load_run says so)
        return f"'step' of a {kind} row {step_problem(step)}"
    if kind != "autopilot":
        return None
    for key, known in (("action", (*ACTION_KINDS, "cap_reached")), ("role", (*ROLES, "*"))):
        if row.get(key) not in known:
            return f"{key!r} of an autopilot row is {row.get(key)!r:.60}, not one of {' | '.join(known)}"
    module, changes = row.get("module"), row.get("changes", {})
    if not isinstance(module, str):
        return f"'module' of an autopilot row is {module!r:.60}, not text"
    if step_problem(step):
        return f"'step' of an autopilot row {step_problem(step)}"
    if not isinstance(changes, dict):
        return f"'changes' of an autopilot row is {changes!r:.60}, not a mapping of recipe keys to values"
    return None


def patched_recipe(d: Diagnosis) -> dict[str, Any] | None:
    """The recipe the run ended with (recipe.yaml, and the autopilot's applied actions when it had any) with every
    non-alternative proposal applied, validated (a RecipeError if not); None when nothing is proposed."""
    applied = [p for p in d.proposals if not p.alternative]
    if not applied or d.run.final_recipe is None:
        return None
    out = d.run.final_recipe.to_dict()  # recipe.yaml as plain YAML data, with the autopilot's actions if any
    for p in applied:
        for dotted, value in p.changes.items():
            *parents, leaf = dotted.split(".")
            node = out
            for k in parents:
                node = node.setdefault(k, {})
            if value is None:
                node.pop(leaf, None)
            elif dotted == "modules":  # new patterns first (the first match wins), the recipe's after them
                node[leaf] = {**value, **{k: v for k, v in (node.get(leaf) or {}).items() if k not in value}}
            else:
                node[leaf] = value
    name = str(out.get("name", "recipe"))
    out["name"] = name if name.endswith("-doctor") else f"{name}-doctor"
    pilot = len(applied_actions(d.run.autopilot)) if d.run.ended_with is not None else 0
    before = (out.get("description") or name) + (f"; the autopilot's {pilot} action(s)" if pilot else "")
    out["description"] = f"{before}; doctor: " + ", ".join(dict.fromkeys(
        k for p in applied for k, v in p.changes.items() if v is not None))  # (each key once: modules: per expert)
    Recipe.from_dict(out)  # every proposal must keep the recipe valid
    return out


def write_recipe(path: Path, recipe: dict[str, Any]) -> None:
    """Write the patched recipe atomically (a crash never leaves half a recipe); DoctorInputError when the path
    cannot be written."""
    import yaml

    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(yaml.safe_dump(recipe, sort_keys=False, default_flow_style=None, width=120), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise DoctorInputError(f"--write: cannot write '{path}' ({e.strerror or type(e).__name__}); choose a writable "
                               f"path") from None


# ---------------------------------------------------------------------------------------------------------------
# The report


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def format_report(d: Diagnosis, max_findings: int = 8) -> str:
    """The short readable report `fp8-recipes doctor` prints."""
    run = d.run
    lines = [f"run       {run.path}  (recipe {_name(run)}, {len(run.train)} steps, "
             f"{len({r.get('step') for r in run.numerics})} steps with numerics)"]
    if d.baseline is not None:
        lines.append(f"baseline  {d.baseline.path}  (recipe {_name(d.baseline)})")
    lines += [f"seed      {s.path}  (recipe {_name(s)}): another seed, for the noise floor" for s in d.seeds]
    lines.append(f"verdict   {d.verdict}: {d.summary}")
    if d.gap is not None and d.gap.floor is not None:
        lines.append(f"noise     {d.gap.floor.how}")
    if d.gap is not None and (d.verdict == "worse_than_baseline" or d.gap.within_noise
                              or any(m.over for m in d.gap.measures)):
        lines += ["", f"loss gap to the baseline (over the {d.gap.steps} steps both have)"] + _table(
            [["loss", "steps", "run", "baseline", "gap", "counts from"]]
            + [[m.name, m.steps, f"{m.run:.4f}", f"{m.baseline:.4f}", f"{m.gap:+.2%}", f"{m.threshold:.2%}"]
               for m in d.gap.measures])
    if d.spikes:
        lines += ["", "evidence"] + _table([["metric", "from step", "steps", "size (x running median)", "to the end"]]
                                          + [[s.metric, str(s.start), str(s.length), f"{s.size:.3g}",
                                              "yes" if s.terminal else ""] for s in d.spikes[:8]])
    if d.findings:
        groups: dict[tuple[str, str], list[Finding]] = {}
        for f in d.findings:  # already worst module first
            groups.setdefault((f.module, f.role), []).append(f)
        rows = [[m, role, fs[0].policy, "; ".join(f.text for f in fs[:3]) + (f"; +{len(fs) - 3}" * (len(fs) > 3))]
                for (m, role), fs in groups.items()]
        lines += ["", "layers and tensors (worst first)"] + _table([["module", "role", "policy", "findings"]]
                                                                   + rows[:max_findings])
        if len(rows) > max_findings:
            lines.append(f"  ... {len(rows) - max_findings} more")
    if d.experts:
        lines += ["", "experts (worst first)"] + _table(
            [["layer", "expert", "cause", "from step", "roles", "evidence"]]
            + [[str(c.layer), str(c.expert), c.cause, str(c.step), ",".join(c.roles),
                f"{c.evidence}; {c.worst.module.rsplit('.', 1)[-1]} {c.worst.gemm}: {c.worst.text}"]
               for c in d.experts])
    if run.autopilot:  # what the run's autopilot changed, and whether it held (observe/doctor_autopilot.py)
        lines += ["", "autopilot actions (metrics.jsonl)"] + [
            f"  {line}" for line in action_outcomes(run.autopilot, run.numerics)]
    if d.proposals:
        lines += ["", "proposals (* = applied by --write)"]
        for p in d.proposals:
            change = ", ".join(f"modules: {describe_modules(v)}" if k == "modules" else f"{k}: {_show(v)}"
                               for k, v in p.changes.items() if v is not None)
            lines.append(f"  {' ' if p.alternative else '*'} {change}")
            lines.append(f"      {p.reason}")
    lines += [f"note      {n}" for n in d.notes]
    return "\n".join(lines)


def _name(run: RunData) -> str:
    return run.recipe.name if run.recipe is not None else "?"


def _show(v: Any) -> str:
    return json.dumps(v) if isinstance(v, (list, dict)) else str(v)
