"""The autopilot in a training run: the numerics rows of each statistics step go to the decision core
(observe/autopilot.py), and its actions change the plan the backend runs from the next step on.

    autopilot = resolve_autopilot(cfg)                        # training/run.py: the typed ``autopilot:`` section
    debug = statistics_for(autopilot, debug)                  # statistics at its interval when ``debug`` is off
    precision = AutopilotPrecision(precision, recorder, plan, autopilot, run_dir, rank=rank)
    ... train: after each step the loop calls step_result (the decision) and logs what drain_events hands over ...

After each step, before its evaluation and checkpoint: the recorder's rows of the step just finished
(every rank's, all-gathered in rank order, so every rank reads the same rows and decides the same: the data-,
tensor- and context-parallel ranks' worst values count, each pipeline stage's rows name its own modules, and all
stages agree on the one plan), that step's loss and gradient norm, go to :meth:`Autopilot.observe`. An applied
action rebuilds the plan from the patched recipe and hands it to the backend (``replan``: the emulated backend's
delayed state carried or resized); the plan is printed again at the end of plan.txt. A streak of
``nonfinite_streak`` skipped steps (the engine skipped them: weights, optimizer and LR schedule are still the last
good step's) takes the recovery action at once. Every action, dry or not, becomes a ``kind: autopilot`` row in
metrics.jsonl (TensorBoard text ``autopilot/text``), a console and train.log line; the decision state goes into
the checkpoints (``autopilot`` beside the backend's scaling state), so a resumed run replays the applied actions
onto its recipe before the scaling state loads, and continues with the same plan and the same pending re-promotions.

Both backends: the emulated one carries or resizes its delayed scalers (``EmulatedPrecision.replan``); the TE one
moves each changed module to its new TE recipe at the next step, its delayed amaxes carried
(``TEPrecision.replan``, backends/te_state.py). A recipe the run's backend would not run as asked is never applied
(:meth:`AutopilotPrecision._accept`: the next remedy is tried). FP8-stored weights on TE are refused in one line
(:func:`check_autopilot`).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from collections.abc import Callable
from typing import Any

from fp8_recipes.checks import ConfigError
from fp8_recipes.observe.autopilot import Action, Autopilot
from fp8_recipes.observe.autopilot_config import ACTION_KINDS, AutopilotConfig
from fp8_recipes.observe.config import DebugConfig
from fp8_recipes.plan.format import format_plan
from fp8_recipes.plan.precision import PrecisionPlan
from fp8_recipes.recipe.schema import Backend, Format, RecipeError, Role, Scaling
from fp8_recipes.rundir import PLAN

__all__ = ["AutopilotPrecision", "autopilot_notices", "check_autopilot", "statistics_for"]

logger = logging.getLogger(__name__)


def statistics_for(autopilot: AutopilotConfig, debug: DebugConfig) -> DebugConfig:
    """The statistics the run records: ``debug``'s, or with the autopilot on and ``debug.interval`` 0, every
    module's and role's at the autopilot's interval (steps 1, 1 + interval, ...). With both set the autopilot reads
    debug's statistics steps, and a different ``autopilot.interval`` gets a warning (it would do nothing)."""
    if not autopilot.enabled:
        return debug
    if debug.interval == 0:
        return dataclasses.replace(debug, interval=autopilot.interval, start_step=1, end_step=None)
    if debug.interval != autopilot.interval:
        logger.warning("autopilot.interval=%d does nothing: the autopilot reads the numerics statistics steps (every "
                       "%d, debug.interval, from debug.start_step to debug.end_step)", autopilot.interval,
                       debug.interval)
    return debug


