"""The LR schedule: linear warmup, then cosine down to ``min_lr`` at ``max_steps`` (optionally scaled by the global
batch, ``trainer.lr_scaling``), and where a run stands on it.

    schedule = LRSchedule.of(cfg)     # cfg: TrainerConfig (training/config.py)
    engine.set_lr(schedule.lr())      # the LR of the next optimizer step
    schedule.advance()                # after an optimizer step; a skipped step does not advance it (Megatron's rule)

A checkpoint holds only the optimizer steps taken (``last_epoch``): the schedule itself is the configured one, so a
resumed run under another ``trainer.lr`` follows the new schedule from the checkpoint's position.
"""

from __future__ import annotations

import math

from fp8_recipes.training.config import TrainerConfig

__all__ = ["LRSchedule", "lr_at", "peak_lr", "scaled_lr"]


def scaled_lr(lr: float, global_batch_size: int, base_global_batch_size: int) -> float:
    """Linear scaling rule: lr × global_batch_size / base_global_batch_size."""
    return lr * global_batch_size / base_global_batch_size


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, max_steps: int) -> float:
    """LR for 0-based ``step``: with n = step + 1, lr·n/warmup while n ≤ warmup, then cosine to min_lr at n = max_steps."""
    n = step + 1
    if n <= warmup_steps:
        return lr * n / warmup_steps
    if max_steps <= warmup_steps:
        return lr
    progress = min(1.0, (n - warmup_steps) / (max_steps - warmup_steps))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def peak_lr(cfg: TrainerConfig) -> tuple[float, float]:
    """(lr, min_lr) of the run: as configured, or scaled by the global batch when trainer.lr_scaling asks."""
    if not cfg.lr_scaling.enabled:
        return cfg.lr, cfg.min_lr
    base = cfg.lr_scaling.base_global_batch_size
    return scaled_lr(cfg.lr, cfg.global_batch_size, base), scaled_lr(cfg.min_lr, cfg.global_batch_size, base)


class LRSchedule:
    """The configured schedule (:func:`lr_at`) and the optimizer steps taken on it (``last_epoch``, the name
    schedulers give it). Checkpoints save and restore it through ``state_dict`` / ``load_state_dict``."""

    def __init__(self, *, lr: float, min_lr: float, warmup_steps: int, max_steps: int) -> None:
        self.peak, self.min_lr, self.warmup_steps, self.max_steps = lr, min_lr, warmup_steps, max_steps
        self.last_epoch = 0

    @classmethod
    def of(cls, cfg: TrainerConfig) -> LRSchedule:
        lr, min_lr = peak_lr(cfg)
        return cls(lr=lr, min_lr=min_lr, warmup_steps=cfg.lr_warmup_steps, max_steps=cfg.max_steps)

    def lr(self) -> float:
        """The LR of the next optimizer step."""
        return lr_at(self.last_epoch, lr=self.peak, min_lr=self.min_lr, warmup_steps=self.warmup_steps,
                     max_steps=self.max_steps)

    def advance(self) -> None:
        """One optimizer step was taken (a skipped step leaves the schedule where it was)."""
        self.last_epoch += 1

    def state_dict(self) -> dict:
        return {"last_epoch": self.last_epoch}

    def load_state_dict(self, state: dict) -> None:
        self.last_epoch = int(state["last_epoch"])
