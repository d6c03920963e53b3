"""The doctor: read a finished (or failed) run, say what went wrong, name the layers and tensors behind it, and
propose a recipe change.

    from fp8_recipes.observe.doctor_report import format_report, load_run, patched_recipe
    run = load_run("runs/delayed-...")                      # metrics.jsonl, numerics.jsonl, recipe.yaml, summary.json
    d = diagnose(run, baseline=load_run("runs/bf16-..."))   # baseline: optional, a BF16 run of the same config
    print(format_report(d))                                  # verdict, evidence, layers and tensors, proposals
    patched = patched_recipe(d)                              # the recipe dict with the proposals applied (validated)

``fp8-recipes doctor RUN_DIR [--baseline DIR] [--write PATH]`` wraps this; its exit code is 0 when the run is
healthy, 1 when a problem was found, 2 on a user error (no such run directory, no metrics.jsonl, ...).

Verdicts (one per run, the first that applies):

``diverged_from_start``  the loss ends no lower than it started, or a loss excursion lasts to the end of the run
                         (or a non-finite loss / a loss above 1.5x the first one appears in the first steps), and
                         the run had not learnt anything before (its loss never fell below 0.9x the first one)
``mid_run_divergence``   the same, after the loss had come down
``spikes``               loss or grad-norm spikes: a value above the running median of the previous
                         :data:`WINDOW` accepted steps by more than ``max(REL x median, Z x robust sigma)``; with a
                         baseline only spikes larger (x1.25) or longer than the baseline's largest count
``healthy``              none of the above

A problem is "not an FP8 problem" (and no FP8 change is proposed) when the recipe has no FP8 role, when no FP8
was active at its first step (stage ``bf16 ...`` in metrics.jsonl), or when the baseline diverged too or was
trained with a peak LR at least 1.5x lower. A divergence from the start without a baseline gets a BF16 warmup
only: when everything explodes, every layer's numbers look bad and none of them is the cause.

Findings come from numerics.jsonl (``debug.interval > 0``, :mod:`~fp8_recipes.observe.doctor_findings`); each
names a module and role and the worst value with its step. Pure functions over plain rows (no torch).
"""

from __future__ import annotations

import math
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp8_recipes.observe.doctor_findings import SCALE_RATIO_HIGH, SUPPORTING, Finding, find_problems, module_scores
from fp8_recipes.schema import ROLES

__all__ = ["Diagnosis", "DoctorInputError", "Proposal", "RunData", "Spike", "detect_spikes", "diagnose"]

WINDOW = 10
"""Steps of the running median a value is compared with (spike steps never enter it)."""
SETTLE = 5
"""Steps before spike detection starts (the median needs a few values; early steps have their own rule)."""
SPIKE_RULES = {"loss": (0.10, 5.0), "grad_norm": (1.0, 5.0)}
"""metric -> (REL, Z): a spike exceeds the median by more than REL x median and Z robust sigmas (1.4826 MAD)."""
BASELINE_MARGIN = 1.25
"""With a baseline, a spike counts when it is this much larger than the baseline's largest (or longer)."""


class DoctorInputError(ValueError):
    """A run directory the doctor cannot read; ``str()`` is one line ``<key>: <problem> (<fix>)``."""


@dataclass(frozen=True)
class RunData:
    path: Path
    train: list[dict[str, Any]]
    """metrics.jsonl rows of kind "train", in step order."""
    numerics: list[dict[str, Any]]
    """numerics.jsonl rows (empty when the run recorded no statistics)."""
    recipe: dict[str, Any]
    """recipe.yaml: the resolved recipe the run trained with."""
    summary: dict[str, Any]


@dataclass(frozen=True)
class Spike:
    metric: str
    start: int
    """First step (as metrics.jsonl counts) of the excursion."""
    length: int
    size: float
    """Largest value / the running median before the excursion (inf: a non-finite value)."""
    terminal: bool
    """The excursion lasts to the last step of the run."""


@dataclass(frozen=True)
class Proposal:
    changes: dict[str, Any]
    """Dotted recipe keys -> new value (None: remove the key)."""
    reason: str
    alternative: bool = False
    """An alternative to a proposal above: printed, not applied by --write."""


@dataclass
class Diagnosis:
    run: RunData
    verdict: str
    summary: str
    spikes: list[Spike] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    proposals: list[Proposal] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    baseline: RunData | None = None

    @property
    def healthy(self) -> bool:
        return self.verdict == "healthy"