def autopilot_notices(raw: Any, autopilot: AutopilotConfig, plan: PrecisionPlan, max_steps: int) -> list[str]:
    """Autopilot settings this run cannot act on, one line each: keys set while it is off (``raw``: the run
    config's ``autopilot`` mapping); a run with no FP8 GEMM; listed actions the recipe gives nothing to act on;
    NVFP4 operands, for which it has only its non-finite recovery."""
    if autopilot is None:
        return []
    if not autopilot.enabled:  # (what differs from the defaults: `autopilot=on ++autopilot.enabled=false` sets none)
        default = AutopilotConfig()
        given = sorted(k for k in (raw or {})
                       if k != "enabled" and getattr(autopilot, k, None) != getattr(default, k, None))
        return [f"autopilot.{given[0]}{' (and ' + ', '.join(given[1:]) + ')' if given[1:] else ''} does nothing: "
                f"the autopilot is off (autopilot.enabled=false); use autopilot=on, or drop it"] if given else []
    modules = [(name, module) for first, _, _ in plan.stages(max_steps)
               for name, module in plan.at(first).modules.items()]
    if not any(module.any_fp8 for _, module in modules):
        return [f"autopilot: nothing to act on: no GEMM runs FP8 in this run (recipe {plan.recipe.name}), and the "
                f"autopilot changes FP8 scaling per module and role; train with an FP8 recipe (+recipe=hybrid), or "
                f"autopilot=off"]
    nvfp4 = sorted({name for name, module in modules for gemm in module.gemms.values() for _, p in gemm.operands
                    if p is not None and p.scaling is Scaling.NVFP4})
    out = [line] if (line := _idle_actions_notice(autopilot.actions, plan.recipe)) else []
    earliest = 1 + autopilot.interval * (autopilot.patience - 1)  # (statistics at steps 1, 1 + interval, ...)
    if earliest > max_steps:
        out.append(f"autopilot: it acts after autopilot.patience={autopilot.patience} statistics steps in a row, "
                   f"one every autopilot.interval={autopilot.interval} steps: at step {earliest} at the earliest, "
                   f"after trainer.max_steps={max_steps} (only its non-finite recovery can act); lower "
                   f"autopilot.interval or patience, or autopilot=off")
    if nvfp4:
        out.append(f"autopilot: the NVFP4 operands ({len(nvfp4)} module(s), e.g. {nvfp4[0]}) get its non-finite "
                   f"recovery only: its signals and actions are FP8 scaling's (the doctor reads NVFP4's statistics: "
                   f"fp8-recipes doctor RUN_DIR)")
    return out


def _idle_actions_notice(actions: tuple[str, ...], recipe) -> str | None:
    """autopilot.actions that can never act under ``recipe``, as one line; None for the full list (the default,
    and the `on` preset's: each kind there waits for a recipe it fits) or when every listed kind can act."""
    if actions == ACTION_KINDS:
        return None
    policies = recipe.stated_policies()
    delayed = any(p.scaling is Scaling.DELAYED for _, p in policies)
    why = {"shorten_history": None if delayed else "no role uses delayed scaling",
           "to_current": None if delayed else "no role uses delayed scaling",
           "to_e5m2": None if any(r is Role.GRADIENTS and p.format is Format.E4M3 and p.scaling not in
                                  (Scaling.NONE, Scaling.NVFP4) for r, p in policies)
           else "no E4M3 FP8 gradients to widen",
           "repromote": None if "to_bf16" in actions else "nothing demotes a module without to_bf16 in the list"}
    idle = [f"{k} ({why[k]})" for k in actions if why.get(k)]
    if not idle:
        return None
    fix = ("so the autopilot changes nothing; list an action this recipe allows (e.g. to_bf16), or autopilot=off"
           if len(idle) == len(actions) else f"drop {'it' if len(idle) == 1 else 'them'}")
    return f"autopilot.actions: {' and '.join(idle)} cannot act under recipe {recipe.name}; {fix}"


