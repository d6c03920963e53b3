"""The loss gap between a run and its baseline: the most common FP8 failure is not a blow-up but a run that trains
steadily worse than BF16.

    gap = loss_gap(run_losses, base_losses, run_evals, base_evals)   # [(step, loss)], [(step, val_loss)]
    gap.worse, gap.measures, gap.opens

Three measures, each the run's loss over the baseline's minus 1 at the same steps: **final** (the mean over the
last :data:`FINAL_STEPS` steps both runs have), **smoothed** (the median of the per-step gaps over the last
:data:`TAIL` of them: one spike, which the spike rules judge, does not move it) and **eval** (the last validation
both runs have; the same held-out batches in both). The run is worse when the smoothed gap and at
least one other measure reach their threshold. A threshold is the larger of

- :data:`GAP_FLOOR`, the run-to-run noise measured on the CPU setups of docs/doctor.md (healthy FP8 recipes and
  BF16 with another seed end within it of BF16), and
- :data:`GAP_Z` x the noise this pair of runs shows: the robust spread of the per-step relative difference over
  the tail, over the square root of the steps averaged. Runs of the same config and seed see the same batches,
  so the batches' own difficulty cancels and this stays small; a baseline with other data (another seed, batch
  size) leaves it in, and the threshold grows with it.

The comparison assumes the baseline saw the same batches (same config and seed): then the runs' step-to-step
wiggles match (correlation >= :data:`PAIRED` of each loss's residual from its own running median; measured 0.998
and more for FP8 against BF16, 0.5 for another seed). A baseline that did not is compared all the same, with the
wider threshold its noise gives, and without the eval measure (its validation batches differ too).

Pure functions over (step, value) lists (no torch).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

__all__ = ["FINAL_STEPS", "GAP_FLOOR", "GAP_Z", "TAIL", "GapMeasure", "LossGap", "loss_gap"]

GAP_FLOOR = 0.02
"""A relative gap smaller than this is run-to-run noise (measured: docs/doctor.md, "How large a gap counts")."""
GAP_Z = 3.0
"""Standard errors of the paired per-step difference a gap must also exceed."""
FINAL_STEPS = 5
"""Steps the final loss is averaged over."""
TAIL = 0.25
"""Fraction of the common steps (at least 2 x FINAL_STEPS) the smoothed loss is averaged over."""
PAIRED = 0.9
"""Correlation of the per-step residuals above which the two runs saw the same batches."""
EMA = 0.2
"""Weight of a step in the moving average that dates the gap's opening."""


@dataclass(frozen=True)
class GapMeasure:
    name: str
    """final | smoothed | eval."""
    steps: str
    """The steps compared, e.g. "51-60" or "60"."""
    run: float
    baseline: float
    threshold: float
    """The relative gap that counts (see the module docstring)."""
    gap: float
    """The run's loss over the baseline's, minus 1."""

    @property
    def over(self) -> bool:
        return self.gap >= self.threshold


@dataclass(frozen=True)
class LossGap:
    measures: list[GapMeasure]
    noise: float
    """Robust spread (1.4826 MAD) of the per-step relative difference over the tail."""
    opens: int
    """The step from which the moving average of the per-step gap stays above half the smoothed threshold."""
    steps: int
    """Steps both runs have."""
    paired: bool = True
    """The two runs saw the same batches (see the module docstring)."""

    def measure(self, name: str) -> GapMeasure | None:
        return next((m for m in self.measures if m.name == name), None)

    @property
    def worse(self) -> bool:
        smoothed = self.measure("smoothed")
        return bool(smoothed and smoothed.over and sum(m.over for m in self.measures) >= 2)


def loss_gap(run: list[tuple[int, float]], base: list[tuple[int, float]], run_evals: list[tuple[int, float]] = (),
             base_evals: list[tuple[int, float]] = ()) -> LossGap | None:
    """The gap over the steps both runs have; None when they share fewer than 2 x FINAL_STEPS finite steps."""
    mine = {s: v for s, v in run if math.isfinite(v)}
    theirs = {s: v for s, v in base if math.isfinite(v) and v > 0}
    common = sorted(set(mine) & set(theirs))
    if len(common) < 2 * FINAL_STEPS:
        return None
    rel = [mine[s] / theirs[s] - 1 for s in common]
    n_tail = max(2 * FINAL_STEPS, round(TAIL * len(common)))
    tail = rel[-n_tail:]
    med = statistics.median(tail)
    noise = 1.4826 * statistics.median(abs(d - med) for d in tail)

    def measure(name: str, steps: list[int], average=statistics.fmean) -> GapMeasure:
        threshold = max(GAP_FLOOR, GAP_Z * noise / math.sqrt(len(steps)))
        run_loss, base_loss = average([mine[s] for s in steps]), average([theirs[s] for s in steps])
        gap = statistics.median(rel[-len(steps):]) if average is statistics.median else run_loss / base_loss - 1
        return GapMeasure(name, f"{steps[0]}-{steps[-1]}", run_loss, base_loss, threshold, gap)

    measures = [measure("final", common[-FINAL_STEPS:]),
                measure("smoothed", common[-n_tail:], statistics.median)]
    paired = _correlation(_residuals([mine[s] for s in common]), _residuals([theirs[s] for s in common])) >= PAIRED
    ev_mine = {s: v for s, v in run_evals if math.isfinite(v)}
    ev_theirs = {s: v for s, v in base_evals if math.isfinite(v) and v > 0}
    ev_common = sorted(set(ev_mine) & set(ev_theirs))
    if ev_common and paired:  # the same held-out batches in both runs: no batch noise to allow for
        s = ev_common[-1]
        measures.append(GapMeasure("eval", str(s), ev_mine[s], ev_theirs[s], GAP_FLOOR, ev_mine[s] / ev_theirs[s] - 1))
    half = measures[1].threshold / 2
    ema, opens = 0.0, common[0]
    for s, d in zip(common, rel):
        ema = d if s == common[0] else EMA * d + (1 - EMA) * ema
        if ema < half:
            opens = s + 1
    return LossGap(measures, noise, min(opens, common[-1]), len(common), paired)


def _residuals(values: list[float], half: int = 5) -> list[float]:
    """Each value minus the median of its neighbourhood: the batch-to-batch wiggle without the trend."""
    return [v - statistics.median(values[max(0, i - half):i + half + 1]) for i, v in enumerate(values)]


def _correlation(a: list[float], b: list[float]) -> float:
    try:
        return statistics.correlation(a, b)
    except statistics.StatisticsError:  # a constant series: identical runs (or too few steps) say nothing else
        return 1.0
