"""The doctor's findings: what numerics.jsonl says about each module and role, against fixed limits.

    findings = find_problems(read_numerics(run_dir))   # worst module first; each: module, role, gemm, kind, value, step

A finding is one statistic of one (module, role) beyond its limit (:data:`LIMITS`; NVFP4 operands:
:data:`NVFP4_LIMITS`), worst over the recorded steps and GEMMs, with the step it happened at; the first row of a
delayed operand is skipped (empty history, scale 1, as in Transformer Engine). Severity = value / limit (log scale
for ratios); a module's score is the sum of its findings'. Pure functions over plain rows (no torch); :mod:`fp8_recipes.observe.doctor` turns them into proposals.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

__all__ = ["Finding", "LIMITS", "NVFP4_LIMITS", "SCALE_RATIO_HIGH", "SUPPORTING", "find_problems", "module_scores"]

LIMITS = {"underflow_pct": 1.0, "saturation_pct": 1.0, "cosine_drop": 0.01, "scale_gap": 64.0, "mse_jump": 100.0}
"""A finding: underflow or saturation >= 1 %, cosine <= 0.99, delayed/current scale ratio below 1/64 or above
4 (:data:`SCALE_RATIO_HIGH`), MSE / amax^2 100x its own median over the run's steps."""
NVFP4_LIMITS = {"underflow_pct": 40.0, "cosine_drop": 0.02, "block_underflow_pct": 5.0, "block_saturation_pct": 1.0}
"""An NVFP4 operand's limits (rows whose policy is ``nvfp4 ...``; the others as LIMITS): 40 % of its values flushed to
zero, cosine <= 0.98, 5 % of its non-zero blocks with an E4M3 scale of 0, 1 % with one clamped at 448. E2M1 has
codes from 0.5 to 6 per block, so a healthy NVFP4 tensor flushes what is below 1/24 of its block's largest: on the
tiny CPU model the paper's recipe flushes 6-10 % of most operands and 20-30 % of the fc2 inputs (GeLU outputs) and
fc1 gradients, every cosine is 0.988 or more, and at most 0.7 % of a tensor's blocks underflow (docs/nvfp4.md)."""
_PCT_KINDS = {"underflow_pct": ("underflow", "underflow"), "saturation_pct": ("saturation", "clipping"),
              "block_underflow_pct": ("block scales flushed to 0", "scale_underflow"),
              "block_saturation_pct": ("block scales clamped at 448", "clipping")}
"""Share statistics -> (their words in a finding, their effect); the block ones are NVFP4's."""
SUPPORTING = ("mse_jump",)
"""Kinds that add to a module's score but never name it for BF16 on their own."""
SCALE_RATIO_HIGH = 4.0


@dataclass(frozen=True)
class Finding:
    module: str
    role: str
    gemm: str
    kind: str
    """underflow_pct | saturation_pct | cosine_drop | scale_gap | mse_jump; NVFP4 also block_underflow_pct |
    block_saturation_pct."""
    value: float
    step: int
    text: str
    severity: float
    """value / its limit (log scale for ratios): what orders findings."""
    policy: str = ""
    effect: str = ""
    """What the finding does to the values: underflow (lost to zero) | clipping | precision | scale_underflow (NVFP4:
    whole blocks lost to a zero E4M3 scale) | "" (supporting)."""
    share: float = 0.0
    """The fraction of the (module, role)'s recorded rows beyond the limit: 1/N is one bad step, near 1 lasting."""


def _gemm_order(gemm: str) -> int:
    return {"fprop": 0, "dgrad": 1, "wgrad": 2}.get(gemm, 3)