def check_autopilot(autopilot: AutopilotConfig, plan: PrecisionPlan, trainer=None) -> None:
    """ConfigError (one line) for a run the autopilot cannot drive: FP8-stored weights on the TE backend, or a
    recovery streak the trainer's own non-finite policy would end first (``trainer``: the TrainerConfig)."""
    if not autopilot.enabled:
        return
    if plan.backend is Backend.TE and plan.recipe.fp8_param:
        raise ConfigError("autopilot.enabled: FP8-stored weights (recipe fp8_param: true) are quantized with their "
                          "layer's Transformer Engine recipe, which an action would change; set "
                          "recipe.fp8_param=false, or autopilot=off")
    limit = getattr(trainer, "max_consecutive_skips", None)
    if limit is not None and autopilot.nonfinite_streak >= limit:
        why = (f"{autopilot.nonfinite_streak} non-finite steps start the autopilot's recovery, but the trainer falls "
               f"back or stops after trainer.max_consecutive_skips={limit}, before it")
        if limit > 1:  # (the streak is at least 1: below 1 there is nothing to lower it to)
            raise ConfigError(f"autopilot.nonfinite_streak: {why}; set autopilot.nonfinite_streak below {limit}")
        raise ConfigError(f"trainer.max_consecutive_skips: {why}; raise trainer.max_consecutive_skips above "
                          f"{autopilot.nonfinite_streak}")


@dataclasses.dataclass(frozen=True)
class Event:
    """What the loop logs of one action: its metrics.jsonl row and its console line."""

    row: dict[str, Any]
    line: str


