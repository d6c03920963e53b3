"""The doctor's remedies: recipe changes that fit the extent of the cause, ranked, each with the evidence for it.

    proposals = propose(findings, recipe, numerics)      # each role's change, worst evidence first; layers last
    proposals.append(warmup_proposal(recipe, onset, total))

A role whose findings cover at least half of its quantized linears (:data:`ROLE_WIDE`) has a role-wide problem
and gets a role-wide change: the margin, the format, the block size or the scaling mode, ranked by how directly
the recipe's own setting explains the evidence (a margin that shrinks every value comes before a format change,
which comes before a new scaling mode); the best is applied by ``--write``, the others are printed as
alternatives. Putting a handful of modules in BF16 would leave every other linear as it was. A problem in a few
modules gets BF16 for those modules (or the whole first/last layer), and under delayed scaling the switch to
current scaling, which keeps one module's outlier from lasting in its amax history. An NVFP4 role has remedies of
its own (:mod:`~fp8_recipes.observe.doctor_nvfp4`). Pure functions over plain rows (no torch).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from fp8_recipes.observe.doctor_findings import SCALE_RATIO_HIGH, SUPPORTING, Finding, module_scores
from fp8_recipes.observe.doctor_nvfp4 import nvfp4_remedies
from fp8_recipes.recipe.schema import DEFAULT_BLOCK, ROLES, Format, MxRounding, Recipe, Role, Scaling, TensorPolicy

__all__ = ["ROLE_WIDE", "Proposal", "propose", "role_extent", "warmup_proposal"]

ROLE_WIDE = 0.5
"""A role's problem is role-wide when lasting findings (:data:`LASTING`) name at least this fraction of the role's
quantized linears (and at least two of them)."""
LASTING = 0.25
"""A finding lasts when at least this fraction of its module's recorded steps are beyond the limit: one bad step
in many linears is an event (an outlier, a blow-up) that the role's setting did not cause."""
MAX_MODULES = 3
"""Layer fallbacks name at most this many modules: more is a role-wide problem or a warmup problem."""


@dataclass(frozen=True)
class Proposal:
    changes: dict[str, Any]
    """Dotted recipe keys -> new value (None: remove the key)."""
    reason: str
    """Why, with the evidence (module, GEMM, value, step, how many linears)."""
    alternative: bool = False
    """An alternative to a proposal above: printed, not applied by --write."""


