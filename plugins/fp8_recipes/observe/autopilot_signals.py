"""The autopilot's signals: what one statistics step's numerics rows say about each (module, role).

    readings = read_rows(rows, config, fresh)     # (module, role) -> Reading: flagged?, calm?, cause, evidence
    spike = spiking(history, loss, "loss")         # the doctor's spike rule against a running median

A row is flagged by any signal at or beyond its limit (:class:`~fp8_recipes.observe.autopilot_config.AutopilotLimits`,
the doctor's): non-finite values, saturation, a delayed scale >= 4x the current one (:data:`SCALE_RATIO_HIGH`) --
all *clipping* --; a delayed scale <= 1/scale_gap of the current one where it costs (:data:`COST`: *stale*,
the history remembers larger values); underflow where it costs (a cosine drop of :data:`COST` x its limit, or
:data:`FLUSHED_PCT` of the values lost: *underflow*); a cosine drop (*precision*). A (module, role) is flagged when
any of its rows (any GEMM) is, and put down to the first of these causes; it is calm when every row's every signal
is below ``calm_fraction`` of its limit (the scale ratio within scale_gap^f below and 4^f above). Pure functions
over plain rows (no torch).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from fp8_recipes.observe.autopilot_config import AutopilotConfig, AutopilotLimits
from fp8_recipes.observe.doctor import SETTLE, SPIKE_RULES, WINDOW
from fp8_recipes.observe.doctor_findings import SCALE_RATIO_HIGH
from fp8_recipes.recipe.schema import ROLES

__all__ = ["CAUSES", "Reading", "calm_row", "culprit", "number", "read_rows", "relative_mse", "row_signals",
           "spiking"]

_ROLES = frozenset(str(r) for r in ROLES)

COST = 0.5
"""A stale delayed scale flags only where it costs something: underflow or a cosine drop at least this fraction of
their limits. A history that still holds the larger amaxes of the first steps wastes range without losing values
(measured on the CPU: tiny_moe under moe_delayed, a dense fc2's E5M2 gradients at 1/100 of the current scale for
40 steps with 0 % underflow and cosine 0.9986), which no action needs to fix. Underflow flags only with a cosine
drop of at least this fraction of its limit (cosine <= 0.995): E5M2 gradients lose their smallest values on healthy
runs at no cost (the gpt_125m 1000-step shoot-out, the H100, 2026-12-06: 2-3 % of the LM head's and an attention
qkv's gradients flushed from step ~260 on, cosine 0.9986-0.9995 throughout, loss gaps as without the autopilot),
where a real underflow shows in the cosine (the planted E4M3 gradients: 96-99.8 % flushed, cosine 0.53-0.83)."""
FLUSHED_PCT = 90.0
"""Underflow of this share of a tensor's values or more flags without a cosine drop: the values left carry the
tensor's norm and so its cosine. An outlier channel (one input channel of a linear at 2^24 x the others, the
weights' column at 2^-24: the same GEMM in BF16) flushes the others under a per-tensor scale: 99.8 % underflow with
cosine 0.9996 and the loss 5.7 % above BF16's (tests/integration/test_autopilot_cpu.py, 2026-12-06; +0.1 % with the
one action this rule allows). Healthy runs flush far less: at most 32 % (the LM head's E5M2 gradients in the
gpt_125m 1000-step shoot-out with the `fast` preset, cosine 0.9994, the H100, 2026-12-06); only the first step of
delayed scaling, before any history, flushes everything (cosine 0: flagged anyway, and the autopilot acts on
streaks)."""
CAUSES = ("clipping", "stale", "underflow", "precision")
"""What a flagged reading is put down to, in the order a reading's cause is chosen."""
NONFINITE_SEVERITY = 1e9
"""The severity of a non-finite value: above any finite signal's, and finite, so the state stays strict JSON."""


@dataclass(frozen=True)
class Reading:
    """One (module, role) at one statistics step, from its rows (every GEMM)."""

    flagged: bool
    calm: bool
    cause: str = ""
    """clipping | stale | underflow | precision (flagged only)."""
    evidence: str = ""
    """The worst signal beyond its limit, e.g. ``underflow 8.00% (fprop)``."""
    severity: float = 0.0
    """The worst signal / its limit (ratios: log scale), what orders the candidates."""
    mse: float | None = None
    """The step's worst MSE / amax^2 over the rows (None: no finite one), for the track's running median."""


def number(value: Any) -> float | None:
    """A row's number (JSON may carry "nan" / "inf" as strings), None when absent or not a number."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _delayed_ratio(row: Mapping[str, Any]) -> float | None:
    """A delayed operand's scale / the current scale (None for the other policies, which have no history)."""
    return number(row.get("scale_ratio")) if str(row.get("policy", "")).startswith("delayed") else None


