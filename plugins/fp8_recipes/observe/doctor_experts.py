"""The doctor per expert: an MoE expert whose delayed scale is far from its current one, why, and its own remedy.

    causes = expert_causes(findings, numerics, routing)   # each: the layer, the expert, the cause, the roles
    proposals = expert_proposals(causes, recipe)          # one modules: entry per expert: only what is broken

An expert is diagnosed when a lasting scale-gap finding (delayed/current scale below 1/64 or above 4 in at least
a quarter of its rows: :mod:`~fp8_recipes.observe.doctor_findings`) names one of its linears
(``decoder.layers.L.mlp.experts.local_experts.E.linear_fcK``). Its MoE layer's routing.jsonl rows up to the last
flagged step (:mod:`~fp8_recipes.observe.routing`: tokens and mean routing weight per expert and step) tell the
cause, the first that applies:

``starved``        no token in at least half of those steps (:data:`STARVED_IDLE`), or a median count below 1/8 of an
                   even share (:data:`FEW`): an idle expert's activation and gradient histories do not roll (TE's
                   GroupedLinear neither records nor rolls an empty split, and the emulation does what it does), so
                   the scale it meets its next tokens with is as old as its last busy step. A shorter history does
                   not help (it does not roll either); current scaling for the flagged roles does.
``routing_shift``  its token count or its mean routing weight changed :data:`SHIFT`-fold or more between the steps
                   before some step and the steps from it on, at or before its first flagged row. Megatron-Core
                   multiplies an expert's SwiGLU output by the token's routing weight, so a weight that falls
                   100-fold shrinks its fc2 input and its fc1 gradients 100-fold, while a delayed history still
                   holds the amaxes of the tokens before. Remedy: a shorter history for the flagged roles
                   (:data:`SHORT_HISTORY` steps, the moe_delayed preset's window; half the history when it is
                   already that short); alternatives: current scaling, or BF16.

Without routing rows, or with neither pattern, the expert's findings go to the general rules
(:mod:`~fp8_recipes.observe.doctor_remedies`). Pure functions over plain rows (no torch).
"""

from __future__ import annotations

import math
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from fp8_recipes.observe.doctor_findings import LIMITS, SCALE_RATIO_HIGH, Finding, _usable_rows
from fp8_recipes.observe.doctor_remedies import LASTING, Proposal
from fp8_recipes.recipe.schema import ROLES, Recipe, Scaling

__all__ = ["EXPERT_MODULE", "ExpertCause", "describe_modules", "expert_causes", "expert_of", "expert_proposals"]

EXPERT_MODULE = re.compile(r"^(?P<prefix>(?:.*\.)?layers\.(?P<layer>\d+)\.mlp\.experts\.local_experts\.(?P<expert>\d+))"
                           r"\.[^.]+$")
"""A routed expert's linear: its name's prefix (the expert), the global layer and expert numbers."""
STARVED_IDLE = 0.5
"""An expert idle in at least this fraction of the steps up to its last flagged row is starved."""
FEW = 1 / 8
"""... or one whose median token count is below this fraction of an even share (all tokens / experts)."""
SHIFT = 4.0
"""A change in an expert's token count or mean routing weight of at least this factor is a routing shift (the
tokens of a tiny model's healthy run move up to ~3x between steps at random, and its delayed scales keep up)."""
SHORT_HISTORY = 16
"""The amax history proposed after a routing shift: the moe_delayed preset's (a shift leaves it in 16 steps)."""


@dataclass(frozen=True)
class ExpertCause:
    prefix: str
    """The expert's module prefix: ``decoder.layers.L.mlp.experts.local_experts.E``."""
    layer: int
    expert: int
    cause: str
    """``starved`` | ``routing_shift``."""
    roles: tuple[str, ...]
    """The roles whose delayed scales are far from the current ones (the remedy changes these only)."""
    step: int
    """Starved: the first idle (or nearly idle) step; routing shift: the first step after it."""
    evidence: str
    """What the routing rows show, with the numbers."""
    worst: Finding
    """The worst scale-gap finding among the expert's linears."""

    @property
    def pattern(self) -> str:
        """The ``modules:`` pattern of this expert's linears (fc1 and fc2) and nothing else."""
        return f"{self.prefix}.*"

    @property
    def text(self) -> str:
        what = "starved" if self.cause == "starved" else "routing shift"
        return (f"layer {self.layer} expert {self.expert}: {what} ({self.evidence}); {', '.join(self.roles)}: "
                f"{self.worst.module.rsplit('.', 1)[-1]} {self.worst.gemm} {self.worst.text}")


