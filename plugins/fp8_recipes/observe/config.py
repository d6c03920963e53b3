"""The typed ``debug:`` section: which numerics statistics and tensor dumps a run records.

It may sit in a recipe (``debug:`` beside ``weights:``) or in the run config (``conf/train.yaml``'s top-level
``debug``, e.g. ``++debug.interval=10`` on the command line); both are merged key by key, the run config winning.
Steps count optimizer steps completed, as ``metrics.jsonl`` rows do: step 1 is the first optimizer step.

    debug:
      interval: 10               # statistics every 10 steps (0 = off, the default)
      layers: 'layers\\.[01]\\.'   # regex searched in module names (default: every linear module)
      tensors: [activations, gradients]
      start_step: 1              # first step with statistics; then every `interval` steps
      end_step: null             # last step with statistics (null = the end of the run)
      micro_batches: 1           # micro-batches measured per due step and module (0 = all; default 1)
      dump: {steps: [1, 100], layers: "linear_fc2", tensors: [activations], dir: dumps}

Problems are reported as ``debug.<key>: ...`` in a :class:`~fp8_recipes.recipe.schema.RecipeError` (a ValueError),
all at once, with the recipe reader's messages (both read through :class:`~fp8_recipes.checks.KeyReader`).
Imports only the schema and checks.py.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from typing import Any

from fp8_recipes.checks import KeyReader, fmt
from fp8_recipes.recipe.schema import ROLES, RecipeError, Role

__all__ = ["DebugConfig", "DumpConfig", "debug_config"]

_ALL_LAYERS = ".*"


@dataclass(frozen=True)
class DumpConfig:
    steps: tuple[int, ...] = ()
    """Steps whose quantized operands are saved (empty = no dumps)."""
    layers: str = _ALL_LAYERS
    """Regex searched in module names (``re.search``): which modules' operands are saved."""
    tensors: tuple[Role, ...] = ROLES
    """Which roles are saved: activations, weights, gradients."""
    dir: str = "dumps"
    """Where, relative to the run directory (or an absolute path)."""

    def path(self, run_dir: str | PathLike) -> Path:
        """The dump directory of the run in ``run_dir``."""
        return Path(run_dir) / self.dir  # (an absolute dir stays itself)


@dataclass(frozen=True)
class DebugConfig:
    interval: int = 0
    """Record statistics every this many steps (0 = off: no cost at all)."""
    layers: str = _ALL_LAYERS
    """Regex searched in module names (``re.search``), e.g. ``"layers\\.3\\."`` or ``"linear_fc2$"``."""
    tensors: tuple[Role, ...] = ROLES
    """Which operand roles get statistics: activations, weights, gradients."""
    start_step: int = 1
    """First step with statistics (steps count from 1, as in metrics.jsonl)."""
    end_step: int | None = None
    """Last step with statistics (None = until the end)."""
    micro_batches: int = 1
    """How many micro-batches of a due step are measured (and dumped) per module and operand: the first ones;
    0 = every micro-batch, merged into one row. Once a module has handed every operand it will get, its observer
    is cleared for the rest of the step, so the other micro-batches cost nothing."""
    dump: DumpConfig = field(default_factory=DumpConfig)
    """Tensor dumps: high-precision operand, FP8 codes, scales, policy."""

    @property
    def enabled(self) -> bool:
        """Whether anything is recorded at all (off: the run attaches no observer)."""
        return self.interval > 0 or bool(self.dump.steps)

    def stats_due(self, step: int) -> bool:
        """Statistics at `step` (1-based)? start_step, start_step + interval, ... up to end_step."""
        return (self.interval > 0 and step >= self.start_step and (self.end_step is None or step <= self.end_step)
                and (step - self.start_step) % self.interval == 0)

    def dump_due(self, step: int) -> bool:
        return step in self.dump.steps

    def stats_module(self, name: str) -> bool:
        return _matches(self.layers, name)

    def dump_module(self, name: str) -> bool:
        return _matches(self.dump.layers, name)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, key: str = "debug") -> DebugConfig:
        """Validate and build; raises RecipeError naming ``<key>.<field>`` for every problem."""
        reader = _DebugReader()
        out = reader.read(key, data)
        if reader.problems:
            raise RecipeError(reader.problems)
        return out


