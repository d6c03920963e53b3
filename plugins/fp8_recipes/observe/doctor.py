"""The doctor: read a finished (or failed) run, say what went wrong, name the layers and tensors behind it, and
propose a recipe change.

    from fp8_recipes.observe.doctor_report import format_report, load_run, patched_recipe
    run = load_run("runs/delayed-...")                      # metrics.jsonl, numerics.jsonl, recipe.yaml, summary.json
    d = diagnose(run, baseline=load_run("runs/bf16-..."))   # baseline: optional, a BF16 run of the same config
    print(format_report(d))                                  # verdict, evidence, layers and tensors, proposals
    patched = patched_recipe(d)                              # the recipe dict with the proposals applied (validated)

``fp8-recipes doctor RUN_DIR [--baseline DIR ...] [--write PATH]`` wraps this (more baselines: BF16 runs of other
seeds, ``diagnose(run, baseline, seeds=[...])``, whose spread is the noise floor of the gap); its exit code is 0
when the run is healthy, 1 when a problem was found, 2 on a user error (no such run directory, no metrics.jsonl,
...).

Verdicts (one per run, the first that applies):

``diverged_from_start``  the loss ends no lower than it started, or a loss excursion lasts to the end of the run
                         (or a non-finite loss / a loss above 1.5x the first one appears in the first steps), and
                         the run had not learnt anything before (its loss never fell below 0.9x the first one)
``mid_run_divergence``   the same, after the loss had come down
``worse_than_baseline``  with a baseline: the loss gap (final, smoothed, eval) is beyond the noise floor measured
                         on the baseline(s) (:mod:`~fp8_recipes.observe.doctor_gap`); a gap inside it is healthy,
                         "within noise"
``spikes``               loss or grad-norm spikes: a value above the running median of the previous
                         :data:`WINDOW` accepted steps by more than ``max(REL x median, Z x robust sigma)``; with a
                         baseline, only those the baseline does not share at the same steps (:func:`_match_baseline`)
``stale_expert_scales``  none of the above, but an MoE expert's delayed scale stays far from its current one and its
                         routing rows say why (a routing shift, or a starved expert:
                         :mod:`~fp8_recipes.observe.doctor_experts`): the loss may not show it yet (the expert's
                         output is weighted by its routing probability), its FP8 values are lost all the same
``healthy``              none of the above; also spikes in a run without FP8 (its own, noted)

The onset is the earliest anomaly kept after the baseline filter (a kept spike, the divergence, the gap's
opening); the stage check, the warmup rule and the cause window all use it. A problem is "not an FP8 problem" (and
no FP8 change is proposed) when the recipe has no FP8 role, when no FP8 was active at the onset (stage
``bf16 ...`` in metrics.jsonl), or when the baseline diverged too or was trained with a peak LR at least 1.5x
lower. A divergence in the first steps without a baseline gets a BF16 warmup only, and a request for a baseline:
when everything explodes, every layer's numbers look bad and none of them is the cause. After any divergence, the
proposals come from the statistics up to the onset.

Findings come from numerics.jsonl (``debug.interval > 0``, :mod:`~fp8_recipes.observe.doctor_findings`); each
names a module and role and the worst value with its step; :mod:`~fp8_recipes.observe.doctor_remedies` turns
them into changes that fit their extent. A one-step underflow recorded at a spike is left out of the proposals
(:func:`_spike_consequences`): the spike's large values set that step's scale, and lost small values raise neither
the loss nor the gradient norm. Pure functions over plain rows (no torch).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp8_recipes.observe.doctor_autopilot import applied_actions, rows_after_actions
from fp8_recipes.observe.doctor_experts import ExpertCause, expert_causes, expert_of, expert_proposals
from fp8_recipes.observe.doctor_findings import Finding, find_problems
from fp8_recipes.observe.doctor_gap import LossGap, loss_gap, missing_steps
from fp8_recipes.observe.doctor_remedies import LASTING, Proposal, propose, warmup_proposal
from fp8_recipes.recipe.schema import Recipe

__all__ = ["Diagnosis", "DoctorInputError", "LossGap", "Proposal", "RunData", "Spike", "detect_spikes", "diagnose"]

WINDOW = 10
"""Steps of the running median a value is compared with (spike steps never enter it)."""
SETTLE = 5
"""Steps before spike detection starts (the median needs a few values; early steps have their own rule)."""
SPIKE_RULES = {"loss": (0.25, 5.0), "grad_norm": (4.0, 5.0)}
"""metric -> (REL, Z): a spike exceeds the median by more than REL x median and Z robust sigmas (1.4826 MAD).
Set above what healthy runs do (measured on the CPU setups, docs/doctor.md): BF16 and FP8 runs blip to 1.2x their
running loss median at 4 x 128 tokens a step, and to 3.4x their grad-norm median; so a spike is above 1.25x and 5x."""
MATCH_STEPS = 1
"""A baseline excursion up to this many steps before or after a spike is the same event."""
MATCH_MARGIN = 2.0
"""A spike the baseline shares still counts when its excess over the running median is more than this many
times the baseline's at the same steps (FP8 amplified it)."""