def expert_of(module: str) -> tuple[str, int, int] | None:
    """(prefix, layer, expert) of a routed expert's linear, else None."""
    m = EXPERT_MODULE.match(module)
    return (m["prefix"], int(m["layer"]), int(m["expert"])) if m else None


def _gap(row: dict[str, Any]) -> bool:
    ratio = row.get("scale_ratio")
    return isinstance(ratio, (int, float)) and 0 < ratio and (ratio <= 1 / LIMITS["scale_gap"]
                                                              or ratio >= SCALE_RATIO_HIGH)


def _flagged_steps(prefix: str, roles: set[str], numerics: list[dict[str, Any]]) -> list[int]:
    """The steps at which one of the expert's linears had a scale gap in one of `roles` (the doctor's rows: a
    delayed operand's first row, of scale 1 and an empty history, left out)."""
    return sorted({int(r.get("step", 0)) for (module, role), rows in _usable_rows(numerics).items()
                   if role in roles and module.startswith(prefix + ".") for r in rows if _gap(r)})


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _starved(rows: list[dict[str, Any]], e: int) -> tuple[int, str] | None:
    tokens = [int(r["tokens"][e]) for r in rows]
    idle = [int(r["step"]) for r, t in zip(rows, tokens) if t == 0]
    even = [sum(r["tokens"]) / len(r["tokens"]) for r in rows]
    share = statistics.median(t / s if s else 1.0 for t, s in zip(tokens, even))
    if len(idle) < STARVED_IDLE * len(rows) and share >= FEW:
        return None
    few = [int(r["step"]) for r, t, s in zip(rows, tokens, even) if t < FEW * s]
    busy = [t for t in tokens if t]
    return (idle or few)[0], (f"no token in {len(idle)} of {len(rows)} steps to step {rows[-1]['step']}; when "
                              f"routed, a median {statistics.median(busy) if busy else 0:g} tokens of an even "
                              f"share of {statistics.median(even):g}")


def _change_point(series: list[tuple[int, float]], first_bad: int) -> tuple[float, int, float, float] | None:
    """The one step splitting `series` (step, positive value) into two runs of least squared error around their
    geometric means, at or before `first_bad`: (fold, step, geometric mean before, after); None when too short."""
    logs = [(s, math.log(v)) for s, v in series if v > 0]
    best = None
    for k in range(1, len(logs)):
        if logs[k][0] > first_bad:
            break
        a, b = [v for _, v in logs[:k]], [v for _, v in logs[k:]]
        ma, mb = sum(a) / len(a), sum(b) / len(b)
        cost = sum((v - ma) ** 2 for v in a) + sum((v - mb) ** 2 for v in b)
        if best is None or cost < best[0]:
            best = (cost, logs[k][0], ma, mb)
    if best is None:
        return None
    _, step, ma, mb = best
    return math.exp(abs(ma - mb)), step, math.exp(ma), math.exp(mb)


def _shift(rows: list[dict[str, Any]], e: int, first_bad: int) -> tuple[int, str] | None:
    """The step at which the expert's mean routing weight or token count changed (the change point at or before
    `first_bad`), when that change is at least SHIFT-fold."""
    found = []
    for what, value in (("routing weight", lambda r: (r.get("weight") or [None] * (e + 1))[e]),
                        ("tokens", lambda r: r["tokens"][e])):
        series = [(int(r["step"]), float(v)) for r in rows if (v := value(r)) is not None]
        point = _change_point(series, first_bad)
        if point is not None and point[0] >= SHIFT:
            fold, step, before, after = point
            found.append((fold, step, f"its {what} {'fell' if after < before else 'rose'} {fold:.3g}-fold at step "
                                      f"{step}, from a geometric mean {before:.3g} to {after:.3g}"))
    if not found:
        return None
    _, step, text = max(found)
    return step, text