# ---------------------------------------------------------------------------------------------------------------
# Reading metrics


def _value(row: dict[str, Any], key: str) -> float | None:
    """A metric as a float: "nan"/"inf" strings (how metrics.jsonl keeps them) included; None when absent."""
    v = row.get(key)
    if isinstance(v, (int, float, str)) and not isinstance(v, bool):
        try:
            return float(v)
        except ValueError:
            return None
    return None


def _series(run: RunData, key: str) -> list[tuple[int, float]]:
    out = []
    for r in run.train:
        v = _value(r, key)
        if r.get("skipped") and key == "loss" and v is not None and math.isfinite(v):
            v = math.nan  # a skipped step had a non-finite loss or gradients somewhere
        if v is not None:
            out.append((int(r["step"]), v))
    return out


# ---------------------------------------------------------------------------------------------------------------
# Spikes and divergence


def detect_spikes(series: list[tuple[int, float]], metric: str) -> list[Spike]:
    """Excursions above the running median (robust: spike steps never enter it); see the module docstring."""
    rel, z = SPIKE_RULES[metric]
    history: list[float] = []
    spikes: list[Spike] = []
    current: dict[str, Any] | None = None
    for step, v in series:
        if len(history) < SETTLE:
            if math.isfinite(v):
                history.append(v)
            continue
        recent = history[-WINDOW:]
        med = statistics.median(recent)
        sigma = 1.4826 * statistics.median(abs(h - med) for h in recent)
        if not math.isfinite(v) or v > med + max(rel * abs(med), z * sigma):
            size = math.inf if not math.isfinite(v) or med <= 0 else v / med
            if current is None:
                current = {"start": step, "length": 0, "size": 0.0}
            current["length"] += 1
            current["size"] = max(current["size"], size)
            continue
        if current is not None:
            spikes.append(Spike(metric, current["start"], current["length"], current["size"], False))
            current = None
        history.append(v)
    if current is not None:
        spikes.append(Spike(metric, current["start"], current["length"], current["size"], True))
    return spikes


def _divergence(losses: list[tuple[int, float]], spikes: list[Spike]) -> tuple[str, int] | None:
    """("diverged_from_start" | "mid_run_divergence", onset step), or None when the loss did not diverge."""
    first = losses[0][1]
    tail = [v for _, v in losses[-min(5, len(losses)):]]
    end = statistics.median(tail) if all(math.isfinite(v) for v in tail) else math.inf
    terminal = [s for s in spikes if s.metric == "loss" and s.terminal and s.length >= 3]
    early = next((s for s, v in losses[:SETTLE + 1] if not math.isfinite(v) or v > 1.5 * first), None)
    if not (end >= first or terminal or early is not None):
        return None
    if early is None and not terminal:  # no net learning: from the first step that is no better than the first
        early = next((s for s, v in losses[1:] if not math.isfinite(v) or v >= first), losses[-1][0])
    onset = early if early is not None else terminal[0].start
    before = [v for s, v in losses if s < onset and math.isfinite(v)]
    learnt = bool(before) and min(before) < 0.9 * first
    return ("mid_run_divergence" if learnt else "diverged_from_start"), onset


def _stage_at(run: RunData, step: int) -> str:
    return next((str(r.get("stage", "")) for r in run.train if r.get("step") == step), "")


def _peak_lr(run: RunData) -> float | None:
    lrs = [v for r in run.train if (v := _value(r, "lr")) is not None]
    return max(lrs) if lrs else None


# ---------------------------------------------------------------------------------------------------------------
# Proposals


