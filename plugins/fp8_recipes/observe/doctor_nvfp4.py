"""The doctor's remedies for an NVFP4 role (``scaling: nvfp4``): only what is broken changes.

    remedies, covered = nvfp4_remedies(role, recipe, lasting, flagged, quantized, role_wide)

The findings (:data:`~fp8_recipes.observe.doctor_findings.NVFP4_LIMITS`: values flushed to zero, block scales
flushed to 0 or clamped at 448, a cosine drop) become, the first that fits:

1. **The last layers.** When the role's lasting findings name only the last quantized layer(s) (half of their
   linears or more, and some earlier layer stays clean): ``layers.bf16_last`` + those layers (the paper keeps the
   last ~15 % of the layers in BF16 for this reason).
2. **Role-wide** (lasting findings in half of the role's linears or more): ranked, the first applied:
   the RHT on the wgrad copies (``activations.rht`` and ``gradients.rht``, both: the rotation cancels only when
   both operands have it) where it is off and every lasting finding is on the wgrad GEMM, which it rotates; else
   FP8 for this role only, MXFP8 E4M3 (one E8M0 scale per 32 values and no tensor-wide scale, so an outlier
   elsewhere cannot zero a block's scale; the other role's RHT off when this role had it, since the RHT needs
   both wgrad operands); alternatives: blockwise E4M3, the RHT, stochastic rounding of gradients where off
   (round-to-nearest loses every value below half its block's smallest code, stochastic rounding keeps them in
   expectation), the role in BF16.
3. Otherwise (a few modules): nothing here; the layer rules of doctor_remedies name them for BF16.

Each remedy is a :class:`Remedy` (doctor_remedies makes its Proposal of it: this module sits below that one);
``covered`` says whether they cover the role's findings (then those name no module for BF16). `lasting` and
`role_wide` are doctor_remedies' verdicts on the role. Pure functions over plain rows (no torch).
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any, NamedTuple

from fp8_recipes.observe.doctor_findings import Finding
from fp8_recipes.recipe.schema import DEFAULT_BLOCK, Recipe, Role, Scaling

__all__ = ["Remedy", "nvfp4_remedies"]


class Remedy(NamedTuple):
    """A recipe change: doctor_remedies.Proposal's fields."""

    changes: dict[str, Any]
    reason: str
    alternative: bool = False


_NVFP4_ONLY = ("block", "rht", "stochastic_rounding")
"""Role keys that mean something for nvfp4 (and block for blockwise): removed when the role leaves nvfp4."""