def expert_causes(findings: list[Finding], numerics: list[dict[str, Any]],
                  routing: list[dict[str, Any]]) -> list[ExpertCause]:
    """The experts behind lasting scale-gap findings, with the cause their routing rows show (see the module
    docstring), worst first; an expert whose routing shows neither is left to the general rules."""
    gaps: dict[tuple[str, int, int], list[Finding]] = defaultdict(list)
    for f in findings:
        who = expert_of(f.module)
        if who is not None and f.kind == "scale_gap" and f.share >= LASTING:
            gaps[who].append(f)
    by_layer: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in routing:
        if isinstance(r.get("tokens"), list) and isinstance(r.get("layer"), int):
            by_layer[r["layer"]].append(r)
    out = []
    for (prefix, layer, e), fs in gaps.items():
        roles = {f.role for f in fs}
        steps = _flagged_steps(prefix, roles, numerics)
        rows = sorted((r for r in by_layer.get(layer, []) if len(r["tokens"]) > e and steps
                       and int(r.get("step", 0)) <= steps[-1]), key=lambda r: int(r["step"]))
        if not rows:
            continue
        found = _starved(rows, e)
        cause = "starved"
        if found is None:
            found, cause = _shift(rows, e, steps[0]), "routing_shift"
        if found is None:
            continue
        worst = max(fs, key=lambda f: f.severity)
        out.append(ExpertCause(prefix, layer, e, cause, tuple(str(r) for r in ROLES if str(r) in roles), found[0],
                               found[1], worst))
    return sorted(out, key=lambda c: -c.worst.severity)


def _role_dict(policy, **change) -> dict[str, Any]:
    return {**policy.to_dict(), **change}


def expert_proposals(causes: list[ExpertCause], recipe: Recipe) -> list[Proposal]:
    """Per expert, a ``modules:`` entry for its linears, applied, and its alternatives. The entry keeps what the
    first pattern matching the expert gave it (a new pattern in front of it wins) and changes only the flagged
    roles: a shorter history after a routing shift, current scaling for a starved expert; BF16 (every role
    ``none``) is the last alternative. ``--write`` puts the new entries first in ``modules:``."""
    out = []
    for c in causes:
        module = c.worst.module
        override = recipe.module_override(module)
        kept = {str(r): p.to_dict() for r, p in override.policies} if override else {}
        policies = {role: recipe.module_policy(module, role) for role in c.roles}
        tensorwise = {**kept, **{role: {"scaling": str(Scaling.TENSORWISE), "format": str(p.format),
                                        "margin": p.margin} for role, p in policies.items()}}
        bf16 = {str(r): {"scaling": str(Scaling.NONE)} for r in ROLES}
        # (Transformer Engine runs a layer's grouped experts, moe_grouped_gemm, under one recipe: check_plan refuses)
        where = (f"{c.text}; with model.moe_grouped_gemm=true on Transformer Engine a layer's experts share one "
                 f"recipe: run it with moe_grouped_gemm=false there")
        if c.cause == "routing_shift":
            hist = min(policies.values(), key=lambda p: p.amax_history_len).amax_history_len
            short = SHORT_HISTORY if hist > SHORT_HISTORY else max(1, hist // 2)
            weights = recipe.module_policy(module, "weights")
            if "activations" in policies and weights.scaling is Scaling.DELAYED:
                policies = {**policies, "weights": weights}  # TE: one delayed state for a module's input and weight
            shorter = {**kept, **{role: _role_dict(p, amax_history_len=short) for role, p in policies.items()}}
            out.append(Proposal({"modules": {c.pattern: shorter}},
                                f"{', '.join(policies)} of layer {c.layer} expert {c.expert} with a {short}-step "
                                f"amax history (from {hist}): the amaxes of the tokens before the shift leave it "
                                f"{short} steps after it; every other module as it was ({where})"))
            out.append(Proposal({"modules": {c.pattern: tensorwise}}, "or current scaling for them: no history to "
                                "outlive a shift", alternative=True))
        else:
            out.append(Proposal({"modules": {c.pattern: tensorwise}},
                                f"{', '.join(c.roles)} of layer {c.layer} expert {c.expert} with current scaling: "
                                f"an idle expert's delayed history does not roll, so no history length keeps its "
                                f"scale fresh; each step's own amax does; every other module as it was ({where})"))
        out.append(Proposal({"modules": {c.pattern: bf16}}, f"or layer {c.layer} expert {c.expert} in BF16: the last "
                            f"resort, at the cost of its FP8 speed", alternative=True))
    return out


def describe_modules(entries: dict[str, Any]) -> str:
    """A ``modules:`` change for the report: ``"PATTERN": activations delayed e4m3 hist 16, ...``."""
    def one(d: dict[str, Any]) -> str:
        text = " ".join(str(d[k]) for k in ("scaling", "format") if k in d)
        return text + (f" hist {d['amax_history_len']}" if d.get("scaling") == "delayed" else "")
    return "; ".join(f'"{pattern}": ' + ", ".join(f"{role} {one(d)}" for role, d in roles.items())
                     for pattern, roles in entries.items())