class DoctorInputError(ValueError):
    """A run directory the doctor cannot read; ``str()`` is one line ``<key>: <problem> (<fix>)``."""


@dataclass(frozen=True)
class RunData:
    path: Path
    train: list[dict[str, Any]]
    """metrics.jsonl rows of kind "train", in step order."""
    numerics: list[dict[str, Any]]
    """numerics.jsonl rows (empty when the run recorded no statistics)."""
    recipe: Recipe | None
    """recipe.yaml read through the schema: the resolved recipe the run trained with; None when the run has none or
    it does not validate (then nothing is ruled out: any role may have been FP8)."""
    summary: dict[str, Any]
    evals: list[dict[str, Any]] = field(default_factory=list)
    """metrics.jsonl rows of kind "eval" (val_loss), in step order."""
    recipe_problem: str = ""
    """Why recipe.yaml did not validate (its first problem), empty when it did or is absent."""
    routing: list[dict[str, Any]] = field(default_factory=list)
    """routing.jsonl rows of an MoE run (tokens and mean routing weight per expert, per step and MoE layer)."""
    autopilot: list[dict[str, Any]] = field(default_factory=list)
    """metrics.jsonl rows of kind "autopilot" (a run with ``autopilot=on``: its actions, in order)."""
    ended_with: Recipe | None = None
    """The recipe the run ended with when the autopilot changed it (recipe.yaml with the applied actions:
    observe/doctor_autopilot.ended_with); None when it did not, or they do not apply (``autopilot_problem``)."""
    autopilot_problem: str = ""
    """Why the autopilot's actions did not apply to recipe.yaml (the proposals then patch recipe.yaml)."""

    @property
    def final_recipe(self) -> Recipe | None:
        """What the proposals patch: the recipe the run ended with (recipe.yaml when the autopilot changed nothing)."""
        return self.ended_with if self.ended_with is not None else self.recipe


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
    seeds: list[RunData] = field(default_factory=list)
    """BF16 runs of other seeds: their spread with the baseline is the gap's seed floor."""
    gap: LossGap | None = None
    """The loss gap to the baseline (None without one, or with fewer than 10 common steps)."""
    shared: list[Spike] = field(default_factory=list)
    """Spikes the baseline has at the same steps: not counted."""
    onset: int | None = None
    """The earliest anomaly kept after the baseline filter (None when healthy)."""
    experts: list[ExpertCause] = field(default_factory=list)
    """MoE experts whose delayed scales are far from their current ones, with the cause (routing shift, starved)."""

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
# The diagnosis


def _has_fp8(recipe: Recipe | None) -> bool:
    """Whether the recipe quantizes any role (an unknown recipe counts as FP8: nothing is ruled out)."""
    return recipe is None or recipe.is_fp8


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


def _evals(run: RunData) -> list[tuple[int, float]]:
    return [(int(r["step"]), v) for r in run.evals if (v := _value(r, "val_loss")) is not None]


def _all_spikes(run: RunData) -> list[Spike]:
    """Every metric's spikes, in step order (the evidence table reads in time)."""
    return sorted((s for m in SPIKE_RULES for s in detect_spikes(_series(run, m), m)), key=lambda s: s.start)


def _baseline_excess(series: list[tuple[int, float]], spike: Spike) -> float:
    """The baseline over the spike's steps (MATCH_STEPS either side): its largest value / the median of its
    WINDOW steps before them (inf: a non-finite value; 1: no data there)."""
    lo, hi = spike.start - MATCH_STEPS, spike.start + spike.length - 1 + MATCH_STEPS
    before = [v for s, v in series if s < lo and math.isfinite(v)][-WINDOW:]
    during = [v for s, v in series if lo <= s <= hi]
    if not before or not during:
        return 1.0
    if not all(math.isfinite(v) for v in during):
        return math.inf
    med = statistics.median(before)
    return max(during) / med if med > 0 else 1.0


