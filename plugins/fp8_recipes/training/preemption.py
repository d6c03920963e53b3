"""Preemption: SIGTERM / SIGUSR1 (Slurm's preemption and ``--signal``) become a flag the training loop reads at the
next step boundary.

While :func:`~fp8_recipes.training.loop.train` runs (in the main thread) the signals only set the flag; the previous
handlers come back when it returns. The flag rides in the per-step all-reduce that already carries the non-finite
flag (summed over every rank, training/engine.py), so all ranks agree on the step after which to stop, even when
only one rank got the signal: that step finishes (its metrics row says ``preempted``), the checkpoint
``checkpoints/step_N`` is written, and the summary's ``preempted`` names the signal and step (scripts/train.py then
exits with ``PREEMPTED_EXIT``; ``trainer.resume=auto`` continues at step N + 1).
"""

from __future__ import annotations

import signal
import threading
from typing import Any, Self

__all__ = ["PreemptionSignals"]


class PreemptionSignals:
    """SIGTERM / SIGUSR1 (Slurm's preemption and ``--signal``) set :attr:`received` instead of ending the process.

    A context manager: handlers are installed on entry and the previous ones restored on exit, in the main thread
    only (elsewhere Python cannot install handlers; it is then a no-op that never reports a signal).
    """

    SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGUSR1") if hasattr(signal, name))

    def __init__(self) -> None:
        self.received: str | None = None  # the first signal's name
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:  # only a flag: the loop acts at the next step boundary
        if self.received is None:
            self.received = signal.Signals(signum).name

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.getsignal(sig)
                signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
