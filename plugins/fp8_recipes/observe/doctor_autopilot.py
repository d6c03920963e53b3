"""The doctor on a run the autopilot drove: which of its actions held.

    for line in action_outcomes(run.autopilot, run.numerics): print(line)

An action (a ``kind: autopilot`` row of metrics.jsonl, training/autopilot.py) *held* when the (module, role) it
changed shows no finding (the doctor's limits, :func:`~fp8_recipes.observe.doctor_findings.find_problems`) in
the statistics rows recorded after it, up to its module and role's next action; it *did not hold* when they show
one (the worst named). A module put in BF16 has no FP8 rows to judge: its line says so, and whether it came back
(re-promoted) and held then. Dry-run actions changed nothing: listed as such. Pure (no torch).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fp8_recipes.observe.doctor_findings import SUPPORTING, find_problems

__all__ = ["action_outcomes"]


def _covers(action: dict[str, Any], row: dict[str, Any]) -> bool:
    """Whether a statistics row is of the (module, role) the action changed (``*``: every module, every role)."""
    module, role = str(action.get("module")), str(action.get("role"))
    return (module in ("*", row.get("module"))) and (role in ("*", row.get("role")))


def _outcome(action: dict[str, Any], later: list[dict[str, Any]], until: int | None) -> str:
    span = f"steps {action['step'] + 1}-{until}" if until else f"from step {action['step'] + 1}"
    if action.get("action") == "to_bf16" and action.get("module") != "*":
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
    ordered = sorted(actions, key=lambda a: int(a.get("step", 0)))
    for i, a in enumerate(ordered):
        head = (f"step {a.get('step')}: {a.get('action')} {a.get('module')} {a.get('role')}"
                + (f" ({a.get('before')} -> {a.get('after')})" if a.get("before") or a.get("after") else ""))
        if a.get("dry"):
            out.append(f"{head}: dry run, nothing changed")
            continue
        if not a.get("changes"):  # cap_reached
            out.append(f"{head}: {a.get('reason', '')}")
            continue
        nxt = next((int(b["step"]) for b in ordered[i + 1:] if not b.get("dry") and b.get("changes")
                    and (b.get("module"), b.get("role")) == (a.get("module"), a.get("role"))), None)
        later = [r for r in numerics if _covers(a, r) and int(r.get("step", 0)) > int(a["step"])
                 and (nxt is None or int(r.get("step", 0)) <= nxt)]
        out.append(f"{head}: {_outcome(a, later, nxt)}")
    return out