def _layer(name: str) -> int | None:
    m = re.search(r"layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def _tail_layers(flagged: set[str], quantized: set[str]) -> int:
    """How many of the last quantized layers the flagged modules fill (half their linears or more each), when they
    name nothing before them and leave an earlier layer; else 0."""
    per_layer: dict[int, set[str]] = defaultdict(set)
    for m in quantized:
        if _layer(m) is not None:
            per_layer[_layer(m)].add(m)
    layers = sorted(per_layer)
    hit = {_layer(m) for m in flagged}
    if not hit or None in hit or len(hit) >= len(layers) or sorted(hit) != layers[-len(hit):]:
        return 0
    full = all(2 * len(flagged & per_layer[n]) >= len(per_layer[n]) for n in hit)
    return len(hit) if full else 0


def _leave_nvfp4(recipe: Recipe, role: str, scaling: str, block=None) -> dict[str, Any]:
    """The keys that move `role` off nvfp4 (E4M3, or `scaling` none), and the other wgrad operand's RHT off where
    this role had it (the schema refuses the RHT on one operand)."""
    changes: dict[str, Any] = {f"{role}.scaling": scaling, f"{role}.format": "e4m3" if scaling != "none" else None}
    changes |= {f"{role}.{k}": None for k in _NVFP4_ONLY}
    if block is not None:
        changes[f"{role}.block"] = block
    other = {"activations": "gradients", "gradients": "activations"}.get(role)
    if other and recipe.policy(role).rht and recipe.policy(other).rht:
        changes[f"{other}.rht"] = None
    return changes


def _rht_proposal(recipe: Recipe, role: str) -> Remedy | None:
    if role == "weights" or recipe.policy(role).rht:
        return None
    pair = ("activations", "gradients")
    if any(recipe.policy(r).scaling is not Scaling.NVFP4 for r in pair):
        return None
    return Remedy({f"{r}.rht": True for r in pair if not recipe.policy(r).rht},
                    "the RHT on the wgrad GEMM's copies (activations and gradients: the rotation cancels only when "
                    "both operands have it): it spreads each 16-token block's largest values over the block, so the "
                    "smaller ones are no longer rounded to zero one by one")


def _evidence(role: str, lasting: list[Finding], quantized: set[str]) -> str:
    worst = max(lasting, key=lambda f: f.severity)
    return (f"{len({f.module for f in lasting})} of {len(quantized)} {role} linears show lasting NVFP4 findings "
            f"(worst: {worst.module} {worst.gemm}, {worst.text})")


def _role_wide(role: str, recipe: Recipe, lasting: list[Finding], quantized: set[str]) -> list[Remedy]:
    """Ranked role-wide changes (module docstring): the first applied, the others alternatives."""
    policy = recipe.policy(role)
    out: list[tuple[int, Remedy]] = []
    wgrad_only = all(f.gemm == "wgrad" for f in lasting)
    rht = _rht_proposal(recipe, role)
    if rht is not None and (wgrad_only or any(f.gemm == "wgrad" for f in lasting)):
        out.append((0 if wgrad_only else 3, rht))
    out.append((1, Remedy(_leave_nvfp4(recipe, role, "mxfp8"),
                            f"{role} nvfp4 -> mxfp8 e4m3, this role only: one E8M0 scale per 32 values and no "
                            f"tensor-wide scale, so no block's scale is flushed by an outlier elsewhere, and 3 "
                            f"mantissa bits instead of 1")))
    block = list(DEFAULT_BLOCK[Role(role)])
    out.append((2, Remedy(_leave_nvfp4(recipe, role, "blockwise", block),
                            f"{role} nvfp4 -> blockwise {block[0]}x{block[1]} e4m3 (real FP8 GEMMs on Hopper too)")))
    if role == "gradients" and not policy.stochastic_rounding and any(f.effect == "underflow" for f in lasting):
        out.append((4, Remedy({"gradients.stochastic_rounding": True},
                                "stochastic rounding of the gradients: round-to-nearest loses every value below half "
                                "its block's smallest code, stochastic rounding keeps them in expectation")))
    out.append((9, Remedy(_leave_nvfp4(recipe, role, "none"),
                            f"{role} in BF16: the last resort, at the cost of the role's 4-bit speed")))
    out.sort(key=lambda t: t[0])
    why = _evidence(role, lasting, quantized)
    return [Remedy(p.changes, f"{p.reason}. Evidence: {why}") if i == 0 else
            Remedy(p.changes, "or " + p.reason, alternative=True) for i, (_, p) in enumerate(out)]


def nvfp4_remedies(role: str, recipe: Recipe, lasting: list[Finding], flagged: set[str], quantized: set[str],
                   role_wide: bool) -> tuple[list[Remedy], bool]:
    """(the remedies for NVFP4 role `role`, whether they cover its findings): `lasting` its lasting findings,
    `flagged` the modules they name, `quantized` the modules numerics.jsonl has this role for, `role_wide` whether
    they name enough of those for a role-wide change."""
    if not lasting:
        return [], False
    tail = _tail_layers(flagged, quantized)
    if tail:
        last = recipe.layers.bf16_last
        worst = max(lasting, key=lambda f: f.severity)
        return [Remedy({"layers.bf16_last": last + tail},
                         f"bf16_last {last} -> {last + tail}: the {role} findings sit in the last {tail} quantized "
                         f"layer(s) only (worst: {worst.module} {worst.gemm}, {worst.text}); the earlier layers "
                         f"keep NVFP4")], True
    if role_wide:
        return _role_wide(role, recipe, lasting, quantized), True
    return [], False
