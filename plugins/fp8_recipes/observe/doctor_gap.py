"""The loss gap between a run and its baseline: the most common FP8 failure is not a blow-up but a run that trains
steadily worse than BF16.

    gap = loss_gap(run_losses, base_losses, run_evals, base_evals)   # [(step, loss)], [(step, val_loss)]
    gap = loss_gap(..., seeds=[losses, ...])                        # BF16 runs of other seeds: the seed noise
    gap.worse, gap.measures, gap.opens, gap.floor.how

Three measures, each the run's loss over the baseline's minus 1 at the same steps: **final** (the mean over the
last :data:`FINAL_STEPS` steps both runs have), **smoothed** (the median of the per-step gaps over the last
:data:`TAIL` of them: one spike, which the spike rules judge, does not move it) and **eval** (the last validation
both runs have; the same held-out batches in both). The run is worse when the smoothed gap and at least one other
measure reach their threshold. A threshold is the larger of

- the **noise floor** (:class:`NoiseFloor`), measured on the baseline(s) for the tail's level (the smoothed
  loss, what the verdict stands on) and the same for every measure, never a fixed percentage:

  - with one baseline, the *step floor*: :data:`STEP_Z` standard errors of the baseline's own tail level, its
    robust step-to-step spread around its running median over the square root of the tail's steps. It measures
    batch noise only: how far a BF16 run of another seed lands (init and data order) one run cannot show;
  - with BF16 runs of other seeds (``seeds``), the *seed floor* instead: :data:`SEED_Z` standard deviations of the
    baselines' tail levels (the run's baseline included, over the same steps). The spread between seeds measures
    the seed noise directly, each level's batch noise included.

  Both overstate the noise of a same-seed pair early in a run (it shares the init and the batches) and approach it
  as the trajectories part; the numbers are in docs/doctor.md, "How large a gap counts";

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
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["FINAL_STEPS", "GAP_Z", "SEED_Z", "STEP_Z", "TAIL", "GapMeasure", "LossGap", "NoiseFloor", "loss_gap"]

Series = Sequence[tuple[int, float]]

STEP_Z = 2.0
"""Standard errors of the baseline's own tail level (its step-to-step spread over the square root of the tail's
steps) inside which a gap is noise: the step floor, one baseline."""
SEED_Z = 2.0
"""Standard deviations of the baselines' tail levels across seeds inside which a gap is noise: the seed floor."""
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
class NoiseFloor:
    """The gap inside noise, and how it was measured (see the module docstring)."""
    value: float
    """The relative gap below which every measure is noise."""
    step_noise: float
    """The baseline's robust step-to-step spread around its running median (relative), over the tail."""
    steps: int
    """The tail steps the level is taken over."""
    seed_noise: float | None = None
    """With other seeds: the standard deviation of the baselines' tail levels, relative to their mean."""
    baselines: int = 1
    """Baselines measured: 1 = the step floor; 2+ = the seed floor."""

    @property
    def how(self) -> str:
        """One line for the report: the floor and what it was measured from."""
        if self.seed_noise is None:
            return (f"floor {self.value:.2%}: {STEP_Z:g} standard errors of the baseline's own level over the last "
                    f"{self.steps} steps (its step-to-step spread {self.step_noise:.2%} / sqrt({self.steps})); one "
                    f"baseline, so seed-to-seed noise is not measured")
        return (f"floor {self.value:.2%}: {SEED_Z:g} x the standard deviation of {self.baselines} baselines' levels "
                f"across seeds ({self.seed_noise:.2%}; each its median loss over the last {self.steps} steps)")


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
    floor: NoiseFloor | None = None
    """The noise floor the thresholds start from."""

    def measure(self, name: str) -> GapMeasure | None:
        return next((m for m in self.measures if m.name == name), None)

    @property
    def worse(self) -> bool:
        smoothed = self.measure("smoothed")
        return bool(smoothed and smoothed.over and sum(m.over for m in self.measures) >= 2)

    @property
    def within_noise(self) -> bool:
        """Above the baseline, but not beyond the noise: not worse."""
        smoothed = self.measure("smoothed")
        return bool(smoothed and smoothed.gap > 0 and not self.worse)


def _finite(series: Series, positive: bool = False) -> dict[int, float]:
    return {s: v for s, v in series if math.isfinite(v) and (v > 0 or not positive)}


