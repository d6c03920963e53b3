"""The typed ``autopilot:`` section: whether, how often and how far a run may change its own recipe.

The run config's top-level ``autopilot`` mapping (Hydra group ``conf/autopilot/``: ``off``, the default, and the
shipped ``on`` preset; keys can be set on the command line, e.g. ``autopilot=on ++autopilot.dry_run=true``):

    autopilot:
      enabled: true
      dry_run: false             # true: log what it would do, change nothing
      interval: 10               # read the numerics statistics every 10 steps
      limits: {underflow_pct: 1.0, saturation_pct: 1.0, cosine_drop: 0.01, scale_gap: 64.0, mse_jump: 100.0}
      patience: 3                # flagged statistics steps in a row before acting
      calm: 10                   # calm statistics steps in a row before a demoted module is re-promoted
      calm_fraction: 0.5         # calm = every signal below half its limit
      cooldown_steps: 50         # after an action, no other on that module and role for 50 steps
      max_actions_per_step: 1
      max_actions: 8
      actions: [shorten_history, to_current, to_e5m2, to_bf16, repromote]
      history_factor: 0.67       # shorten_history: a delayed amax history by a third
      nonfinite_streak: 3        # non-finite steps in a row before a recovery

The limits' defaults are the doctor's (:data:`~fp8_recipes.observe.doctor_findings.LIMITS`), read from there: one
home for the numbers, so the run acts on what the doctor would report. Problems are reported as
``autopilot.<key>: ...`` in a :class:`~fp8_recipes.recipe.schema.RecipeError` (a ValueError), all at once, with the
recipe reader's messages (read through :class:`~fp8_recipes.checks.KeyReader`). The decisions are in
:mod:`~fp8_recipes.observe.autopilot`. Imports only checks.py, the schema and the doctor's limits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fp8_recipes.checks import KeyReader, did_you_mean, fmt
from fp8_recipes.observe.doctor_findings import LIMITS
from fp8_recipes.recipe.schema import RecipeError

__all__ = ["ACTION_KINDS", "AutopilotConfig", "AutopilotLimits", "autopilot_config"]

ACTION_KINDS = ("shorten_history", "to_current", "to_e5m2", "to_bf16", "repromote")
"""What the autopilot may do, mildest first (the values of ``actions:``)."""


@dataclass(frozen=True)
class AutopilotLimits:
    """When a statistics row of a (module, role) is flagged: the doctor's limits (doctor_findings.LIMITS)."""

    underflow_pct: float = LIMITS["underflow_pct"]
    """% of the non-zero values flushed to zero at or above which a row is flagged."""
    saturation_pct: float = LIMITS["saturation_pct"]
    """% of the values clipped at or above which a row is flagged."""
    cosine_drop: float = LIMITS["cosine_drop"]
    """1 - cosine(FP8, high precision) at or above which a row is flagged (0.01: cosine <= 0.99)."""
    scale_gap: float = LIMITS["scale_gap"]
    """Delayed scaling: a scale this many times below the one current scaling would pick is flagged (a stale
    history: the values sit far below the range it keeps for them)."""
    mse_jump: float = LIMITS["mse_jump"]
    """MSE / amax^2 this many times its own median over the (module, role)'s earlier statistics steps: a supporting
    signal, as in the doctor (never acts alone): such a step is not calm, and it adds to a flagged one's severity."""


@dataclass(frozen=True)
class AutopilotConfig:
    enabled: bool = False
    """Act on the run's own numerics (off: the run attaches nothing and costs nothing)."""
    dry_run: bool = False
    """Return the actions marked dry, for the run to log, and change nothing."""
    interval: int = 10
    """Read the statistics every this many steps (1, 1 + interval, ...; as debug.interval with start_step 1)."""
    limits: AutopilotLimits = field(default_factory=AutopilotLimits)
    """When a (module, role) is flagged at one statistics step."""
    patience: int = 3
    """Flagged statistics steps in a row before acting: one bad step is an event, not a recipe problem."""
    calm: int = 10
    """Calm statistics steps in a row (after the cool-down) before a module demoted to BF16 is re-promoted."""
    calm_fraction: float = 0.5
    """A step is calm when every signal is below this fraction of its limit (ratios: this power of the gap), and
    neither the loss nor the grad norm spikes: a band between calm and flagged, so a value at the limit cannot
    demote and re-promote a module in turn."""
    cooldown_steps: int = 50
    """After an action, no other on the same module and role for this many steps (5 statistics steps at the
    default interval: time for the new setting to show in the statistics)."""
    max_actions_per_step: int = 1
    """Actions at one statistics step; the others wait for the next (one change at a time can be told apart)."""
    max_actions: int = 8
    """Actions in the whole run; past it the autopilot only says once that it stopped (an action ``cap_reached``)."""
    actions: tuple[str, ...] = ACTION_KINDS
    """The kinds it may take; a remedy not allowed gives way to the next stronger one that is."""
    history_factor: float = 0.67
    """shorten_history: the delayed amax history becomes this fraction of its length (at least 1)."""
    nonfinite_streak: int = 3
    """Non-finite steps in a row before a recovery (below trainer.max_consecutive_skips, 5 by default, so the
    autopilot acts before the trainer's own fallback)."""

    def allows(self, kind: str) -> bool:
        return kind in self.actions

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, key: str = "autopilot") -> AutopilotConfig:
        """Validate and build; raises RecipeError naming ``<key>.<field>`` for every problem."""
        reader = _AutopilotReader()
        out = reader.read(key, data)
        if reader.problems:
            raise RecipeError(reader.problems)
        return out


