"""The small checks every config reader shares: did-you-mean hints, unknown keys, choices, and the collecting reader.

Two styles of reader use them, and each is right for its input:

- :class:`KeyReader` *collects* one message per bad key and goes on reading, so a recipe file (recipe/schema.py) or a
  ``debug:`` section (observe/config.py) is reported whole, all problems at once;
- the run-config checks (training/config.py, megatron/model_config.py, launch/settings.py) *raise* the first
  problem as a one-line ValueError, as Hydra's own errors come, through :func:`unknown_key` and :func:`choice_error`.

Either way a message names the dotted key, the bad value and the fix, and a misspelt name gets
``(did you mean 'x'?)``. This module is the bottom floor: it imports nothing of ours and no third-party package.
"""

from __future__ import annotations

import argparse
import sys

import difflib
import math
from collections.abc import Callable, Iterable, Mapping
from enum import StrEnum
from typing import Any

__all__ = ["ConfigError", "KeyReader", "check_keys", "choice_error", "did_you_mean", "first_problem", "fmt", "is_int",
           "is_number", "unknown_key"]


def did_you_mean(word: Any, choices: Iterable[Any], hints: Mapping[str, str] | None = None) -> str:
    """`` (did you mean 'x'?)`` for the closest of `choices`, or nothing: the tail of a one-line error.

    ``hints``: spellings other tools use, mapped to ours (lower-case keys), tried before the closest match."""
    hint = hints.get(str(word).lower()) if hints else None
    if hint:
        return f" (did you mean '{hint}'?)"
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def fmt(value: Any) -> str:
    """A value as a message shows it, in the YAML the user writes (not Python's ``None`` / ``True``): strings quoted
    (``'mxfp9'``), ``null``, ``true`` / ``false``, lists and mappings in flow style (``[1, null]``, ``{a: 1}``),
    numbers as printed (``3``)."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{fmt(k)}: {fmt(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(fmt(v) for v in value) + "]"
    return str(value)


def is_int(value: Any) -> bool:
    """An integer, and not a bool (YAML's ``true`` is an int to Python)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite int or float, and not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class ConfigError(ValueError):
    """A user error: a bad config, recipe, command line or input, with the dotted key and the fix in one line.
    scripts/train.py prints these as ``error: ...`` lines; any other exception is a bug and keeps its traceback."""


def unknown_key(group: str, key: str, known: Iterable[str]) -> ConfigError:
    """The error for ``group.key`` that is not one of `known` (returned, for the caller to raise)."""
    return ConfigError(f"{group}.{key}: unknown key{did_you_mean(key, known)}; known keys: {', '.join(sorted(known))}")


def check_keys(group: str, given: Iterable[str], known: Iterable[str]) -> None:
    """Raise :func:`unknown_key` for the first (alphabetically) of `given` that is not in `known`."""
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise unknown_key(group, unknown[0], known)


def choice_error(key: str, value: Any, choices: Iterable[Any]) -> ConfigError:
    """The error for ``key=value`` that is not one of `choices` (None is written ``null``), returned for the caller
    to raise: ``trainer.device='gpx': choose one of auto | gpu (did you mean 'gpu'?)``."""
    choices = list(choices)
    listed = " | ".join("null" if c is None else str(c) for c in choices)
    hint = did_you_mean(value, [c for c in choices if c is not None])
    return ConfigError(f"{key}={value!r}: choose one of {listed}{hint}")


class KeyReader:
    """Reads a mapping key by key, collecting one ``dotted.key: message`` per problem in :attr:`problems`.

    Each scalar reader returns the value it read, or `default` after recording a problem, so reading goes on and a
    file's problems are reported all at once. Subclasses add the structured readers of their section
    (recipe/schema.py's recipe reader, observe/config.py's ``debug:`` reader); :attr:`value_hints` maps spellings of
    other tools to ours for enum values (never for key names)."""

    value_hints: Mapping[str, str] = {}

    def __init__(self) -> None:
        self.problems: list[str] = []
        self._bad_keys: set[str] = set()

    def bad(self, key: str, msg: str) -> None:
        """One problem of `key` (its first: a later one about the same key is what the first one left behind)."""
        if key not in self._bad_keys:
            self._bad_keys.add(key)
            self.problems.append(f"{key}: {msg}")

    def has_problem(self, key: str) -> bool:
        """Whether `key` or a key below it was reported (a rule reading its value would read a default)."""
        return any(k == key or k.startswith(f"{key}.") for k in self._bad_keys)

    def enum(self, key: str, value: Any, kind: type[StrEnum], default):
        choices = [e.value for e in kind]
        if isinstance(value, kind):
            return value
        if isinstance(value, str) and value.lower() in choices:
            return kind(value.lower())
        self.bad(key, f"{fmt(value)} is not one of {' | '.join(choices)}"
                      f"{did_you_mean(value, choices, self.value_hints)}")
        return default

    def integer(self, key: str, value: Any, minimum: int, default: int, maximum: int | None = None) -> int:
        if not is_int(value):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                self.bad(key, f"{fmt(value)} is not an integer (expected an integer >= {minimum})")
                return default
        if value < minimum or (maximum is not None and value > maximum):
            rng = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
            self.bad(key, f"{value} is out of range (expected an integer {rng})")
            return default
        return value

    def number(self, key: str, value: Any, lo: float, hi: float, default: float, lo_open: bool = False,
               hi_open: bool = False) -> float:
        if not is_number(value):
            self.bad(key, f"{fmt(value)} is not a finite number")
            return default
        if value < lo or (lo_open and value == lo) or value > hi or (hi_open and value == hi):
            rng = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
            self.bad(key, f"{value} is out of range (expected a number in {rng})")
            return default
        return float(value)

    def boolean(self, key: str, value: Any, default: bool) -> bool:
        if isinstance(value, bool):
            return value
        self.bad(key, f"{fmt(value)} is not a boolean (expected true or false)")
        return default

    def text(self, key: str, value: Any, default: str) -> str:
        if isinstance(value, str):
            return value
        self.bad(key, f"{fmt(value)} is not a string")
        return default

    def mapping(self, key: str, value: Any, allowed: set[str]) -> dict[str, Any]:
        """`value`'s entries whose keys are `allowed` (None reads as empty); each other key is one problem."""
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            self.bad(key, f"{fmt(value)} is not a mapping (expected keys {', '.join(sorted(allowed))})")
            return {}
        out = {}
        for k, v in value.items():
            if k not in allowed:
                where = f"{key}.{k}" if key else str(k)
                self.bad(where, f"unknown key{did_you_mean(k, sorted(allowed))}; allowed: {', '.join(sorted(allowed))}")
            else:
                out[k] = v
        return out


MAX_ERROR_CHARS = 1000
"""An error line is cut here: a value it quotes may be a whole file (a text file passed where a name goes)."""


def clipped(line: str) -> str:
    """An error line of at most MAX_ERROR_CHARS characters (the cut says how long it was)."""
    return line if len(line) <= MAX_ERROR_CHARS else f"{line[:MAX_ERROR_CHARS]}... ({len(line):,} characters)"


def first_problem(e: BaseException) -> str:
    """A user error's one line: the first of the problems it names (a recipe with several wrong keys names each on
    a line of its own: ``fp8-recipes validate`` lists them all), and how many more there are."""
    lines = [line for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
    more = len(lines) - 1
    return lines[0] + (f" (and {more} more problem{'s' if more > 1 else ''})" if more else "")


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose usage errors are one ``error:`` line (not usage + ``prog: error:``), exit code 2;
    the subcommands' parsers are of this class too. The fp8-recipes CLI and the scripts use it."""

    def error(self, message: str):
        print(f"error: {self.prog}: {message}; see {self.prog} --help", file=sys.stderr)
        sys.exit(2)


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``minimum`` (a usage error otherwise, one line with the parser above)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be >= {minimum}")
        return value
    return parse