def _match_baseline(spikes: list[Spike], baseline: RunData) -> tuple[list[Spike], list[Spike]]:
    """(kept, shared): a spike is shared when the baseline rises at the same steps by at least 1/MATCH_MARGIN of
    the run's excess over its running median (a data or LR event both runs see)."""
    kept, shared = [], []
    series = {m: _series(baseline, m) for m in SPIKE_RULES}
    for s in spikes:
        base = _baseline_excess(series[s.metric], s)
        same = base == math.inf or (math.isfinite(s.size) and s.size - 1 <= MATCH_MARGIN * (base - 1))
        (shared if same else kept).append(s)
    return kept, shared


def _spike_consequences(findings: list[Finding], spikes: list[Spike]) -> list[Finding]:
    """The one-step underflows recorded at a spike (its steps, or MATCH_STEPS after): the spike's large gradients or
    activations set that step's scale, so its small values fall below FP8's smallest step. Lost small values cannot
    raise a loss or a gradient norm: a consequence of the spike, never its cause (a cause clips, or lasts)."""
    def at_spike(step: int) -> bool:
        return any(s.start <= step <= s.start + s.length - 1 + MATCH_STEPS for s in spikes)
    return [f for f in findings if f.effect == "underflow" and f.share < LASTING and at_spike(f.step)]


def _first_recorded(numerics: list[dict[str, Any]], step: int) -> int:
    """The first step with statistics at or after `step` (what the numerics saw of the onset)."""
    return min((int(r.get("step", 0)) for r in numerics if int(r.get("step", 0)) >= step), default=step)


def _gap(run: RunData, baseline: RunData, seeds: list[RunData]) -> LossGap | None:
    """The loss gap to the baseline, its noise floor measured on the baseline and the other seeds' runs;
    DoctorInputError when one of those lacks steps the run and its baseline share."""
    losses, base = _series(run, "loss"), _series(baseline, "loss")
    for other in seeds:
        missing = missing_steps(_series(other, "loss"), losses, base)
        if missing:
            raise DoctorInputError(f"--baseline: '{other.path}' lacks {missing} of the steps the run and its first "
                                   f"baseline share (give BF16 runs of the same config and length, other seeds)")
    return loss_gap(losses, base, _evals(run), _evals(baseline),
                    seeds=[_series(o, "loss") for o in seeds])


def diagnose(run: RunData, baseline: RunData | None = None, seeds: Sequence[RunData] = ()) -> Diagnosis:
    """Classify the run, list what numerics.jsonl says about its layers and tensors, and propose changes.
    `seeds`: BF16 runs of the same config with other seeds (need a baseline): the spread between them and the
    baseline is the seed noise a gap must exceed."""
    if seeds and baseline is None:
        raise DoctorInputError("--baseline: runs of other seeds need the baseline of the run's own seed first")
    losses = _series(run, "loss")
    spikes = _all_spikes(run)
    div = _divergence(losses, spikes)
    shared: list[Spike] = []
    gap = base_div = None
    if baseline is not None:
        spikes, shared = _match_baseline(spikes, baseline)
        base_div = _divergence(_series(baseline, "loss"), _all_spikes(baseline))
        gap = _gap(run, baseline, list(seeds))
    fp8 = _has_fp8(run.recipe)
    if div is not None:
        verdict = div[0]
    elif gap is not None and gap.worse:
        verdict = "worse_than_baseline"
    else:
        verdict = "spikes" if spikes and fp8 else "healthy"
    d = Diagnosis(run, verdict, "", spikes=spikes, baseline=baseline, seeds=list(seeds), gap=gap, shared=shared)
    d.findings = find_problems(run.numerics)
    # what the proposals read: each (module, role) after the autopilot's last action on it (all rows without one)
    numerics = rows_after_actions(run.autopilot, run.numerics)
    settled = find_problems(numerics) if len(numerics) < len(run.numerics) else d.findings
    recipe = run.final_recipe
    d.experts = expert_causes(settled, numerics, run.routing) if _has_fp8(run.recipe) else []
    d.notes += _input_notes(d, len(d.findings) - len(settled))
    if verdict == "healthy" and d.experts:  # the loss does not show it (yet): the experts' own remedies only
        d.verdict = "stale_expert_scales"
        d.summary = (f"{len(d.experts)} expert(s) with a delayed scale far from the current one: "
                     + "; ".join(f"layer {c.layer} expert {c.expert} ({c.cause.replace('_', ' ')} at step {c.step})"
                                 for c in d.experts))
        d.proposals = expert_proposals(d.experts, recipe) if recipe is not None else []
        return d
    if verdict == "healthy":
        d.summary = _healthy_summary(d)
        d.notes += _healthy_notes(d, fp8)
        return d
    # the onset: the earliest anomaly kept after the baseline filter (what the stage, warmup and cause rules use)
    onset = min([s.start for s in spikes] + ([div[1]] if div else []) + (
        [gap.opens] if verdict == "worse_than_baseline" else []))
    d.onset = onset
    d.summary = _summary(d, onset)
    d.notes += _run_notes(run)
    if verdict == "worse_than_baseline" and not seeds:
        d.notes.append("one baseline measures its step-to-step noise, not the seed-to-seed noise (on the tiny CPU "
                       "model larger: docs/doctor.md, 'How large a gap counts'); a small gap may be that: train the "
                       "BF16 baseline with other seeds (trainer.seed=1, 2) and pass each as another --baseline")
    if not run.numerics and fp8:
        d.notes.append("no numerics.jsonl: rerun with ++debug.interval=10 to name the layers and tensors")
    reason = _not_fp8_reason(run, baseline, onset, base_div[0] if base_div else None)
    if reason is not None:
        d.summary += f"; not an FP8 problem: {reason}"
        d.notes.append("check the LR (trainer.lr, trainer.warmup_steps), the data and the config before the recipe")
        return d
    _propose(d, numerics, settled, div, onset)
    return d


