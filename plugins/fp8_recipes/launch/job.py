"""What both Slurm launch paths do to a training job before it is submitted: check its config on the submitting host,
fix its run directory and make it resumable.

    cfg = composed train config (with or without the `launcher` group)
    check_train_config(cfg)                       # the same checks scripts/train.py runs first (no torch)
    run_dir = fixed_run_dir(cfg)                  # absolute; `${now:...}` resolved once, here
    overrides = resumable_overrides(user_overrides, run_dir)   # + run_dir=<dir> trainer.resume=auto

Why fix run_dir: conf/train.yaml's default run_dir holds ``${now:...}``, which every process would resolve for itself
(two tasks a second apart, or a requeued run an hour later, would write to different directories); a requeued run
must find its own checkpoints, so every task of every attempt gets the same absolute directory, with
``trainer.resume=auto`` (a fresh start when it holds no checkpoint yet).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable

from fp8_recipes.megatron.model_config import layout_of
from fp8_recipes.plan.precision import Hardware, PrecisionPlan
from fp8_recipes.recipe.schema import RecipeError
from fp8_recipes.training.config import check_run_config
from fp8_recipes.training.run import check_plan, resolve_recipe  # (run.py imports torch only inside its functions)

__all__ = ["check_train_config", "fixed_run_dir", "resumable_overrides", "override_key", "quote_override",
           "default_job_name", "without_launcher"]

_PLAIN = re.compile(r"^[A-Za-z0-9_./:+-]+$")  # needs no quoting in Hydra's override grammar


def override_key(override: str) -> str:
    """``+trainer.resume=auto`` -> ``trainer.resume``; ``hydra/launcher=slurm`` -> ``hydra/launcher``."""
    return override.split("=", 1)[0].lstrip("+~")


def quote_override(key: str, value: str) -> str:
    """``key=value`` for Hydra's command line, quoting a value with spaces, commas, brackets or quotes."""
    if _PLAIN.match(value):
        return f"{key}={value}"
    return f"{key}='" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def without_launcher(cfg: Any) -> Any:
    """A copy of a composed config without the `launcher` (and `hydra`) nodes: what scripts/train.py checks."""
    from omegaconf import OmegaConf, open_dict

    plain = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False)) if OmegaConf.is_config(cfg) else \
        OmegaConf.create(dict(cfg))
    with open_dict(plain):
        for key in ("launcher", "hydra"):
            plain.pop(key, None)
    return plain


JOB_GPU = (9, 0)
"""The compute capability a GPU job (``trainer.device: gpu``) is planned for on the submitting host: Hopper with
Transformer Engine. The checks made with it (:func:`~fp8_recipes.training.run.check_plan`) hold on any FP8 GPU."""


def check_train_config(cfg: Any, world_size: int | None = None) -> None:
    """The checks scripts/train.py makes before it builds anything (groups, values, run_dir, the recipe, the parallel
    layout at the job's ``world_size`` processes), here on the submitting host, so that a typo costs a second
    instead of a queue wait; ValueError names the key. For a GPU job also the recipe's plan against the layout and
    the model (TE's FP8 shapes, sequence parallelism's amax group, recompute), planned for an FP8 GPU with TE; a
    recipe whose plan depends on which GPU (``backend: te`` with MXFP8, say) is left to the job's GPU."""
    plain = without_launcher(cfg)
    trainer = check_run_config(plain, world_size)
    recipe = resolve_recipe(plain)
    if trainer.device != "gpu":
        return
    try:
        plan = PrecisionPlan(recipe, layout_of(plain.model), Hardware.target(JOB_GPU))
    except RecipeError:
        return  # scripts/train.py decides on the job's GPU, in one line
    check_plan(trainer, plain.model, plan)


def fixed_run_dir(cfg: Any) -> Path:
    """The job's run directory, resolved once (``${now:...}`` included) and made absolute."""
    return Path(str(cfg.run_dir)).expanduser().resolve()


def resumable_overrides(overrides: Iterable[str], run_dir: Path) -> list[str]:
    """The job's overrides with ``run_dir`` fixed and ``trainer.resume=auto`` unless the user chose a resume."""
    kept = [o for o in overrides if override_key(o) != "run_dir"]
    if not any(override_key(o) == "trainer.resume" for o in kept):
        kept.append("trainer.resume=auto")
    return [*kept, quote_override("run_dir", str(run_dir))]


def default_job_name(cfg: Any) -> str:
    recipe = cfg.get("recipe") if hasattr(cfg, "get") else None
    name = recipe.get("name") if hasattr(recipe, "get") else None
    return f"fp8-{name or 'bf16'}"