class AutopilotPrecision:
    """A precision controller (training/precision.py) that lets the autopilot change the plan between steps;
    everything else is the wrapped one (ObservedPrecision over the backend, with the numerics recorder)."""

    def __init__(self, inner, recorder, plan: PrecisionPlan, config: AutopilotConfig, run_dir: str | Path, *,
                 rank: int = 0, max_steps: int | None = None, check: Callable[[PrecisionPlan], Any] | None = None):
        self._inner, self.recorder, self.plan, self.config = inner, recorder, plan, config
        self.check = check
        """The run's own checks of a plan (training/run.check_plan: the layout, grouped experts, shapes), which a
        new plan must pass too: they raise the one-line error."""
        self.run_dir, self.rank, self.max_steps = Path(run_dir), rank, max_steps
        self.base_recipe = plan.recipe
        self.pilot = Autopilot(config, plan.recipe, accept=self._accept)
        self.full_precision_eval_interval = inner.full_precision_eval_interval
        self.events: list[Event] = []
        self._rows: list[dict[str, Any]] = []  # the last statistics step's rows (a recovery reads them)
        self._streak = 0
        self._resumed = False
        self.reset_scaling = False
        """trainer.reset_scaling_state: a resume loads the autopilot's state, not the backend's scaling state."""

    # -- the loop's calls ---------------------------------------------------------------------------------------
    def begin_step(self, step: int) -> str:
        if self._resumed:  # plan.txt was written again from the recipe once the checkpoint loaded
            self._append_plan(step, self.pilot.actions, "resumed with")  # (the applied ones)
            self._resumed = False
        return self._inner.begin_step(step)

    def step_result(self, step: int, loss: float | None, grad_norm: float | None) -> None:
        """The loop, after step `step` (1-based) on every rank, before its evaluation and checkpoint: the step's
        rows written (the recorder's flush) and, at a statistics step, decided on with this loss and gradient norm
        (the same on every rank), so a checkpoint of the step holds the decision."""
        self.recorder.flush()
        rows = self.recorder.take_rows()
        if self.recorder.config.stats_due(step):  # (the same steps on every rank: gathered there)
            rows = self._rows = _gathered(rows)
            self._take(self.pilot.observe(step, rows, loss=loss, grad_norm=grad_norm), step)

    def after_optimizer_step(self, step: int) -> None:
        self._streak = 0
        self._inner.after_optimizer_step(step)

    def skip_step(self, step: int) -> None:
        self._inner.skip_step(step)
        self._streak += 1
        if self._streak >= self.config.nonfinite_streak:
            action = self.pilot.on_nonfinite(step + 1, self._streak, self._rows)
            if action is not None:
                self._streak = 0
                self._take([action], step + 1)

    def drain_events(self) -> list[Event]:
        """The actions since the last call, for the loop to log (rank 0 writes them)."""
        events, self.events = self.events, []
        return events

    def high_precision(self):
        return self._inner.high_precision()

    # -- checkpoints --------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {**self._inner.state_dict(), "autopilot": self.pilot.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """The decision state first (its applied actions replayed onto the run's recipe, the backend replanned), so
        the scaling state of the checkpoint finds the histories it was saved with."""
        state = dict(state)
        saved = state.pop("autopilot", None)
        if saved is not None:
            try:
                self.pilot = Autopilot.from_state_dict(self.config, self.base_recipe, saved, accept=self._accept)
            except (RecipeError, KeyError, TypeError, ValueError) as e:
                raise ConfigError(f"resume: the checkpoint's autopilot state does not apply to this recipe "
                                  f"({str(e).splitlines()[0]}); resume with the recipe it was written with, or "
                                  f"autopilot=off") from None
            self._replan()
            self._resumed = bool(self.pilot.actions)
        if not self.reset_scaling:
            self._inner.load_state_dict(state)

    def __getattr__(self, name: str):  # plan-independent attributes of the backend: states, scales() ...
        if name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)

    # -- inside ---------------------------------------------------------------------------------------------------
    def _accept(self, recipe) -> str | None:
        """The autopilot's veto (its one-line reason): a recipe the run cannot plan or check, one its backend would
        leave (auto: TE cannot run it at all), or one TE would not run as asked (a new substitution: the action
        would change nothing, or something else)."""
        try:
            plan = PrecisionPlan(recipe, self.plan.layout, self.plan.hardware)
            if self.check is not None:
                self.check(plan)
        except (RecipeError, ConfigError, ValueError) as e:
            return str(e).splitlines()[0]
        if plan.backend is not self.plan.backend:
            return f"the run would move from the {self.plan.backend} backend to {plan.backend} ({plan.backend_reason})"
        new = sorted(plan.te_differences() - self.plan.te_differences())
        if new:
            module, role = new[0]
            return f"Transformer Engine would not run {module} {role} as asked ({len(new)} module role(s))"
        return None

    def _take(self, actions: list[Action], step: int) -> None:
        """Log `actions`; replan when one of them changed the recipe."""
        for a in actions:
            row = {"kind": "autopilot", "step": a.step, "action": a.kind,
                   **{k: v for k, v in a.to_dict().items() if k not in ("kind", "step")}, "text": a.line()}
            self.events.append(Event(row, a.line()))
        applied = [a for a in actions if not a.dry and a.changes]
        if applied:
            self._replan()
            self._append_plan(step, applied, "the autopilot's plan after")

    def _append_plan(self, step: int, applied: list[Action], words: str) -> None:
        """plan.txt (rank 0): the applied actions, then the plan the run follows from step ``step + 1``. A write that
        fails (a full disk) is a warning: the other ranks took the same action and go on, so rank 0 must too (the
        action is in metrics.jsonl and the checkpoint, which carry the run)."""
        if self.rank != 0:
            return
        head = "\n".join(f"# {a.line()}" for a in applied)
        text = f"\n# from step {step + 1}, {words}:\n{head}\n{format_plan(self.plan, self.max_steps)}\n"
        try:
            with open(self.run_dir / PLAN, "a") as f:
                f.write(text)
        except OSError as e:
            logger.warning("autopilot: could not append the plan from step %d to %s (%s); the run goes on, and its "
                           "actions are in metrics.jsonl", step + 1, self.run_dir / PLAN, e.strerror or e)

    def _replan(self) -> None:
        self.plan = PrecisionPlan(self.pilot.recipe, self.plan.layout, self.plan.hardware)
        self._inner.replan(self.plan)


def _gathered(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every rank's rows of the step, in rank order (the same list on every rank); this rank's alone without a
    process group. Called by every rank at the same steps (the statistics steps are the config's)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return rows
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, rows)
    return [r for theirs in everyone for r in theirs]