def _propose(d: Diagnosis, numerics: list[dict], settled: list, div, onset: int) -> None:
    """d's proposals (and notes) for a run that went wrong at step `onset`: the causes recorded up to a divergence
    (`div`), or all the findings `settled` after the autopilot's actions, each remedied; a BF16 warmup for an early
    onset."""
    run, baseline, recipe = d.run, d.baseline, d.run.final_recipe
    total = int(run.train[-1].get("step", len(run.train)))
    early = onset <= max(SETTLE, total // 10)
    blind = baseline is None and div is not None and early  # everything explodes: findings are consequences
    if not blind:  # after a divergence, the numbers are its consequences: the causes are in the steps up to it
        causes = find_problems(numerics, _first_recorded(numerics, onset)) if div else settled
        experts = expert_causes(causes, numerics, run.routing) if div else d.experts
        mine = {c.prefix for c in experts}  # those experts' findings get their own remedy, not a role's
        causes = [f for f in causes if (expert_of(f.module) or ("",))[0] not in mine]
        after = _spike_consequences(causes, d.spikes + d.shared)
        causes = [f for f in causes if f not in after]
        d.notes += [f"{f.module} {f.role}: {f.text.split(' (')[0]} at the spike of step {f.step} only: the "
                    f"spike's consequence, not a cause (no change proposed for it)" for f in after]
        d.proposals = (expert_proposals(experts, recipe) if recipe is not None else []) + propose(
            causes, recipe, numerics)
    if (blind or early) and recipe is not None:
        d.proposals.append(warmup_proposal(recipe, onset, total))
    if not d.proposals:
        why = "the FP8 numerics show nothing beyond the limits" if run.numerics else "no numerics.jsonl"
        d.notes.append(f"no recipe change proposed: {why}; look at the data and the LR around step {onset}")
    if blind:
        d.notes.append(f"a divergence in the first steps (step {onset}) without a baseline: FP8 is not ruled out, "
                       f"nor blamed, and only a BF16 warmup is proposed. A BF16 run of the same config (no +recipe) "
                       f"tells FP8 from the LR: pass it as --baseline")


def _input_notes(d: Diagnosis, answered: int = 0) -> list[str]:
    """What the doctor says about its inputs: an unpaired baseline, a recipe it cannot read, shared spikes, the
    autopilot's changes (`answered`: findings left out of the proposals because an action came after them)."""
    out = _baseline_notes(d.run, d.baseline) if d.baseline is not None else []
    if d.gap is not None and not d.gap.paired:
        out.append("the baseline did not see the run's batches (another seed, batch size or data?): its loss gap is "
                   "held to the wider threshold that noise gives, and eval losses are not compared")
    if d.run.recipe_problem:
        out.append(f"recipe.yaml does not validate ({d.run.recipe_problem}): the doctor reads it as unknown (no FP8 "
                   f"role ruled out, no role setting to change, nothing for --write to patch)")
    if d.shared:
        out.append(f"{len(d.shared)} spike(s) at the same steps as the baseline's (steps "
                   f"{', '.join(str(s.start) for s in d.shared)}): both runs see them, not counted")
    applied = applied_actions(d.run.autopilot)
    if applied and d.run.ended_with is None:
        out.append(f"the autopilot changed the recipe during the run ({len(applied)} action(s), listed above), but its "
                   f"actions do not apply to recipe.yaml ({d.run.autopilot_problem}): the proposals patch recipe.yaml, "
                   f"the recipe the run started with")
    elif applied:
        left = f"; {answered} finding(s) recorded before an action on their module and role are not proposed again" \
            if answered > 0 else ""
        out.append(f"the autopilot changed the recipe during the run ({len(applied)} action(s), listed above): the "
                   f"proposals patch the recipe it ended with (recipe.yaml with those actions; its plan is at the end "
                   f"of plan.txt) and read each module and role's statistics after the last action on it{left}")
    return out


def _baseline_notes(run: RunData, baseline: RunData) -> list[str]:
    """A baseline that cannot measure the run's gap: the run itself, another model, or an FP8 run."""
    if baseline.path.resolve() == run.path.resolve():
        return ["the baseline is the run itself: its gap is 0 by construction; pass a BF16 run of the same config"]
    out = []
    mine, theirs = _model_config(run.path), _model_config(baseline.path)
    if mine is not None and theirs is not None and mine != theirs:
        keys = sorted(k for k in {*mine, *theirs} if mine.get(k) != theirs.get(k))
        out.append(f"the baseline trained another model (model.{', model.'.join(keys[:4])} differ): the loss gap "
                   f"compares two models, not FP8 with BF16; pass a BF16 run of the same model")
    if baseline.recipe is not None and baseline.recipe.is_fp8:
        out.append(f"the baseline ran recipe {baseline.recipe.name!r}, which has FP8 roles: the gap is to that run, "
                   f"not to BF16")
    return out


def _model_config(run_dir: Path) -> dict[str, Any] | None:
    """The run's model group as saved in .hydra/config.yaml (None when it cannot be read)."""
    try:
        from omegaconf import OmegaConf

        model = OmegaConf.to_container(OmegaConf.load(run_dir / ".hydra" / "config.yaml"), resolve=False).get("model")
    except Exception:  # noqa: BLE001 - a run without a readable config: nothing to compare
        return None
    return model if isinstance(model, dict) else None


def _healthy_notes(d: Diagnosis, fp8: bool) -> list[str]:
    """A healthy run's spikes (a run without FP8 has its own) and, for an FP8 run alone, how to see a gap."""
    out = []
    if d.spikes:
        out.append(f"{len(d.spikes)} spike(s) (steps {', '.join(str(s.start) for s in d.spikes)}) in a run "
                   f"without FP8: its own, nothing for an FP8 doctor")
    if d.baseline is None and fp8:
        out.append("without --baseline the doctor cannot see a loss gap, the most common FP8 failure: train "
                   "the same config without +recipe and pass it as --baseline")
    return out


def _run_notes(run: RunData) -> list[str]:
    """What summary.json adds: an early stop, BF16 fallbacks, skipped steps."""
    s, out = run.summary, []
    if s.get("stopped"):
        out.append(f"the run stopped: {s['stopped']}")
    if s.get("skipped_steps"):
        out.append(f"{s['skipped_steps']} step(s) skipped on non-finite values, {s.get('bf16_fallbacks', 0)} BF16 "
                   f"fallback(s)")
    return out


def _healthy_summary(d: Diagnosis) -> str:
    text = "the loss came down without divergence or spikes" + (" beyond the baseline's" if d.baseline else "")
    if d.gap is not None:
        m = d.gap.measure("smoothed")
        noise = ", within noise" if d.gap.within_noise else ""
        text += f"; {m.gap:+.1%} against the baseline{noise} (smoothed, steps {m.steps}; counts from {m.threshold:.1%})"
    return text


def _summary(d: Diagnosis, onset: int) -> str:
    if d.verdict == "diverged_from_start":
        text = f"diverged from the start (step {onset})"
    elif d.verdict == "mid_run_divergence":
        text = f"diverged mid-run at step {onset}"
    elif d.verdict == "worse_than_baseline":
        m = d.gap.measure("smoothed")
        text = (f"the loss ends {m.gap:+.1%} above the baseline's (smoothed, steps {m.steps}; counts from "
                f"{m.threshold:.1%}); the gap opens at step {d.gap.opens}")
        if onset < d.gap.opens:
            text += f", after a spike at step {onset}"
    else:
        text = f"{len(d.spikes)} spike(s), the first at step {onset}"
    if d.baseline is not None and d.verdict == "spikes":
        text += "; the baseline has no spike at those steps"
    return text