def row_signals(row: Mapping[str, Any], limits: AutopilotLimits) -> list[tuple[str, float, str]]:
    """(cause, severity, evidence) of each signal of one row beyond its limit."""
    gemm, out = row.get("gemm", "?"), []
    values = {k: number(row.get(k)) for k in ("amax", "mse", "cosine", "scale", "underflow_pct", "saturation_pct")}
    if any(v is not None and not math.isfinite(v) for v in values.values()):
        out.append(("clipping", NONFINITE_SEVERITY, f"non-finite values ({gemm})"))
    sat, under, cos = values["saturation_pct"], values["underflow_pct"], values["cosine"]
    if sat is not None and sat >= limits.saturation_pct:
        out.append(("clipping", sat / limits.saturation_pct, f"saturation {sat:.2f}% ({gemm})"))
    ratio = _delayed_ratio(row)
    if ratio is not None and ratio >= SCALE_RATIO_HIGH:
        out.append(("clipping", math.log(ratio) / math.log(SCALE_RATIO_HIGH), f"delayed/current scale {ratio:.3g}x "
                                                                              f"({gemm}): clips"))
    drop = cos is not None and 1 - cos >= COST * limits.cosine_drop
    losing = (under is not None and under >= COST * limits.underflow_pct) or drop
    if ratio is not None and 0 < ratio <= 1 / limits.scale_gap and losing:
        out.append(("stale", math.log(1 / ratio) / math.log(limits.scale_gap), f"delayed/current scale {ratio:.2g}x "
                                                                              f"({gemm}): a stale history"))
    if under is not None and under >= limits.underflow_pct and (drop or cos is None or under >= FLUSHED_PCT):
        out.append(("underflow", under / limits.underflow_pct, f"underflow {under:.2f}% ({gemm}, cosine "
                                                               f"{'-' if cos is None else format(cos, '.4f')})"))
    if cos is not None and 1 - cos >= limits.cosine_drop:
        out.append(("precision", (1 - cos) / limits.cosine_drop, f"cosine {cos:.4f} ({gemm})"))
    return out


def calm_row(row: Mapping[str, Any], limits: AutopilotLimits, f: float) -> bool:
    """Every signal below `f` of its limit (the scale ratio within gap^f below and 4^f above)."""
    sat, under, cos = (number(row.get(k)) for k in ("saturation_pct", "underflow_pct", "cosine"))
    ratio = _delayed_ratio(row)
    return ((sat is None or sat < f * limits.saturation_pct) and (under is None or under < f * limits.underflow_pct)
            and (cos is None or 1 - cos < f * limits.cosine_drop)
            and (ratio is None or limits.scale_gap ** -f < ratio < SCALE_RATIO_HIGH ** f))


def relative_mse(row: Mapping[str, Any]) -> float | None:
    """A row's MSE / amax^2 (the doctor's measure of its error, comparable across scales), None when not finite."""
    mse, amax = number(row.get("mse")), number(row.get("amax"))
    if mse is None or amax is None or not (amax > 0 and math.isfinite(mse) and math.isfinite(amax)):
        return None
    return mse / amax ** 2


def read_rows(rows: Iterable[Mapping[str, Any]], config: AutopilotConfig,
              fresh: Callable[[str, str], bool] = lambda m, r: False,
              mse_median: Callable[[str, str], float | None] = lambda m, r: None
              ) -> dict[tuple[str, str], Reading]:
    """(module, role) -> its Reading at one statistics step. ``fresh(module, role)``: its delayed rows with scale 1
    are skipped (an empty history). ``mse_median(module, role)``: the median of its earlier steps' MSE / amax^2
    (None: too few yet); a step ``limits.mse_jump`` times above it is not calm and adds to a flagged step's severity
    (a supporting signal, as in the doctor: it never flags alone). NVFP4 rows and unknown roles are left out."""
    by_key: dict[tuple[str, str], list[Mapping[str, Any]]] = defaultdict(list)
    for row in rows:
        module, role, policy = str(row.get("module", "?")), str(row.get("role", "?")), str(row.get("policy", ""))
        if role not in _ROLES or policy.startswith("nvfp4"):
            continue
        if policy.startswith("delayed") and number(row.get("scale")) == 1.0 and fresh(module, role):
            continue
        by_key[(module, role)].append(row)
    out = {}
    for key, rs in by_key.items():
        signals = sorted((s for r in rs for s in row_signals(r, config.limits)), key=lambda s: CAUSES.index(s[0]))
        calm = all(calm_row(r, config.limits, config.calm_fraction) for r in rs)
        mse = max((m for r in rs if (m := relative_mse(r)) is not None), default=None)
        median, jump = mse_median(*key), 0.0
        if mse is not None and median and mse >= config.limits.mse_jump * median:
            jump = math.log(mse / median) / math.log(config.limits.mse_jump)
        if signals:
            cause = signals[0][0]
            worst = max((s for s in signals if s[0] == cause), key=lambda s: s[1])
            out[key] = Reading(True, False, cause, worst[2], max(jump, *(s[1] for s in signals)), mse)
        else:
            out[key] = Reading(False, calm and not jump, mse=mse)
    return out


def spiking(history: list[float], value: float | None, metric: str) -> bool:
    """The doctor's spike rule (doctor.SPIKE_RULES) against the running median of `history`; an accepted value
    joins it (the last WINDOW kept)."""
    if value is None:
        return False
    rel, z = SPIKE_RULES[metric]
    if len(history) >= SETTLE:
        med = statistics.median(history)
        sigma = 1.4826 * statistics.median(abs(h - med) for h in history)
        if not math.isfinite(value) or value > med + max(rel * abs(med), z * sigma):
            return True
    if math.isfinite(value):
        history.append(float(value))
        del history[:-WINDOW]
    return not math.isfinite(value)


def culprit(rows: list[Mapping[str, Any]], config: AutopilotConfig) -> tuple[str, str, str] | None:
    """(module, role, evidence) of the row with the worst non-finite or saturated values, None when none has."""
    worst = None
    for row in rows:
        role = str(row.get("role", "?"))
        if role not in _ROLES:
            continue
        for cause, severity, evidence in row_signals(row, config.limits):
            if cause == "clipping" and (worst is None or severity > worst[0]):
                worst = (severity, str(row.get("module", "?")), role, evidence)
    return None if worst is None else worst[1:]
