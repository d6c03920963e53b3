"""The training loop's progress bar: tqdm's when it is installed, else :class:`PlainBar`, a plain line per step (a
bare GPU image may lack tqdm)."""

from __future__ import annotations

from typing import Any

__all__ = ["PlainBar", "progress_bar"]


class PlainBar:
    """What the loop (and bench/compare.py) use of tqdm, as plain lines."""

    def __init__(self, *, total: int, initial: int = 0, disable: bool = False, **_: Any):
        self.n, self.total, self.disable = initial, total, disable

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:  # the loop calls it once per step
        if not self.disable:
            print(f"train {self.n}/{self.total} | {text}", flush=True)

    def write(self, text: str) -> None:
        print(text, flush=True)

    def close(self) -> None:
        pass


def progress_bar(*, total: int, initial: int, disable: bool) -> Any:
    """The loop's bar over optimizer steps: tqdm's, or a :class:`PlainBar` without tqdm."""
    try:
        from tqdm.auto import tqdm  # optional: a bare GPU image may lack it
    except ImportError:
        return PlainBar(total=total, initial=initial, disable=disable)
    return tqdm(total=total, initial=initial, desc="train", unit="step", disable=disable, dynamic_ncols=True,
                mininterval=0.5)