def loss_gap(run: Series, base: Series, run_evals: Series = (), base_evals: Series = (),
             seeds: Sequence[Series] = ()) -> LossGap | None:
    """The gap over the steps both runs have; None when they share fewer than 2 x FINAL_STEPS finite steps.
    `seeds`: the losses of BF16 runs of the same config with other seeds; each must have the common steps
    (:func:`missing_steps`)."""
    mine, theirs = _finite(run), _finite(base, positive=True)
    common = sorted(set(mine) & set(theirs))
    if len(common) < 2 * FINAL_STEPS:
        return None
    rel = [mine[s] / theirs[s] - 1 for s in common]
    n_tail = max(2 * FINAL_STEPS, round(TAIL * len(common)))
    tail = rel[-n_tail:]
    med = statistics.median(tail)
    noise = 1.4826 * statistics.median(abs(d - med) for d in tail)
    ev_mine, ev_theirs = _finite(run_evals), _finite(base_evals, positive=True)
    ev_common = sorted(set(ev_mine) & set(ev_theirs))
    paired = _correlation(_residuals([mine[s] for s in common]), _residuals([theirs[s] for s in common])) >= PAIRED
    ev_step = ev_common[-1] if ev_common and paired else None  # the same held-out batches: no batch noise
    floor = noise_floor([base, *seeds], common[-n_tail:])

    def measure(name: str, steps: list[int], average=statistics.fmean) -> GapMeasure:
        threshold = max(floor.value, GAP_Z * noise / math.sqrt(len(steps)))
        run_loss, base_loss = average([mine[s] for s in steps]), average([theirs[s] for s in steps])
        gap = statistics.median(rel[-len(steps):]) if average is statistics.median else run_loss / base_loss - 1
        return GapMeasure(name, f"{steps[0]}-{steps[-1]}", run_loss, base_loss, threshold, gap)

    measures = [measure("final", common[-FINAL_STEPS:]), measure("smoothed", common[-n_tail:], statistics.median)]
    if ev_step is not None:
        s = ev_step
        measures.append(GapMeasure("eval", str(s), ev_mine[s], ev_theirs[s], floor.value,
                                   ev_mine[s] / ev_theirs[s] - 1))
    half = measures[1].threshold / 2
    ema, opens = 0.0, common[0]
    for s, d in zip(common, rel):
        ema = d if s == common[0] else EMA * d + (1 - EMA) * ema
        if ema < half:
            opens = s + 1
    return LossGap(measures, noise, min(opens, common[-1]), len(common), paired, floor)


def noise_floor(baselines: Sequence[Series], tail: list[int]) -> NoiseFloor:
    """The floor from the baselines' losses (the run's own baseline first) over the tail steps: the step floor from
    the first one's step-to-step spread; with two or more, the seed floor, their levels' spread, instead (it holds
    each level's step noise too)."""
    losses = _finite(baselines[0], positive=True)
    steps = sorted(losses)
    wiggle = dict(zip(steps, _relative_residuals([losses[s] for s in steps])))
    spread = _robust_sd([wiggle[s] for s in tail])
    if len(baselines) < 2:
        return NoiseFloor(STEP_Z * spread / math.sqrt(len(tail)), spread, len(tail))
    levels = [statistics.median(_finite(b, positive=True)[s] for s in tail) for b in baselines]
    sd = statistics.stdev(levels) / statistics.fmean(levels)
    return NoiseFloor(SEED_Z * sd, spread, len(tail), sd, len(baselines))


def missing_steps(seed: Series, run: Series, base: Series) -> int:
    """How many of the steps the run and its baseline share (finite) a baseline of another seed lacks."""
    common = set(_finite(run)) & set(_finite(base, positive=True))
    return len(common - set(_finite(seed, positive=True)))


def _robust_sd(values: list[float]) -> float:
    med = statistics.median(values)
    return 1.4826 * statistics.median(abs(v - med) for v in values)


def _relative_residuals(values: list[float], half: int = 5) -> list[float]:
    """Each value over the median of its neighbourhood, minus 1: the relative step-to-step wiggle."""
    out = []
    for i, v in enumerate(values):
        m = statistics.median(values[max(0, i - half):i + half + 1])
        out.append(v / m - 1 if m > 0 else 0.0)
    return out


def _residuals(values: list[float], half: int = 5) -> list[float]:
    """Each value minus the median of its neighbourhood: the batch-to-batch wiggle without the trend."""
    return [v - statistics.median(values[max(0, i - half):i + half + 1]) for i, v in enumerate(values)]


def _correlation(a: list[float], b: list[float]) -> float:
    try:
        return statistics.correlation(a, b)
    except statistics.StatisticsError:  # a constant series: identical runs (or too few steps) say nothing else
        return 1.0
