"""What the training loop needs from a precision backend (the PrecisionPlan's executor), and the trivial backend.

The backends (backends/emulated.py, backends/te.py; observe/recorder.py wraps either) satisfy :class:`Precision`
structurally; the loop (training/loop.py) calls it at each step's start, after its optimizer step or skip, and
around full-precision evaluation and the BF16 fallback; checkpoints save and restore its state.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

__all__ = ["NoPrecision", "Precision"]


@runtime_checkable
class Precision(Protocol):
    """What the loop needs from a precision backend (the PrecisionPlan's executor)."""

    full_precision_eval_interval: int
    """Run a validation in full precision every this many steps (0 = never)."""

    def begin_step(self, step: int) -> str:
        """Apply the plan for ``step`` (0-based); return a short stage label for the progress bar."""

    def high_precision(self) -> AbstractContextManager[None]:
        """Context in which every GEMM runs in high precision (full-precision evaluation)."""

    def after_optimizer_step(self, step: int) -> None:
        """Called after the optimizer step of ``step`` (e.g. delayed-scaling amax/scale update)."""

    def skip_step(self, step: int) -> None:
        """The optimizer step of ``step`` was skipped (non-finite loss or gradient): forget what the step recorded
        (delayed-scaling amaxes), so no scale is ever derived from it."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state_dict: dict) -> None: ...


class NoPrecision:
    """The trivial backend: the model's own dtype throughout (BF16 or FP32 runs, tests)."""

    full_precision_eval_interval = 0

    def __init__(self, label: str = "bf16"):
        self.label = label

    def begin_step(self, step: int) -> str:
        return self.label

    def high_precision(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def after_optimizer_step(self, step: int) -> None:
        pass

    def skip_step(self, step: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass
