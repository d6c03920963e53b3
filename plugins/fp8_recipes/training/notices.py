"""One-line warnings for settings that a run's length makes do nothing (said once, by rank 0, before training).

    for line in run_notices(trainer, recipe, debug): logger.warning(line)

A short run is legitimate (a smoke test, a first try): it is never refused for being short, but a setting it
silently cannot reach (the LR warmup, a recipe's BF16 warmup or a role's FP8 start, a dump step, a periodic
checkpoint) is named with the key to change, as is a setting another one switches off (a save interval without
checkpoints, evaluations without validation batches, a scaling-state reset without a checkpoint to resume, debug
statistics where nothing runs FP8). Imports nothing heavier than the schema.
"""

from __future__ import annotations

from collections.abc import Collection
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


def run_notices(trainer: Any, recipe: Any, debug: Any, start: int = 0,
                fp8_modules: Collection[str] | None = None, *, debug_set: bool = True) -> list[str]:
    """Every one-line warning about settings this run cannot reach (``trainer``: a TrainerConfig). ``start``: the
    optimizer steps already done (a resumed run's checkpoint step); ``fp8_modules``: the modules that run some GEMM
    in FP8 at some step of the run (the plan's), when known; ``debug_set``: False when ``debug`` records only the
    autopilot's statistics (training/autopilot.statistics_for), whose idle case autopilot_notices names."""
    out = []
    last = trainer.max_steps
    if trainer.warmup_steps > last:
        out.append(f"trainer.warmup_steps={trainer.warmup_steps} is longer than the run (trainer.max_steps="
                   f"{last}): the LR warms up over {trainer.lr_warmup_steps} step(s) instead (a tenth "
                   f"of the run); set trainer.warmup_steps <= {last} to choose")
    out += [line for line in (schedule_notice(recipe, last), _amax_reduction_notice(recipe)) if line]
    if trainer.save_interval > 0 and not trainer.save_checkpoints:
        out.append(f"trainer.save_interval={trainer.save_interval} does nothing: trainer.save_checkpoints=false "
                   f"writes no checkpoint; set trainer.save_checkpoints=true, or trainer.save_interval=0")
    elif trainer.save_interval >= last:
        out.append(f"trainer.save_interval={trainer.save_interval} is not shorter than the run (trainer.max_steps="
                   f"{last}): only the final checkpoint is written; set trainer.save_interval < {last}")
    if trainer.eval_iters == 0 and trainer.eval_interval > 0:
        out.append(f"trainer.eval_interval={trainer.eval_interval} never evaluates: trainer.eval_iters=0 reads no "
                   f"validation batch; set trainer.eval_iters >= 1, or trainer.eval_interval=0")
    if trainer.reset_scaling_state and start == 0:
        out.append(f"trainer.reset_scaling_state=true does nothing: the run starts at step 0 with no checkpoint to "
                   f"resume (trainer.resume={trainer.resume}); drop it, or point trainer.resume at a checkpoint")
    if debug is not None:
        out += _idle_debug_notices(debug)
    if debug is not None and debug.enabled:
        out += _debug_notices(debug, recipe, last, start, fp8_modules, debug_set)
    return out


def _amax_reduction_notice(recipe: Any) -> str | None:
    """recipe.amax_reduction set where no policy uses delayed scaling: current, block and NVFP4 scaling take each
    rank's own amax (as in Megatron-Core and TE), so the key reduces nothing (the default says nothing)."""
    from fp8_recipes.recipe.schema import AmaxReduction, Scaling

    if recipe.amax_reduction is AmaxReduction.DATA_TENSOR or any(
            p.scaling is Scaling.DELAYED for _, p in recipe.stated_policies()):
        return None
    return (f"recipe.amax_reduction={recipe.amax_reduction} does nothing: no role of recipe {recipe.name} uses delayed "
            f"scaling, the only one whose amaxes it reduces (current, block and NVFP4 scaling take each rank's own); "
            f"drop it")


def _idle_debug_notices(debug: Any) -> list[str]:
    """``debug`` settings of a kind that records nothing: statistics settings at interval 0, dump settings
    without dump steps (each against DebugConfig's defaults: a key left as it is says nothing)."""
    from fp8_recipes.observe.config import DebugConfig

    default, out = DebugConfig(), []
    if debug.interval == 0:
        mine = ("layers", "tensors", "start_step", "end_step") + (() if debug.dump.steps else ("micro_batches",))
        given = [k for k in mine if getattr(debug, k) != getattr(default, k)]
        if given:
            out.append(f"debug.{_keys(given)} does nothing: debug.interval=0 records no statistics; set "
                       f"debug.interval (e.g. 10), or drop it")
    if not debug.dump.steps:
        given = [k for k in ("layers", "tensors", "dir") if getattr(debug.dump, k) != getattr(default.dump, k)]
        if given:
            out.append(f"debug.dump.{_keys(given)} does nothing: debug.dump.steps is empty, so nothing is dumped; "
                       f"give debug.dump.steps (e.g. [1, 100]), or drop it")
    return out


def _keys(names: list[str]) -> str:
    return names[0] + (f" (and {', '.join(names[1:])})" if names[1:] else "")


def _debug_notices(debug: Any, recipe: Any, last: int, start: int, fp8_modules: Collection[str] | None,
                   debug_set: bool = True) -> list[str]:
    out = []
    if not recipe.is_fp8:  # (statistics the user did not ask for: the autopilot's notice says it acts on nothing)
        return [(f"debug: recipe {recipe.name} runs no GEMM in FP8, and the numerics statistics and dumps observe "
                 f"FP8 quantization only: nothing is recorded; train with an FP8 recipe (+recipe=hybrid)")] \
            if debug_set else []
    late = [s for s in debug.dump.steps if s > last]
    if late:
        out.append(f"debug.dump.steps: {', '.join(map(str, late))} after the last step (trainer.max_steps="
                   f"{last}; steps count from 1): never dumped; pick steps in 1..{last}")
    done = [s for s in debug.dump.steps if s <= start]
    if done:
        out.append(f"debug.dump.steps: {', '.join(map(str, done))} at or before the resumed step {start}: never "
                   f"dumped in this run; pick steps in {start + 1}..{last}")
    if debug.interval > 0 and debug.start_step > last:
        out.append(f"debug.start_step={debug.start_step} is after the last step (trainer.max_steps="
                   f"{last}): no statistics are recorded; lower it")
    elif debug.interval > 0 and debug.end_step is not None and debug.end_step <= start:
        out.append(f"debug.end_step={debug.end_step} is at or before the resumed step {start}: no statistics are "
                   f"recorded in this run; raise it, or set it to null")
    if fp8_modules:  # (none at all: the plan's own warning says so)
        for key, pattern, wanted, on in (("debug.layers", debug.layers, debug.interval > 0, debug.stats_module),
                                         ("debug.dump.layers", debug.dump.layers, bool(debug.dump.steps),
                                          debug.dump_module)):
            if wanted and not any(on(m) for m in fp8_modules):
                out.append(f"{key}={pattern!r} matches no module that runs FP8 (of {len(fp8_modules)}, e.g. "
                           f"{min(fp8_modules)!r}): nothing is recorded; widen it")
    return out
