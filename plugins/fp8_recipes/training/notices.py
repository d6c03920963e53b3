"""One-line warnings for settings that a run's length makes do nothing (said once, by rank 0, before training).

    for line in run_notices(trainer, recipe, debug): logger.warning(line)

A short run is legitimate (a smoke test, a first try): it is never refused for being short, but a setting it
silently cannot reach (the LR warmup, a recipe's BF16 warmup or a role's FP8 start, a dump step) is named with
the key to change. Imports nothing heavier than the schema.
"""

from __future__ import annotations

from typing import Any

__all__ = ["run_notices", "schedule_notice"]

ROLES = ("weights", "activations", "gradients")


def schedule_notice(recipe: Any, max_steps: int) -> str | None:
    """The recipe's FP8 roles whose schedule starts at or after ``max_steps`` (0-based steps, as plan.txt prints
    them), as one line, or None when every FP8 role runs FP8 at some step of the run."""
    fp8_roles = [r for r in ROLES if str(recipe.policy(r).scaling) != "none"]
    late = [r for r in fp8_roles if recipe.schedule.role_start(r) >= max_steps]
    if not late:
        return None
    warmup = recipe.schedule.bf16_warmup_steps
    if len(late) == len(fp8_roles) and warmup >= max_steps:
        return (f"recipe.schedule.bf16_warmup_steps={warmup}: the whole run (trainer.max_steps={max_steps}) is BF16 "
                f"warmup, no GEMM runs FP8; raise trainer.max_steps above {warmup} or lower "
                f"recipe.schedule.bf16_warmup_steps")
    keys = ", ".join(f"recipe.schedule.enable.{r}={recipe.schedule.enable[r]}" for r in late)
    what = "every FP8 role" if len(late) == len(fp8_roles) else " and ".join(late)
    last = max(recipe.schedule.role_start(r) for r in late)
    return (f"{keys}: {what} stay BF16 for the whole run (trainer.max_steps={max_steps}: steps 0-{max_steps - 1}); "
            f"raise trainer.max_steps above {last} or lower {'it' if len(late) == 1 else 'them'}")


def run_notices(trainer: Any, recipe: Any, debug: Any) -> list[str]:
    """Every one-line warning about settings this run cannot reach (``trainer``: a TrainerConfig)."""
    out = []
    if trainer.warmup_steps > trainer.max_steps:
        out.append(f"trainer.warmup_steps={trainer.warmup_steps} is longer than the run (trainer.max_steps="
                   f"{trainer.max_steps}): the LR warms up over {trainer.lr_warmup_steps} step(s) instead (a tenth "
                   f"of the run); set trainer.warmup_steps <= {trainer.max_steps} to choose")
    line = schedule_notice(recipe, trainer.max_steps)
    if line:
        out.append(line)
    if debug is not None:
        late = [s for s in debug.dump.steps if s > trainer.max_steps]
        if late:
            out.append(f"debug.dump.steps: {', '.join(map(str, late))} after the last step (trainer.max_steps="
                       f"{trainer.max_steps}; steps count from 1): never dumped; pick steps in 1..{trainer.max_steps}")
        if debug.interval > 0 and debug.start_step > trainer.max_steps:
            out.append(f"debug.start_step={debug.start_step} is after the last step (trainer.max_steps="
                       f"{trainer.max_steps}): no statistics are recorded; lower it")
    return out
