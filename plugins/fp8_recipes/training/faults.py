"""The non-finite fault policy (``trainer.on_nonfinite``): what the training loop does after a step whose loss or
gradient norm was not finite on some rank.

Such a step is skipped on every rank by the engine (one flag, summed over every rank, training/engine.py): weights,
optimizer state and the LR schedule stay as they were (Megatron also does not advance its scheduler on a skipped
iteration), and the precision backend forgets what the step recorded (``skip_step``). After
``trainer.max_consecutive_skips`` in a row, :meth:`NonFinitePolicy.decide` says: ``on_nonfinite=skip_then_bf16``
runs the next ``fallback_bf16_steps`` steps under ``precision.high_precision()``; ``stop`` (or the limit reached
again inside a fallback) ends the run. The loop then checkpoints ``checkpoints/step_N`` (N = the last step run) and
raises :class:`~fp8_recipes.training.errors.NonFiniteStop` with :meth:`Stop.message`: the skipped steps left
weights, optimizer and LR schedule as the last good step did, and the data position moves past the bad batches, so
the run can continue from there under a lower ``trainer.lr`` (a resumed run takes the configured LR, not the
checkpoint's) or another recipe. The one-line message names the directory.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from fp8_recipes.training.config import TrainerConfig
from fp8_recipes.training.engine import StepResult

__all__ = ["NonFinitePolicy", "Stop", "Verdict"]


@dataclasses.dataclass(frozen=True)
class Stop:
    """The run stops: ``reason`` in one line; ``first_bad`` is the first step of the bad run (1-based)."""

    reason: str
    first_bad: int

    def message(self, saved: Path | None) -> str:
        """The one line of a non-finite stop: what happened, and where the last good state is (``saved``, the
        checkpoint written after the stop, or None when checkpoints are off)."""
        if saved is None:
            return (f"{self.reason}; the weights are those before step {self.first_bad}, not checkpointed "
                    f"(trainer.save_checkpoints=false; lower trainer.lr, check the data, or resume from an earlier "
                    f"checkpoint)")
        return (f"{self.reason}; the weights from before step {self.first_bad} are checkpointed in {saved} (continue "
                f"with trainer.resume={saved} and a lower trainer.lr or another recipe)")


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What to do after a step: the console lines to show (rank 0), and whether to stop."""

    notes: tuple[str, ...] = ()
    stop: Stop | None = None


class NonFinitePolicy:
    """Counts skipped steps and decides, after each step, between going on, the BF16 fallback, and stopping."""

    def __init__(self, cfg: TrainerConfig) -> None:
        self.cfg = cfg
        self.skipped_steps = 0  # in all
        self.in_a_row = 0
        self.fallback_left = 0  # steps of the current BF16 fallback still to run
        self.fallbacks = 0

    @property
    def in_fallback(self) -> bool:
        """The next step runs under ``precision.high_precision()`` (read before the step; :meth:`decide` moves on)."""
        return self.fallback_left > 0

    def decide(self, result: StepResult, done: int) -> Verdict:
        """After the step that completed iteration ``done`` (1-based): count it, then go on, fall back or stop."""
        in_fallback = self.in_fallback  # the step just run ran in the fallback
        self.fallback_left = max(self.fallback_left - 1, 0)
        if not result.skipped:
            self.in_a_row = 0
            return Verdict()
        self.skipped_steps, self.in_a_row = self.skipped_steps + 1, self.in_a_row + 1
        skip = (f"step {done}: non-finite loss {result.loss:.4g} or grad norm {result.grad_norm:.4g}: optimizer step "
                f"skipped ({self.in_a_row} in a row, {self.skipped_steps} in all)")
        cfg = self.cfg
        if self.in_a_row < cfg.max_consecutive_skips:
            return Verdict((skip,))
        if cfg.on_nonfinite == "stop" or in_fallback:
            why = "in the BF16 fallback too" if in_fallback else "trainer.on_nonfinite=stop"
            reason = (f"trainer.max_consecutive_skips: {self.in_a_row} steps in a row (to step {done}) had a "
                      f"non-finite loss or gradient ({why})")
            return Verdict((skip,), Stop(reason, first_bad=done - self.in_a_row + 1))
        self.fallback_left, self.in_a_row, self.fallbacks = cfg.fallback_bf16_steps, 0, self.fallbacks + 1
        fallback = (f"step {done}: {cfg.max_consecutive_skips} skipped steps in a row: the next "
                    f"{cfg.fallback_bf16_steps} steps run in BF16 (trainer.fallback_bf16_steps)")
        return Verdict((skip, fallback))