def debug_config(recipe_debug: Mapping[str, Any] | None, run_debug: Mapping[str, Any] | None) -> DebugConfig:
    """The run's DebugConfig: the recipe's ``debug`` section, then the run config's on top (key by key; the
    ``dump`` mapping merged the same way). A problem names the key where it was written (``recipe.debug.<key>`` or
    ``debug.<key>``)."""
    for key, data in (("recipe.debug", recipe_debug), ("debug", run_debug)):
        DebugConfig.from_dict(data, key)  # each part on its own, so the message points at the file that has it
    merged = dict(recipe_debug or {})
    for k, v in (run_debug or {}).items():
        if k == "dump" and isinstance(v, Mapping) and isinstance(merged.get("dump"), Mapping):
            v = {**merged["dump"], **v}
        merged[k] = v
    return DebugConfig.from_dict(merged, "debug")


def _matches(pattern: str, name: str) -> bool:
    return pattern == _ALL_LAYERS or re.search(pattern, name) is not None


class _DebugReader(KeyReader):
    """The shared scalar checks (the recipe reader's messages), plus regexes, role lists and step lists."""

    def regex(self, key: str, value: Any) -> str:
        if value is None:
            return _ALL_LAYERS
        if not isinstance(value, str):
            self.bad(key, f"{fmt(value)} is not a regular expression string (e.g. 'layers\\.[01]\\.')")
            return _ALL_LAYERS
        try:
            re.compile(value)
        except re.error as e:
            self.bad(key, f"{fmt(value)} is not a regular expression ({e}); e.g. 'layers\\.[01]\\.'")
            return _ALL_LAYERS
        return value

    def roles(self, key: str, value: Any) -> tuple[Role, ...]:
        if value is None:
            return ROLES
        if isinstance(value, str):
            value = [value]
        choices = [str(r) for r in ROLES]
        if not isinstance(value, Sequence) or not value:
            self.bad(key, f"{fmt(value)} is not a non-empty list of {' | '.join(choices)}")
            return ROLES
        out = []
        for i, v in enumerate(value):
            role = self.enum(f"{key}[{i}]", v, Role, None)
            if role is not None and role not in out:
                out.append(role)
        return tuple(r for r in ROLES if r in out) or ROLES  # in the canonical order

    def steps(self, key: str, value: Any) -> tuple[int, ...]:
        if value is None:
            return ()
        if isinstance(value, int) and not isinstance(value, bool):
            value = [value]
        if not isinstance(value, Sequence) or isinstance(value, str):
            self.bad(key, f"{fmt(value)} is not a list of steps (e.g. [1, 100])")
            return ()
        return tuple(sorted({self.integer(f"{key}[{i}]", v, 1, 1) for i, v in enumerate(value)}))

    def read(self, key: str, data: Any) -> DebugConfig:
        raw = self.mapping(key, data, {"interval", "layers", "tensors", "start_step", "end_step",
                                          "micro_batches", "dump"})
        d = self.mapping(f"{key}.dump", raw.get("dump"), {"steps", "layers", "tensors", "dir"})
        dump = DumpConfig(steps=self.steps(f"{key}.dump.steps", d.get("steps")),
                          layers=self.regex(f"{key}.dump.layers", d.get("layers")),
                          tensors=self.roles(f"{key}.dump.tensors", d.get("tensors")),
                          dir=self.text(f"{key}.dump.dir", d.get("dir", "dumps"), "dumps"))
        start = self.integer(f"{key}.start_step", raw.get("start_step", 1), 1, 1)
        end = raw.get("end_step")
        if end is not None:
            end = self.integer(f"{key}.end_step", end, 1, None)
            if end is not None and end < start:
                self.bad(f"{key}.end_step", f"{end} is before start_step {start}; set end_step >= start_step "
                                            f"(or null for the end of the run)")
        return DebugConfig(interval=self.integer(f"{key}.interval", raw.get("interval", 0), 0, 0),
                           layers=self.regex(f"{key}.layers", raw.get("layers")),
                           tensors=self.roles(f"{key}.tensors", raw.get("tensors")),
                           start_step=start, end_step=end,
                           micro_batches=self.integer(f"{key}.micro_batches", raw.get("micro_batches", 1), 0, 1),
                           dump=dump)
