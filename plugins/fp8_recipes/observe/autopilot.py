"""The autopilot's decisions: a run reads its own numerics statistics and changes its recipe, per module and role.

    pilot = Autopilot(autopilot_config(cfg.autopilot), recipe)
    for action in pilot.observe(step, rows, loss=loss, grad_norm=grad_norm):   # rows: this step's numerics rows
        log(action.line())                          # dry or applied; pilot.recipe is the recipe from the next step
    action = pilot.on_nonfinite(step, streak, rows)  # a recovery after `nonfinite_streak` non-finite steps
    checkpoint["autopilot"] = pilot.state_dict()     # JSON; Autopilot.from_state_dict(config, recipe, state)

**Signals** (:mod:`~fp8_recipes.observe.autopilot_signals`). At a statistics step, each (module, role) is
*flagged* when one of its rows (any GEMM) has underflow or saturation >= 1 %, cosine <= 0.99, a delayed scale 64x
below the current one (scale_ratio <= 1/64: a stale history) or 4x above it (it clips), or a non-finite value: the
doctor's limits (:class:`~fp8_recipes.observe.autopilot_config.AutopilotLimits`). It is *calm* when every signal is
below ``calm_fraction`` (0.5) of its limit (the ratio within 8x below and 2x above), its MSE / amax^2 is below
``mse_jump`` (100) times its own running median (the doctor's supporting signal: it never flags alone, but adds to a
flagged reading's severity) and neither the loss nor the grad norm spikes (the doctor's spike rule). A delayed
operand's rows with scale 1 at its first statistics step (and the first after an action) are skipped: the history
was empty, as the doctor skips them. NVFP4 operands are left to the doctor (none of these remedies is theirs).

**Rules.** A (module, role) flagged ``patience`` (3) statistics steps in a row and not cooling down takes, by
cause (the first that fits: clipping, stale scale, underflow, cosine), the first allowed remedy that keeps the
recipe valid (and that the caller's ``accept`` takes):

- delayed and clipping: to_current, else to_bf16;
- delayed with a stale scale: shorten_history (the amax history x ``history_factor``, 0.67, and at most the steps
  since the streak's first flagged step, so the amax that made it stale leaves the window), unless the history is
  <= 16 (:data:`SHORT_HISTORY`) or was shortened before; then to_current, then to_bf16;
- gradients in E4M3 underflowing (current scaling, or delayed without a stale scale): to_e5m2, else to_bf16;
- anything else (a cosine drop, clipping under current scaling): to_bf16, the module in ``layers.bf16_modules``;
- the same cause again after an action on that module and role: the next remedy (after shorten_history,
  to_current; otherwise to_bf16).

A role flagged in at least half of the modules that report it (and two or more:
:data:`~fp8_recipes.observe.doctor_remedies.ROLE_WIDE`) for ``patience`` steps gets one role-wide action (the
recipe's role policy and every ``modules:`` entry's for the role) and no per-module ones; a role-wide to_bf16 makes
the role BF16. A module (or role) the autopilot demoted, calm for ``calm`` (10) statistics steps after its
cool-down, is re-promoted to its previous policies, once. After an action its (module, role) waits
``cooldown_steps`` (50) steps (a role-wide action or a recovery: every track of its roles). At most
``max_actions_per_step`` (1) actions a step (the others keep their streaks for the next statistics step) and
``max_actions`` (8) in the run; past that, one last Action of kind ``cap_reached`` says so, then nothing.

**Dry run**: actions come back marked dry and count against the caps; their (module, role) cools down (so each is
said once per cool-down), and the recipe and the escalation history stay as they were. **Recovery**
(:meth:`Autopilot.on_nonfinite`): after ``nonfinite_streak`` (3) non-finite steps, the module whose rows have
non-finite or saturated values in BF16, else every delayed role's amax history shortened by ``history_factor``.

Pure: plain rows in, Actions out; no torch, no I/O. The state (:class:`AutopilotState`) is JSON data: resumed from
a checkpoint, the same rows give the same actions.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fp8_recipes.observe.autopilot_actions import (
    SHORT_HISTORY, Action, apply, demote_changes, is_bf16_module, module_changes, repromote_changes,
    restore_changes, role_changes, role_snapshot, shortened, to_bf16, to_current, to_e5m2,
)
from fp8_recipes.observe.autopilot_config import AutopilotConfig
from fp8_recipes.observe.autopilot_signals import CAUSES, Reading, culprit, number, read_rows, spiking
from fp8_recipes.observe.doctor_remedies import ROLE_WIDE
from fp8_recipes.recipe.schema import ROLES, Format, Recipe, RecipeError, Role, Scaling, TensorPolicy

__all__ = ["Action", "Autopilot", "AutopilotState", "Reading", "Track", "apply", "read_rows"]

WIDE = "*"
"""The module of a role-wide track and action."""


@dataclass
class Track:
    """A (module, role)'s streaks and history; a role-wide track has module ``*``."""

    flagged: int = 0
    """Flagged statistics steps in a row."""
    calm: int = 0
    """Calm statistics steps in a row (counted for a demoted track after its cool-down)."""
    seen: int = 0
    """Statistics steps with rows since the track began or last acted."""
    cooldown_until: int = 0
    """No action before this step."""
    steps: list[int] = field(default_factory=list)
    """The steps of the flagged streak (the last `patience`), for the evidence."""
    cause: str = ""
    evidence: str = ""
    severity: float = 0.0
    done: list[list[str]] = field(default_factory=list)
    """[kind, cause] of each applied action on it, oldest first: what the next remedy escalates from."""
    demoted: bool = False
    """In BF16 by the autopilot (a module in bf16_modules; a role-wide track: the role)."""
    repromoted: bool = False
    snapshot: dict[str, Any] | None = None
    """Role-wide demotion: the role's policies before it (:func:`role_snapshot`)."""
    mse: list[float] = field(default_factory=list)
    """The last statistics steps' MSE / amax^2 under its current policy (the median an MSE jump is measured from)."""