def _usable_rows(rows: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Rows by (module, role); the first row of a delayed operand is left out: its history is empty and the
    scale is 1, as in Transformer Engine, which says nothing about the recipe."""
    by_key: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in sorted(rows, key=lambda r: r.get("step", 0)):
        by_key[(r.get("module", "?"), r.get("role", "?"), r.get("gemm", "?"))].append(r)
    out: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for (module, role, _), rs in by_key.items():
        if rs and str(rs[0].get("policy", "")).startswith("delayed") and rs[0].get("scale") == 1.0:
            rs = rs[1:]
        out[(module, role)].extend(rs)
    return out


def _worst(rows: list[dict[str, Any]], key: str, pick=max) -> tuple[float, dict[str, Any]] | None:
    vals = [(float(r[key]), r) for r in rows if isinstance(r.get(key), (int, float))]
    vals = [(v, r) for v, r in vals if math.isfinite(v)]
    return pick(vals, key=lambda t: t[0]) if vals else None


def _findings_for(module: str, role: str, rows: list[dict[str, Any]]) -> list[Finding]:
    out = []

    def add(kind: str, value: float, row: dict[str, Any], text: str, severity: float, effect: str,
            beyond: int = 0) -> None:
        out.append(Finding(module, role, str(row.get("gemm", "?")), kind, value, int(row.get("step", 0)), text,
                           severity, str(row.get("policy", "")), effect, beyond / len(rows)))

    nvfp4 = bool(rows) and str(rows[0].get("policy", "")).startswith("nvfp4")
    limits = {**LIMITS, **NVFP4_LIMITS} if nvfp4 else LIMITS
    for kind, (label, effect) in _PCT_KINDS.items():
        w = _worst(rows, kind) if kind in limits else None
        if w and w[0] >= limits[kind]:
            steps = sum(1 for r in rows if (r.get(kind) or 0) >= limits[kind])
            label = "flushed to zero" if nvfp4 and kind == "underflow_pct" else label
            add(kind, w[0], w[1], f"{label} {w[0]:.2f}% (step {w[1]['step']}; {steps} rows >= {limits[kind]:g}%)",
                w[0] / limits[kind], effect, steps)
    w = _worst(rows, "cosine", min)
    if w and 1 - w[0] >= limits["cosine_drop"]:
        low = sum(1 for r in rows
                  if isinstance(r.get("cosine"), (int, float)) and 1 - r["cosine"] >= limits["cosine_drop"])
        add("cosine_drop", 1 - w[0], w[1], f"cosine {w[0]:.4f} (step {w[1]['step']})",
            (1 - w[0]) / limits["cosine_drop"], "precision", low)
    lo, hi = _worst(rows, "scale_ratio", min), _worst(rows, "scale_ratio", max)
    if lo and 0 < lo[0] <= 1 / LIMITS["scale_gap"]:
        after = sum(1 for r in rows if 0 < (r.get("scale_ratio") or 1) <= 1 / LIMITS["scale_gap"])
        add("scale_gap", 1 / lo[0], lo[1], f"delayed/current scale {lo[0]:.2g}x (step {lo[1]['step']}; {after} rows "
                                           f"< 1/{LIMITS['scale_gap']:g}): underflows",
            math.log2(1 / lo[0]) / math.log2(LIMITS["scale_gap"]), "underflow", after)
    if hi and hi[0] >= SCALE_RATIO_HIGH:
        clipped = sum(1 for r in rows if (r.get("scale_ratio") or 0) >= SCALE_RATIO_HIGH)
        add("scale_gap", hi[0], hi[1], f"delayed/current scale {hi[0]:.3g}x (step {hi[1]['step']}): clips",
            math.log2(hi[0]) / math.log2(SCALE_RATIO_HIGH), "clipping", clipped)
    rel = [(float(r["mse"]) / float(r["amax"]) ** 2, r) for r in rows
           if isinstance(r.get("mse"), (int, float)) and isinstance(r.get("amax"), (int, float)) and r["amax"] > 0
           and math.isfinite(float(r["mse"]))]
    if rel:  # MSE / amax^2: a larger tensor alone raises the MSE, a worse quantization raises this
        median = statistics.median(v for v, _ in rel)
        worst, row = max(rel, key=lambda t: t[0])
        if median > 0 and worst >= LIMITS["mse_jump"] * median:
            add("mse_jump", worst / median, row, f"MSE/amax^2 {worst / median:.3g}x its median (step {row['step']})",
                math.log10(worst / median) / math.log10(LIMITS["mse_jump"]), "")
    return out


def module_scores(findings: list[Finding]) -> dict[str, float]:
    score: dict[str, float] = defaultdict(float)
    for f in findings:
        score[f.module] += f.severity
    return score


def find_problems(numerics: list[dict[str, Any]], until: int | None = None) -> list[Finding]:
    """Every finding of every (module, role), the most severe module first, then by severity within a module;
    with `until`, from the rows of steps up to it only (what came before a divergence, not its consequences)."""
    if until is not None:
        numerics = [r for r in numerics if int(r.get("step", 0)) <= until]
    findings = [f for (m, role), rows in _usable_rows(numerics).items() for f in _findings_for(m, role, rows)]
    score = module_scores(findings)
    return sorted(findings, key=lambda f: (-score[f.module], f.module, -f.severity, _gemm_order(f.gemm)))