def autopilot_config(data: Mapping[str, Any] | None) -> AutopilotConfig:
    """The run's AutopilotConfig from the run config's ``autopilot`` mapping (None: off)."""
    return AutopilotConfig.from_dict(data)


_KEYS = {f.name for f in dataclasses.fields(AutopilotConfig)}
_LIMIT_KEYS = {f.name for f in dataclasses.fields(AutopilotLimits)}


class _AutopilotReader(KeyReader):
    """The shared scalar checks (the recipe reader's messages), plus the limits, the action list and the rules
    that tie fields together."""

    def limits(self, key: str, value: Any) -> AutopilotLimits:
        raw = self.mapping(key, value, _LIMIT_KEYS)
        d = AutopilotLimits()
        pct = {k: self.number(f"{key}.{k}", raw.get(k, getattr(d, k)), 0.0, 100.0, getattr(d, k), lo_open=True)
               for k in ("underflow_pct", "saturation_pct")}
        drop = self.number(f"{key}.cosine_drop", raw.get("cosine_drop", d.cosine_drop), 0.0, 1.0, d.cosine_drop,
                           lo_open=True)
        gap = self.number(f"{key}.scale_gap", raw.get("scale_gap", d.scale_gap), 1.0, float("inf"), d.scale_gap,
                          lo_open=True)
        jump = self.number(f"{key}.mse_jump", raw.get("mse_jump", d.mse_jump), 1.0, float("inf"), d.mse_jump,
                           lo_open=True)
        return AutopilotLimits(cosine_drop=drop, scale_gap=gap, mse_jump=jump, **pct)

    def kinds(self, key: str, value: Any) -> tuple[str, ...]:
        if value is None:
            return ACTION_KINDS
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, Sequence) or not value:
            self.bad(key, f"{fmt(value)} is not a non-empty list of {' | '.join(ACTION_KINDS)}; to act on nothing "
                          f"set enabled: false (or dry_run: true to see what it would do)")
            return ACTION_KINDS
        out = []
        for i, v in enumerate(value):
            if v in ACTION_KINDS:
                out.append(v)
            else:
                self.bad(f"{key}[{i}]", f"{fmt(v)} is not one of {' | '.join(ACTION_KINDS)}"
                                        f"{did_you_mean(v, ACTION_KINDS)}")
        return tuple(k for k in ACTION_KINDS if k in out) or ACTION_KINDS  # in the canonical order

    def fraction(self, key: str, value: Any, default: float) -> float:
        """A number strictly between 0 and 1."""
        return self.number(key, value, 0.0, 1.0, default, lo_open=True, hi_open=True)

    def read(self, key: str, data: Any) -> AutopilotConfig:
        raw = self.mapping(key, data, _KEYS)
        d = AutopilotConfig()

        def given(name: str) -> Any:  # the value given, else the field's default (each default written once)
            return raw.get(name, getattr(d, name))

        enabled = self.boolean(f"{key}.enabled", given("enabled"), d.enabled)
        interval = self.integer(f"{key}.interval", given("interval"), 0, d.interval)
        if enabled and interval == 0:
            self.bad(f"{key}.interval", "0 with enabled: true reads no statistics; set interval >= 1 (e.g. 10) or "
                                        "enabled: false")
        return AutopilotConfig(
            enabled=enabled,
            dry_run=self.boolean(f"{key}.dry_run", given("dry_run"), d.dry_run),
            interval=interval,
            limits=self.limits(f"{key}.limits", raw.get("limits")),
            patience=self.integer(f"{key}.patience", given("patience"), 1, d.patience),
            calm=self.integer(f"{key}.calm", given("calm"), 1, d.calm),
            calm_fraction=self.fraction(f"{key}.calm_fraction", given("calm_fraction"), d.calm_fraction),
            cooldown_steps=self.integer(f"{key}.cooldown_steps", given("cooldown_steps"), 0, d.cooldown_steps),
            max_actions_per_step=self.integer(f"{key}.max_actions_per_step", given("max_actions_per_step"), 1,
                                              d.max_actions_per_step),
            max_actions=self.integer(f"{key}.max_actions", given("max_actions"), 1, d.max_actions),
            actions=self.kinds(f"{key}.actions", raw.get("actions")),
            history_factor=self.fraction(f"{key}.history_factor", given("history_factor"), d.history_factor),
            nonfinite_streak=self.integer(f"{key}.nonfinite_streak", given("nonfinite_streak"), 1,
                                          d.nonfinite_streak),
        )