def _module_layer(name: str) -> int | None:
    m = re.search(r"layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def role_extent(findings: list[Finding], numerics: list[dict[str, Any]]) -> dict[str, tuple[set[str], set[str]]]:
    """role -> (the modules its lasting findings name, the modules numerics.jsonl has that role for)."""
    quantized: dict[str, set[str]] = defaultdict(set)
    for r in numerics:
        quantized[str(r.get("role", "?"))].add(str(r.get("module", "?")))
    flagged: dict[str, set[str]] = defaultdict(set)
    roles = set()
    for f in findings:
        if f.kind not in SUPPORTING:
            roles.add(f.role)
            if f.share >= LASTING:
                flagged[f.role].add(f.module)
    return {role: (flagged[role], quantized[role]) for role in roles}


def _is_role_wide(flagged: set[str], quantized: set[str]) -> bool:
    return len(flagged) >= 2 and len(flagged) >= ROLE_WIDE * len(quantized)


# ---------------------------------------------------------------------------------------------------------------
# Role-wide changes


def _evidence(role: str, mine: list[Finding], effect: str, flagged: set[str], quantized: set[str]) -> str:
    hits = [f for f in mine if f.effect == effect] or mine
    worst = max(hits, key=lambda f: f.severity)
    named = len({f.module for f in hits})
    return (f"{named} of {len(quantized)} {role} linears show lasting {effect} (worst: {worst.module} {worst.gemm}, "
            f"{worst.text})" if effect else f"{len(flagged)} of {len(quantized)} {role} linears flagged")


def _role_wide(role: str, policy: TensorPolicy, mine: list[Finding], flagged: set[str],
               quantized: set[str]) -> list[Proposal]:
    """Ranked role-wide changes for one role: the first fits the evidence best (applied), the rest alternatives."""
    scaling, fmt, margin, block = policy.scaling, policy.format, policy.margin, list(policy.block)
    small_block = list(DEFAULT_BLOCK[Role(role)])  # what a role moves to: the default blocks (TE's)
    effects = defaultdict(float)
    for f in mine:
        effects[f.effect] += f.severity
    effect = max(effects, key=effects.get) if effects else ""
    why = _evidence(role, mine, effect, flagged, quantized)
    to_blocks = {f"{role}.scaling": "blockwise", f"{role}.block": small_block, f"{role}.amax_history_len": None,
                 f"{role}.amax_compute_algo": None, f"{role}.percentile": None}
    out: list[tuple[int, Proposal]] = []  # (rank, proposal): lower ranks first
    if effect == "underflow":
        if margin > 0 and scaling is not Scaling.MXFP8:
            out.append((0, Proposal({f"{role}.margin": 0}, f"margin {margin} -> 0: the margin shrinks every value "
                                    f"{2 ** margin}x before the cast, so the small ones fall below FP8's smallest "
                                    f"step")))
        if scaling is Scaling.DELAYED and any(f.kind == "scale_gap" for f in mine):
            out.append((1, Proposal({f"{role}.scaling": "tensorwise", f"{role}.amax_history_len": None,
                                     f"{role}.amax_compute_algo": None, f"{role}.percentile": None},
                                    f"delayed -> tensorwise: the scale comes from a stale, larger amax; each step's "
                                    f"own amax fits its values")))
        if fmt is Format.E4M3 and role == "gradients" and scaling is not Scaling.MXFP8:
            out.append((2, Proposal({f"{role}.format": "e5m2"}, f"{role} e4m3 -> e5m2: 2^32 of range instead of "
                                    f"2^18, what gradients spanning many magnitudes need")))
        if scaling in (Scaling.TENSORWISE, Scaling.DELAYED):
            out.append((3, Proposal(to_blocks, f"{scaling} -> blockwise {small_block[0]}x{small_block[1]}: one scale "
                                    f"per block, so small values far from the tensor's largest keep their own "
                                    f"range")))
        elif scaling is Scaling.BLOCKWISE and block[0] * block[1] > small_block[0] * small_block[1]:
            out.append((3, Proposal({f"{role}.block": small_block}, f"block {block[0]}x{block[1]} -> "
                                    f"{small_block[0]}x{small_block[1]}: smaller blocks, each with its own scale")))
    elif effect == "clipping":
        if scaling is Scaling.DELAYED:
            out.append((1, Proposal({f"{role}.scaling": "tensorwise", f"{role}.amax_history_len": None,
                                     f"{role}.amax_compute_algo": None, f"{role}.percentile": None},
                                    f"delayed -> tensorwise: the amax grows between steps and a scale from past "
                                    f"steps clips")))
        if scaling in (Scaling.DELAYED, Scaling.TENSORWISE, Scaling.BLOCKWISE):
            out.append((2, Proposal({f"{role}.margin": margin + 1}, f"margin {margin} -> {margin + 1}: one more "
                                    f"power of two of headroom above the amax the scale came from")))
        if scaling is Scaling.MXFP8 and policy.mx_rounding is MxRounding.FLOOR:
            out.append((0, Proposal({f"{role}.mx_rounding": "rceil"}, f"mx_rounding floor -> rceil: a floor E8M0 "
                                    f"exponent lets a block's largest values clip")))
    elif effect == "precision":
        large_blocks = scaling is Scaling.BLOCKWISE and block[0] * block[1] > 128
        if scaling in (Scaling.TENSORWISE, Scaling.DELAYED) or large_blocks:
            out.append((3, Proposal({**to_blocks, f"{role}.format": "e4m3"},
                                    f"{scaling} {fmt} -> blockwise {small_block[0]}x{small_block[1]} e4m3: blocks "
                                    f"give E4M3's extra mantissa bit enough range")))
    if policy.is_fp8:  # always possible, and the last resort: the role loses its FP8 speed
        out.append((9, Proposal({f"{role}.scaling": "none"}, f"{role} in BF16: the last resort, at the cost of "
                                                                f"the role's FP8 speed")))
    out.sort(key=lambda t: t[0])  # the evidence once, with the best-ranked change; the others are alternatives
    return [Proposal(p.changes, f"{p.reason}. Evidence: {why}") if i == 0 else
            Proposal(p.changes, "or " + p.reason, alternative=True) for i, (_, p) in enumerate(out)]


# ---------------------------------------------------------------------------------------------------------------
# Layer-local changes


def _local_role(role: str, policy: TensorPolicy, mine: list[Finding]) -> list[Proposal]:
    """A few modules of a role with a lasting finding: under delayed scaling, current scaling (an outlier then
    cannot outlive its step); under current scaling, a margin when values clipped. One bad step changes no role:
    it is an event (a spike elsewhere), and the module's fallback, if it scores, covers it."""
    lasting = [f for f in mine if f.share >= LASTING]
    if not lasting:
        return []
    worst = max(lasting, key=lambda f: f.severity)
    where = f"{worst.module} {worst.gemm}: {worst.text}"
    out = []
    if policy.scaling is Scaling.DELAYED:
        out.append(Proposal({f"{role}.scaling": "tensorwise", f"{role}.amax_history_len": None,
                             f"{role}.amax_compute_algo": None, f"{role}.percentile": None},
                            f"delayed -> tensorwise: the scale then comes from each step's own amax, so one "
                            f"outlier cannot skew later steps ({where})"))
        hist = policy.amax_history_len
        if hist > 1:
            out.append(Proposal({f"{role}.amax_history_len": max(1, hist // 2)},
                                f"or keep delayed with a 50% shorter amax history: an outlier leaves it "
                                f"{hist - hist // 2} steps sooner", alternative=True))
        if any(f.effect == "clipping" and (f.kind != "scale_gap" or f.value >= SCALE_RATIO_HIGH) for f in mine):
            out.append(Proposal({f"{role}.margin": policy.margin + 1},
                                "or a margin of one more power of two against the amax growing between steps",
                                alternative=True))
    elif any(f.kind == "saturation_pct" for f in mine) and policy.scaling in (Scaling.TENSORWISE, Scaling.BLOCKWISE):
        out.append(Proposal({f"{role}.margin": policy.margin + 1},
                            f"margin +1: headroom against values beyond the amax the scale came from ({where})"))
    return out


def _layer_proposals(findings: list[Finding], recipe: Recipe, numerics: list[dict[str, Any]]) -> list[Proposal]:
    """BF16 for the modules behind most of the trouble: bf16_first/bf16_last when half of the first/last layer's
    linears are flagged, else the modules by name (bf16_modules globs match the names exactly)."""
    primary = {f.module for f in findings if f.kind not in SUPPORTING}
    score = {m: v for m, v in module_scores(findings).items() if m in primary}
    if not score:
        return []
    top = max(score.values())
    named = [m for m, s in sorted(score.items(), key=lambda t: -t[1]) if s >= 0.5 * top][:MAX_MODULES]
    per_layer = defaultdict(set)
    for r in numerics:
        per_layer[_module_layer(str(r.get("module", "")))].add(r.get("module"))
    layers = set(per_layer) - {None}
    rules = recipe.layers
    out, left = [], list(named)
    for key, layer in (("bf16_first", min(layers, default=None)), ("bf16_last", max(layers, default=None))):
        hit = [m for m in named if _module_layer(m) == layer]
        if layer is not None and len(layers) > 2 and len(hit) * 2 >= len(per_layer[layer]) and hit:
            out.append(Proposal({f"layers.{key}": max(getattr(rules, key), 1)},
                                f"{len(hit)} of layer {layer}'s {len(per_layer[layer])} linears show the problem"))
            left = [m for m in left if m not in hit]
    if left:
        mods = list(rules.bf16_modules)
        out.append(Proposal({"layers.bf16_modules": mods + [m for m in left if m not in mods]},
                            "BF16 for the module(s) behind it: " + "; ".join(
                                f"{m} (score {score[m]:.1f})" for m in left)))
    return out


def propose(findings: list[Finding], recipe: Recipe | None, numerics: list[dict[str, Any]]) -> list[Proposal]:
    """A role-wide change for a role-wide problem, a per-role change for a local one, the role with the worst
    evidence first (a role-wide role does not jump the queue: a consequence can be role-wide, the cause local),
    then layer changes (see the module docstring). The findings of a role-wide role never name modules for BF16:
    its change covers them. An unknown recipe (None) has no role setting to change: the layer fallbacks only."""
    recipe = recipe if recipe is not None else Recipe()  # every role BF16 and no layer rules: nothing to change
    extent = role_extent(findings, numerics)
    out, covered = [], set()
    weight = {r: sum(f.severity for f in findings if f.role == r and f.kind not in SUPPORTING) for r in map(str, ROLES)}
    for role in sorted(map(str, ROLES), key=lambda r: -weight[r]):  # the worst evidence first, role-wide or not
        policy = recipe.policy(role)
        mine = [f for f in findings if f.role == role and f.kind not in SUPPORTING]
        if not mine:
            continue
        flagged, quantized = extent[role]
        if policy.scaling is Scaling.NVFP4:  # its own remedies (the last layers, the RHT, FP8 for this role)
            remedies, done = nvfp4_remedies(role, recipe, [f for f in mine if f.share >= LASTING], flagged,
                                            quantized, _is_role_wide(flagged, quantized))
            out += [Proposal(*r) for r in remedies if r.changes not in [q.changes for q in out]]  # (roles may agree)
            covered |= {role} if done else set()
        elif _is_role_wide(flagged, quantized):
            out += _role_wide(role, policy, [f for f in mine if f.share >= LASTING], flagged, quantized)
        else:
            out += _local_role(role, policy, mine)
    wide_roles = {r for r in extent if _is_role_wide(*extent[r]) and recipe.policy(r).scaling is not Scaling.NVFP4}
    kept = [f for f in findings if f.role not in wide_roles | covered]
    return out + _layer_proposals(kept, recipe, numerics)


def warmup_proposal(recipe: Recipe, onset: int, total: int) -> Proposal:
    steps = max(recipe.schedule.bf16_warmup_steps, 10 * math.ceil(2 * onset / 10), min(100, total // 10))
    return Proposal({"schedule.bf16_warmup_steps": steps},
                    f"BF16 warmup for the first {steps} steps: the trouble starts at step {onset}, before the "
                    f"weights and activations have settled")