def _module_layer(name: str) -> int | None:
    m = re.search(r"layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def _layer_proposals(findings: list[Finding], recipe: dict[str, Any], numerics: list[dict[str, Any]]) -> list[Proposal]:
    """BF16 for the modules behind most of the trouble: bf16_first/bf16_last when half of the first/last layer's
    linears are flagged, else the modules by name (bf16_modules globs match the names exactly)."""
    primary = {f.module for f in findings if f.kind not in SUPPORTING}
    score = {m: v for m, v in module_scores(findings).items() if m in primary}
    if not score:
        return []
    top = max(score.values())
    named = [m for m, s in sorted(score.items(), key=lambda t: -t[1]) if s >= 0.5 * top][:3]
    layers = {_module_layer(str(r.get("module", ""))) for r in numerics} - {None}
    per_layer = defaultdict(set)
    for r in numerics:
        per_layer[_module_layer(str(r.get("module", "")))].add(r.get("module"))
    rules = recipe.get("layers") or {}
    out, left = [], list(named)
    for key, layer in (("bf16_first", min(layers, default=None)), ("bf16_last", max(layers, default=None))):
        hit = [m for m in named if _module_layer(m) == layer]
        if layer is not None and len(layers) > 2 and len(hit) * 2 >= len(per_layer[layer]) and hit:
            out.append(Proposal({f"layers.{key}": max(int(rules.get(key) or 0), 1)},
                                f"{len(hit)} of layer {layer}'s {len(per_layer[layer])} linears show the problem"))
            left = [m for m in left if m not in hit]
    if left:
        mods = list(rules.get("bf16_modules") or [])
        out.append(Proposal({"layers.bf16_modules": mods + [m for m in left if m not in mods]},
                            "BF16 for the module(s) behind it: " + "; ".join(
                                f"{m} (score {score[m]:.1f})" for m in left)))
    return out


def _role_proposals(findings: list[Finding], recipe: dict[str, Any]) -> list[Proposal]:
    out = []
    for role in map(str, ROLES):
        policy = recipe.get(role) or {}
        mine = [f for f in findings if f.role == role and f.kind not in SUPPORTING]
        if not mine or not isinstance(policy, dict):
            continue
        worst = max(mine, key=lambda f: f.severity)
        where = f"{worst.module} {worst.gemm}: {worst.text}"
        if policy.get("scaling") == "delayed":
            out.append(Proposal({f"{role}.scaling": "tensorwise", f"{role}.amax_history_len": None,
                                 f"{role}.amax_compute_algo": None, f"{role}.percentile": None},
                                f"delayed -> tensorwise: the scale then comes from each step's own amax, so one "
                                f"outlier cannot skew later steps ({where})"))
            hist = int(policy.get("amax_history_len") or 1024)
            if hist > 1:
                out.append(Proposal({f"{role}.amax_history_len": max(1, hist // 2)},
                                    f"or keep delayed with a 50% shorter amax history: an outlier leaves it "
                                    f"{hist - hist // 2} steps sooner", alternative=True))
            if any(f.kind in ("saturation_pct",) or (f.kind == "scale_gap" and f.value >= SCALE_RATIO_HIGH)
                   for f in mine):
                out.append(Proposal({f"{role}.margin": int(policy.get("margin") or 0) + 1},
                                    "or a margin of one more power of two against the amax growing between steps",
                                    alternative=True))
        elif any(f.kind == "saturation_pct" for f in mine) and policy.get("scaling") in ("tensorwise", "blockwise"):
            out.append(Proposal({f"{role}.margin": int(policy.get("margin") or 0) + 1},
                                f"margin +1: headroom against values beyond the amax the scale came from ({where})"))
    return out


def _warmup_proposal(recipe: dict[str, Any], onset: int, total: int) -> Proposal:
    sched = recipe.get("schedule") or {}
    steps = max(int(sched.get("bf16_warmup_steps") or 0), 10 * math.ceil(2 * onset / 10), min(100, total // 10))
    return Proposal({"schedule.bf16_warmup_steps": steps},
                    f"BF16 warmup for the first {steps} steps: the trouble starts at step {onset}, before the "
                    f"weights and activations have settled")


# ---------------------------------------------------------------------------------------------------------------
# The diagnosis


def _has_fp8(recipe: dict[str, Any]) -> bool:
    """Whether the recipe quantizes any role (an unknown recipe counts as FP8: nothing is ruled out)."""
    roles = [recipe.get(str(r)) for r in ROLES]
    return not recipe or any(isinstance(p, dict) and p.get("scaling", "none") != "none" for p in roles)


def _not_fp8_reason(run: RunData, baseline: RunData | None, onset: int, base_verdict: str | None) -> str | None:
    if not _has_fp8(run.recipe):
        return "the recipe has no FP8 role"
    stage = _stage_at(run, onset)
    if stage and not stage.startswith("fp8"):
        return f"no FP8 was active at step {onset} (stage '{stage}')"
    if baseline is not None and base_verdict in ("diverged_from_start", "mid_run_divergence"):
        return f"the baseline diverges too ({base_verdict})"
    lr, base_lr = _peak_lr(run), _peak_lr(baseline) if baseline is not None else None
    if lr and base_lr and lr >= 1.5 * base_lr:
        return f"its peak LR {lr:.3g} is {lr / base_lr:.3g}x the baseline's {base_lr:.3g}"
    return None


def _spikes_over_baseline(spikes: list[Spike], base: list[Spike]) -> list[Spike]:
    out = []
    for s in spikes:
        mine = [b for b in base if b.metric == s.metric]
        size = max((b.size for b in mine), default=0.0)
        length = max((b.length for b in mine), default=0)
        if s.size > BASELINE_MARGIN * size or s.length > length:
            out.append(s)
    return out


def _all_spikes(run: RunData) -> list[Spike]:
    return [s for m in SPIKE_RULES for s in detect_spikes(_series(run, m), m)]


def _verdict(run: RunData) -> tuple[str, int | None, list[Spike]]:
    spikes = _all_spikes(run)
    div = _divergence(_series(run, "loss"), spikes)
    if div is not None:
        return div[0], div[1], spikes
    return ("spikes" if spikes else "healthy"), (spikes[0].start if spikes else None), spikes


def diagnose(run: RunData, baseline: RunData | None = None) -> Diagnosis:
    """Classify the run, list what numerics.jsonl says about its layers and tensors, and propose changes."""
    verdict, onset, spikes = _verdict(run)
    base_verdict, base_spikes = (_verdict(baseline)[0], _all_spikes(baseline)) if baseline else (None, [])
    if verdict == "spikes" and baseline is not None:
        spikes = _spikes_over_baseline(spikes, base_spikes)
        if not spikes:
            verdict, onset = "healthy", None
    d = Diagnosis(run, verdict, "", spikes=spikes, baseline=baseline)
    d.findings = find_problems(run.numerics)
    if not run.numerics and _has_fp8(run.recipe):
        d.notes.append("no numerics.jsonl: rerun with ++debug.interval=10 to name the layers and tensors")
    if verdict == "healthy":
        d.summary = "the loss came down without divergence or spikes" + (
            " beyond the baseline's" if baseline else "")
        return d
    onset = onset or 1
    d.summary = _summary(verdict, onset, spikes, base_spikes if baseline else None)
    d.notes += _run_notes(run)
    reason = _not_fp8_reason(run, baseline, onset, base_verdict)
    if reason is not None:
        d.summary += f"; not an FP8 problem: {reason}"
        d.notes.append("check the LR (trainer.lr, trainer.warmup_steps), the data and the config before the recipe")
        return d
    blind = baseline is None and verdict == "diverged_from_start"  # everything explodes: findings are consequences
    if not blind:
        d.proposals = _role_proposals(d.findings, run.recipe) + _layer_proposals(d.findings, run.recipe,
                                                                                  run.numerics)
    total = int(run.train[-1].get("step", len(run.train)))
    if (blind or onset <= max(SETTLE, total // 10)) and run.recipe:
        d.proposals.append(_warmup_proposal(run.recipe, onset, total))
    if not d.proposals:
        why = "the FP8 numerics show nothing beyond the limits" if run.numerics else "no numerics.jsonl"
        d.notes.append(f"no recipe change proposed: {why}; look at the data and the LR around step {onset}")
    if blind:
        d.notes.append("FP8 is not ruled out, nor blamed: only a BF16 warmup is proposed. A BF16 run of the same "
                       "config (no +recipe) tells FP8 from the LR: pass it as --baseline")
    return d


def _run_notes(run: RunData) -> list[str]:
    """What summary.json adds: an early stop, BF16 fallbacks, skipped steps."""
    s, out = run.summary, []
    if s.get("stopped"):
        out.append(f"the run stopped: {s['stopped']}")
    if s.get("skipped_steps"):
        out.append(f"{s['skipped_steps']} step(s) skipped on non-finite values, {s.get('bf16_fallbacks', 0)} BF16 "
                   f"fallback(s)")
    return out


def _summary(verdict: str, onset: int, spikes: list[Spike], base: list[Spike] | None) -> str:
    words = {"diverged_from_start": f"diverged from the start (step {onset})",
             "mid_run_divergence": f"diverged mid-run at step {onset}"}
    text = words.get(verdict, f"{len(spikes)} spike(s), the first at step {onset}")
    if base is not None:
        sizes = {m: max((b.size for b in base if b.metric == m), default=0.0) for m in SPIKE_RULES}
        text += "; the baseline has no spikes" if not base else "; baseline's largest spike: " + ", ".join(
            f"{m} {v:.3g}x" for m, v in sizes.items() if v)
    return text
