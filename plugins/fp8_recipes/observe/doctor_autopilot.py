"""The doctor on a run the autopilot drove: which of its actions held, and what the plan it ended with saw.

    for line in action_outcomes(run.autopilot, run.numerics): print(line)
    rows = rows_after_actions(run.autopilot, run.numerics)   # the statistics the proposals read
    recipe = ended_with(recipe, run.autopilot)                # recipe.yaml + the applied actions: what --write patches

An action (a ``kind: autopilot`` row of metrics.jsonl, training/autopilot.py) *held* when the (module, role) it
changed shows no finding (the doctor's limits, :func:`~fp8_recipes.observe.doctor_findings.find_problems`) in
the statistics rows recorded after it, up to its module and role's next action; it *did not hold* when they show
one (the worst named); a role-wide one says in how many of the role's modules it held. A module (or a role) put in
BF16 has no FP8 rows to judge: its line says so (a re-promotion is an action of its own, judged as any). Dry-run
actions changed nothing: listed as such. Rows without an integer step are left out (load_run refuses such an
action row in metrics.jsonl).

The doctor's proposals for such a run patch the recipe it ended with (:func:`ended_with`: recipe.yaml with the
applied actions, in order, as the run replayed them on a resume) and read, per (module, role), only the statistics
recorded after the last applied action that changed it (:func:`rows_after_actions`): what the autopilot already
answered is not proposed again, and what its actions left standing is. Pure (no torch).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fp8_recipes.observe.autopilot_actions import Action, apply
from fp8_recipes.observe.doctor_findings import SUPPORTING, find_problems
from fp8_recipes.recipe.schema import Recipe

__all__ = ["action_outcomes", "applied_actions", "ended_with", "rows_after_actions"]


def _step(row: dict[str, Any]) -> int | None:
    step = row.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _covers(action: dict[str, Any], row: dict[str, Any]) -> bool:
    """Whether a statistics row is of the (module, role) the action changed (``*``: every module, every role)."""
    module, role = str(action.get("module")), str(action.get("role"))
    return (module in ("*", row.get("module"))) and (role in ("*", row.get("role")))


def applied_actions(actions: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The actions that changed the recipe (not dry, not cap_reached), in step order."""
    return sorted((a for a in actions if _step(a) is not None and a.get("changes") and not a.get("dry")), key=_step)


def ended_with(recipe: Recipe, actions: Sequence[dict[str, Any]]) -> Recipe:
    """`recipe` (the run's recipe.yaml) with the applied actions' changes, in order: the recipe the run ended with
    (a RecipeError when they do not apply to it: metrics.jsonl of another run, or edited)."""
    return apply(recipe, [Action.from_dict(a) for a in applied_actions(actions)])


def rows_after_actions(actions: Sequence[dict[str, Any]], numerics: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The statistics rows recorded after the last applied action that changed their (module, role): each module
    and role as the plan the run ended with ran it (``numerics`` itself when no action applied)."""
    applied = applied_actions(actions)
    if not applied:
        return list(numerics)

    def last_action(row: dict[str, Any]) -> int:
        return max((_step(a) for a in applied if _covers(a, row)), default=0)
    return [r for r in numerics if _step(r) is not None and _step(r) > last_action(r)]


def _outcome(action: dict[str, Any], later: list[dict[str, Any]], until: int | None) -> str:
    span = f"steps {action['step'] + 1}-{until}" if until else f"from step {action['step'] + 1}"
    if action.get("action") == "to_bf16":
        return f"in BF16 {span}: no FP8 rows to judge"
    if not later:
        return f"not judged: no statistics rows of it recorded {span}"
    findings = [f for f in find_problems(later) if f.kind not in SUPPORTING]
    recorded = len({r.get("step") for r in later})
    if not findings:
        return f"held: no finding in {recorded} statistics steps ({span})"
    worst = findings[0]
    if action.get("module") == "*":  # role-wide: how many of the role's modules it cleared
        modules, still = {r.get("module") for r in later}, {f.module for f in findings}
        return (f"held in {len(modules - still)} of {len(modules)} modules; not in {len(still)}, the worst "
                f"{worst.module} {worst.role} {worst.text} ({span})")
    return f"did not hold: {worst.module} {worst.role} {worst.text} ({span})"


def action_outcomes(actions: Sequence[dict[str, Any]], numerics: Sequence[dict[str, Any]]) -> list[str]:
    """One line per autopilot action, in step order: what it did and whether it held (the module docstring)."""
    out = []
    actions = [a for a in actions if _step(a) is not None]
    numerics = [r for r in numerics if _step(r) is not None]
    ordered = sorted(actions, key=_step)
    for i, a in enumerate(ordered):
        head = (f"step {a.get('step')}: {a.get('action')} {a.get('module')} {a.get('role')}"
                + (f" ({a.get('before')} -> {a.get('after')})" if a.get("before") or a.get("after") else ""))
        if a.get("dry"):
            out.append(f"{head}: dry run, nothing changed")
            continue
        if not a.get("changes"):  # cap_reached
            out.append(f"{head}: {a.get('reason', '')}")
            continue
        nxt = next((_step(b) for b in ordered[i + 1:] if not b.get("dry") and b.get("changes")
                    and (b.get("module"), b.get("role")) == (a.get("module"), a.get("role"))), None)
        later = [r for r in numerics if _covers(a, r) and _step(r) > _step(a) and (nxt is None or _step(r) <= nxt)]
        out.append(f"{head}: {_outcome(a, later, nxt)}")
    return out