@dataclass
class AutopilotState:
    """Everything the autopilot knows, as JSON data (the checkpoint's ``autopilot`` entry)."""

    tracks: dict[str, Track] = field(default_factory=dict)
    """``module|role`` -> Track (``*|role``: the role-wide track)."""
    applied: list[dict[str, Any]] = field(default_factory=list)
    """Every applied action (Action.to_dict()), in order: replayed onto the run's recipe on resume."""
    taken: int = 0
    """Actions counted against max_actions (dry ones included)."""
    cap_noted: bool = False
    history: dict[str, list[float]] = field(default_factory=lambda: {"loss": [], "grad_norm": []})
    """The last accepted loss and grad-norm values (spikes never enter): the running median of the spike rule."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AutopilotState:
        tracks = {k: Track(**v) for k, v in data.get("tracks", {}).items()}
        return cls(tracks, [dict(a) for a in data.get("applied", [])], int(data.get("taken", 0)),
                   bool(data.get("cap_noted", False)),
                   {k: list(v) for k, v in data.get("history", {"loss": [], "grad_norm": []}).items()})


# ---------------------------------------------------------------------------------------------------------------
# Remedies


def remedies(cause: str, role: Role | str, policy: TensorPolicy, done: list[list[str]]) -> list[str]:
    """The remedies for `cause` under `policy`, mildest first (see the module docstring)."""
    if done and done[-1][1] == cause:  # the same trouble after an action on it: the next remedy
        return ["to_current", "to_bf16"] if done[-1][0] == "shorten_history" and cause == "stale" else ["to_bf16"]
    delayed = policy.scaling is Scaling.DELAYED
    if cause == "clipping" and delayed:
        return ["to_current", "to_bf16"]
    if cause == "stale" and delayed:
        again = any(kind == "shorten_history" for kind, _ in done) or policy.amax_history_len <= SHORT_HISTORY
        return ([] if again else ["shorten_history"]) + ["to_current", "to_bf16"]
    if cause == "underflow" and Role(role) is Role.GRADIENTS and policy.format is Format.E4M3:
        return ["to_e5m2", "to_bf16"]  # (any FP8 scaling: a delayed one with no stale scale lacks range too)
    return ["to_bf16"]


def _is_role_wide(flagged: int, reporting: int) -> bool:
    return flagged >= 2 and flagged >= ROLE_WIDE * reporting


def _key(module: str, role: str) -> str:
    return f"{module}|{role}"


# ---------------------------------------------------------------------------------------------------------------
# The autopilot


class Autopilot:
    """The decisions of one run: :meth:`observe` each statistics step, :meth:`on_nonfinite` on a non-finite
    streak; :attr:`recipe` is the recipe with every applied action (the run rebuilds its plan from it).

    ``accept(recipe)``: the caller's veto, None when the run can execute `recipe`, else why not (e.g. the plan's
    check on the TE backend); a refused remedy gives way to the next one, as an invalid recipe does."""

    def __init__(self, config: AutopilotConfig, recipe: Recipe, state: AutopilotState | None = None,
                 accept: Callable[[Recipe], str | None] | None = None):
        self.config = config
        self.state = state if state is not None else AutopilotState()
        self.accept = accept
        self.recipe = apply(recipe, self.actions)  # a resumed run: the same changes, in the same order

    @property
    def actions(self) -> list[Action]:
        """The applied actions, oldest first."""
        return [Action.from_dict(a) for a in self.state.applied]

    def state_dict(self) -> dict[str, Any]:
        """JSON data for the checkpoint."""
        return self.state.to_dict()

    @classmethod
    def from_state_dict(cls, config: AutopilotConfig, recipe: Recipe, state: Mapping[str, Any],
                        accept: Callable[[Recipe], str | None] | None = None) -> Autopilot:
        """Resume: `recipe` is the run's own (before any action); the applied actions are replayed onto it."""
        return cls(config, recipe, AutopilotState.from_dict(state), accept)

    def _track(self, module: str, role: str) -> Track:
        return self.state.tracks.setdefault(_key(module, role), Track())

    # -- each statistics step ----------------------------------------------------------------------------------
    def observe(self, step: int, rows: Iterable[Mapping[str, Any]], loss: float | None = None,
                grad_norm: float | None = None) -> list[Action]:
        """The actions decided at statistics step `step` from its numerics rows (and the step's loss and grad
        norm, for the spike rule); the applied ones are in :attr:`recipe` already."""
        if not self.config.enabled:
            return []
        rows = list(rows)
        spike = spiking(self.state.history["loss"], number(loss), "loss")
        spike = spiking(self.state.history["grad_norm"], number(grad_norm), "grad_norm") or spike
        readings = read_rows(rows, self.config, lambda m, r: self._track(m, r).seen == 0,
                             lambda m, r: _median(self._track(m, r).mse))
        for (module, role), reading in readings.items():
            t = self._track(module, role)
            _update(t, reading, step, self.config.patience)
            if reading.mse is not None:
                t.mse = (t.mse + [reading.mse])[-MSE_WINDOW:]
        for module, role in {(str(r.get("module", "?")), str(r.get("role", "?"))) for r in rows}:
            if _key(module, role) in self.state.tracks:
                self.state.tracks[_key(module, role)].seen += 1
        wide = self._update_wide(readings, step)
        self._count_calm(readings, step, spike)
        return self._act(step, readings, wide)

    def _update_wide(self, readings: Mapping[tuple[str, str], Reading], step: int) -> set[str]:
        """The roles whose problem is role-wide at this step (their role-wide tracks updated)."""
        per_role: dict[str, list[tuple[str, Reading]]] = defaultdict(list)
        for (module, role), reading in readings.items():
            per_role[role].append((module, reading))
        wide = set()
        for role, items in per_role.items():
            flagged = [(m, r) for m, r in items if r.flagged]
            reading = Reading(False, False)
            if _is_role_wide(len(flagged), len(items)):
                count = Counter(r.cause for _, r in flagged)
                cause = min(count, key=lambda c: (-count[c], CAUSES.index(c)))
                module, worst = max(((m, r) for m, r in flagged if r.cause == cause), key=lambda t: t[1].severity)
                reading = Reading(True, False, cause, f"{len(flagged)} of {len(items)} {role} linears flagged "
                                                      f"(worst: {module} {worst.evidence})", worst.severity)
                wide.add(role)
            _update(self._track(WIDE, role), reading, step, self.config.patience)
        return wide

    def _count_calm(self, readings: Mapping[tuple[str, str], Reading], step: int, spike: bool) -> None:
        """A demoted track's calm streak, after its cool-down: its rows calm, and no spike. A module in BF16 has no
        FP8 rows of its own: its role's rows in the modules still FP8 stand in for it (a role still near its limits
        there would put it back into the trouble it left: measured on the tiny CPU model, E4M3 gradients with
        margin 16 re-promoted blindly were demoted again 4 steps later); a role with no FP8 row anywhere (all of it
        in BF16) is calm when the loss and the grad norm do not spike."""
        for key, t in self.state.tracks.items():
            if not t.demoted or step < t.cooldown_until:
                continue
            module, role = key.rsplit("|", 1)
            mine = [r for (m, ro), r in readings.items() if ro == role and (module == WIDE or m == module)]
            if not mine:
                mine = [r for (_, ro), r in readings.items() if ro == role]
            # (no FP8 row of the role anywhere, e.g. the whole role in BF16: the loss and grad norm alone say calm)
            t.calm = t.calm + 1 if not spike and all(r.calm for r in mine) else 0

    def _candidates(self, step: int, readings: Mapping[tuple[str, str], Reading], wide: set[str]):
        """(module, role) of each track that may act now: role-wide first, then the worst, then re-promotions."""
        tracks, cfg = self.state.tracks, self.config

        def ready(t: Track) -> bool:
            return t.flagged >= cfg.patience and step >= t.cooldown_until and not t.demoted

        out = [(0, -tracks[_key(WIDE, r)].severity, WIDE, r) for r in map(str, ROLES)
               if r in wide and ready(tracks[_key(WIDE, r)])]
        out += [(1, -tracks[_key(m, r)].severity, m, r) for (m, r), reading in readings.items()
                if reading.flagged and ready(tracks[_key(m, r)]) and not is_bf16_module(self.recipe, m)]
        for key, t in tracks.items():
            if t.demoted and not t.repromoted and t.calm >= cfg.calm and step >= t.cooldown_until:
                out.append((2, 0.0, *key.rsplit("|", 1)))
        return [(m, r) for *_, m, r in sorted(out)]

    def _act(self, step: int, readings: Mapping[tuple[str, str], Reading], wide: set[str]) -> list[Action]:
        """The candidates' actions in order, within the caps. A role-wide problem covers its modules (they wait for
        the role-wide action) unless no role-wide remedy is allowed and valid: then they act one by one."""
        out: list[Action] = []
        covered = set(wide)
        for module, role in self._candidates(step, readings, wide):
            if len(out) >= self.config.max_actions_per_step:
                break  # the others keep their streaks and act at the next statistics step
            t = self._track(module, role)
            if module != WIDE and role in covered and not t.demoted:
                continue
            action = self._repromotion(step, module, role, t) if t.demoted else self._remedy(step, module, role, t)
            if action is None:
                if module == WIDE:
                    covered.discard(role)  # no role-wide remedy: its modules act one by one
                continue
            if self.state.taken >= self.config.max_actions:
                out += self._cap(step, action)
                break
            self._book(action)
            out.append(action)
        return out

    # -- choosing and taking an action -------------------------------------------------------------------------
    def _remedy(self, step: int, module: str, role: str, t: Track) -> Action | None:
        """The first allowed remedy for the track's cause that gives a valid, accepted recipe."""
        wide = module == WIDE
        policy = self.recipe.policy(role) if wide else self.recipe.module_policy(module, role)
        if not policy.is_fp8:
            return None
        after_action = f"; still after {t.done[-1][0]}" if t.done and t.done[-1][1] == t.cause else ""
        steps = ", ".join(map(str, t.steps))
        reason = f"{t.evidence} at steps {steps} ({t.flagged} statistics steps in a row){after_action}"
        for kind in remedies(t.cause, role, policy, t.done):
            if not self.config.allows(kind):
                continue
            # (a stale scale: the window shortened to the steps since the streak began, which drops the amax
            # that made it stale; the streak's first flagged step already had it)
            within = step - t.steps[0] + 1 if t.cause == "stale" and t.steps else None
            changes, after = self._changes(kind, module, role, policy, within)
            action = Action(step, module, role, kind, policy.describe(), after, reason, False, changes or {})
            if changes and self._trial(action) is not None:
                return dataclasses.replace(action, dry=self.config.dry_run)
        return None

    def _changes(self, kind: str, module: str, role: str, policy: TensorPolicy,
                 within: int | None = None) -> tuple[dict[str, Any] | None, str]:
        """The recipe changes of `kind` on (module, role) and the policy after it; None when it changes nothing.
        `within`: shorten_history keeps at most that many steps."""
        if kind == "to_bf16":
            if module == WIDE:
                return role_changes(self.recipe, [role], to_bf16), "bf16"
            return demote_changes(self.recipe, module), "bf16"
        transform = {"shorten_history": lambda p: shortened(p, self.config.history_factor, within),
                     "to_current": to_current,
                     "to_e5m2": to_e5m2}[kind]
        new = transform(policy)
        if new == policy:
            return None, ""
        if module == WIDE:
            return role_changes(self.recipe, [role], transform), new.describe()
        return module_changes(self.recipe, module, role, new), new.describe()

    def _trial(self, action: Action) -> Recipe | None:
        """The recipe `action` would give, or None when it is not valid or the caller's `accept` refuses it."""
        try:
            recipe = apply(self.recipe, [dataclasses.replace(action, dry=False)])
        except RecipeError:
            return None
        return recipe if self.accept is None or self.accept(recipe) is None else None

    def _repromotion(self, step: int, module: str, role: str, t: Track) -> Action | None:
        if not self.config.allows("repromote"):
            return None
        if module == WIDE:
            changes = restore_changes(self.recipe, role, t.snapshot or role_snapshot(self.recipe, role))
        else:
            changes = repromote_changes(self.recipe, module)
        action = Action(step, module, role, "repromote", "bf16", "", f"calm for {t.calm} statistics steps after "
                        f"the cool-down that ended at step {t.cooldown_until}", False, changes)
        recipe = self._trial(action)
        if recipe is None:
            return None
        after = recipe.policy(role) if module == WIDE else recipe.module_policy(module, role)
        return dataclasses.replace(action, after=after.describe(), dry=self.config.dry_run)

    def _book(self, action: Action) -> None:
        """Count `action`, cool its tracks down; unless dry, apply it and remember it (escalation, demotion)."""
        self.state.taken += 1
        roles = [str(r) for r in ROLES] if action.role == WIDE else [action.role]
        main = None if action.role == WIDE else self._track(action.module, action.role)
        tracks = [main] if main is not None and action.module != WIDE else []
        if action.module == WIDE:  # every track of the role(s): the role-wide one and each module's
            tracks = [t for k, t in self.state.tracks.items() if k.rsplit("|", 1)[1] in roles]
        cause = "nonfinite" if action.recovery else (main.cause if main is not None else "")
        for t in tracks:
            t.flagged, t.steps, t.cooldown_until = 0, [], action.step + self.config.cooldown_steps
        if action.dry:
            return
        if action.kind == "to_bf16" and action.module == WIDE and main is not None:
            main.snapshot = role_snapshot(self.recipe, action.role)
        self.recipe = apply(self.recipe, [action])
        self.state.applied.append(action.to_dict())
        for t in tracks:
            t.seen, t.mse = 0, []  # (a new policy: new errors, measured afresh)
            if action.kind != "repromote":
                t.done.append([action.kind, cause])
        if main is not None and action.kind == "to_bf16":
            main.demoted, main.calm = True, 0
        elif main is not None and action.kind == "repromote":
            main.demoted, main.repromoted, main.calm = False, True, 0

    def _cap(self, step: int, would: Action) -> list[Action]:
        """The one note that max_actions is reached (then nothing more)."""
        if self.state.cap_noted:
            return []
        self.state.cap_noted = True
        return [Action(step, WIDE, WIDE, "cap_reached", "", "", f"max_actions={self.config.max_actions} reached: no "
                       f"more actions this run (next would have been {would.kind} {would.module} {would.role})",
                       self.config.dry_run)]

    # -- recovery ----------------------------------------------------------------------------------------------
    def on_nonfinite(self, step: int, streak: int, rows: Iterable[Mapping[str, Any]] = ()) -> Action | None:
        """After `nonfinite_streak` non-finite steps in a row (`streak`, counted by the caller, who resets it
        when it goes back to a good state): the module whose `rows` (the latest statistics) have non-finite or
        saturated values in BF16, else every delayed role's amax history shortened; None when neither applies
        (the trainer's own on_nonfinite policy then holds) or max_actions is reached (said once)."""
        if not self.config.enabled or streak < self.config.nonfinite_streak:
            return None
        why = f"{streak} non-finite steps in a row"
        for action in self._recoveries(step, list(rows), why):
            if self._trial(action) is None:
                continue
            if self.state.taken >= self.config.max_actions:
                capped = self._cap(step, action)
                return capped[0] if capped else None
            action = dataclasses.replace(action, dry=self.config.dry_run)
            self._book(action)
            return action
        return None

    def _recoveries(self, step: int, rows: list[Mapping[str, Any]], why: str) -> Iterable[Action]:
        worst = culprit(rows, self.config)
        if worst is not None and self.config.allows("to_bf16") and not is_bf16_module(self.recipe, worst[0]):
            module, role, evidence = worst
            yield Action(step, module, role, "to_bf16", self.recipe.module_policy(module, role).describe(), "bf16",
                         f"{why}; {evidence}", changes=demote_changes(self.recipe, module), recovery=True)
        delayed = [r for r in ROLES if self.recipe.policy(r).scaling is Scaling.DELAYED
                   or any((p := m.policy(r)) is not None and p.scaling is Scaling.DELAYED for m in self.recipe.modules)]
        factor = self.config.history_factor
        changes = role_changes(self.recipe, delayed, lambda p: shortened(p, factor))
        if changes and self.config.allows("shorten_history"):  # (a history of 1 cannot be shortened)
            before = "; ".join(f"{r} {self.recipe.policy(r).describe()}" for r in delayed)
            after = "; ".join(f"{r} {shortened(self.recipe.policy(r), factor).describe()}" for r in delayed)
            yield Action(step, WIDE, WIDE if len(delayed) > 1 else str(delayed[0]), "shorten_history", before, after,
                         f"{why}; every delayed amax history x {factor:g}", changes=changes, recovery=True)


MSE_WINDOW = 10
"""Statistics steps of MSE / amax^2 a track keeps; its median needs :data:`MSE_SETTLE` of them."""
MSE_SETTLE = 3


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if len(values) >= MSE_SETTLE else None


def _update(t: Track, reading: Reading, step: int, patience: int) -> None:
    """A track's flagged streak after one reading (a reading that is not flagged ends it)."""
    if reading.flagged:
        t.flagged += 1
        t.steps = (t.steps + [step])[-patience:]
        t.cause, t.evidence, t.severity = reading.cause, reading.evidence, reading.severity
    else:
        t.flagged, t.steps = 0, []
