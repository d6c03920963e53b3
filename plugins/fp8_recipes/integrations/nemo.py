"""NeMo 2.x (``nemo.lightning``): a recipe as a ``MegatronMixedPrecision`` plugin plus a Lightning callback.

    from fp8_recipes.integrations.nemo import FP8RecipePrecision
    precision = FP8RecipePrecision("safe")
    trainer = nl.Trainer(..., plugins=precision, callbacks=precision.callbacks())

:class:`FP8RecipePrecision` subclasses ``nemo.lightning.pytorch.plugins.MegatronMixedPrecision``. When Megatron-Core's
own config can say the whole recipe it passes the recipe's fp8 fields to NeMo (``fp8_recipe="custom"`` + our
quantizer factory for per-role mixes; NeMo's ``update_config_with_dtype_overrides`` copies them onto the model
config, through a DtypeConfig subclass that also carries ``fp8_quantizer_factory`` / ``tp_only_amax_red``) and
``callbacks()`` is empty. Otherwise (BF16 warmup, stages, BF16 module patterns, first/last-layer BF16 with delayed
scaling) it is plain BF16 and ``callbacks()`` returns the :class:`FP8ScheduleCallback` that runs the recipe through
our TE backend at each ``on_train_batch_start`` (one Lightning batch = one optimizer step under MegatronStrategy).
Forgetting the callback then fails at the first training step instead of training BF16 silently.

Checked against nemo-toolkit 2.7.3 (``lightning/pytorch/plugins/mixed_precision.py``,
``strategies/megatron_strategy.py``). NeMo and Lightning are imported on first use only
(``pip install fp8-recipes[nemo]``).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

from fp8_recipes.integrations.common import (
    EXTRA_FIELDS, NeedsPluginOwned, ScheduleDriver, activate_quantizer_factory, as_recipe, log_applied,
    megatron_precision, plugin_owned_plan, with_fields,
)
from fp8_recipes.recipe.schema import Recipe

__all__ = ["FP8RecipePrecision", "FP8ScheduleCallback"]

RecipeRef = Recipe | str | Path | Mapping[str, Any]
_NEMO_ARGS = ("fp8", "fp8_recipe", "fp8_margin", "fp8_amax_history_len", "fp8_amax_compute_algo",
              "first_last_layers_bf16", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16")
"""The recipe's Megatron-Core fields MegatronMixedPrecision.__init__ takes by these names (the rest: EXTRA_FIELDS)."""


def _schedule_callback_class(base: type) -> type:
    class FP8ScheduleCallback(base):
        """Plugin-owned precision in NeMo 2's Lightning loop: BF16 warmup, stages, per-layer / per-module BF16."""

        def __init__(self, recipe: RecipeRef, *, max_steps: int | None = None):
            super().__init__()
            self.driver = ScheduleDriver(recipe, max_steps=max_steps)

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            chunks = getattr(trainer.strategy, "megatron_parallel", None) or [pl_module]
            self.driver.attach(list(chunks))
            plugin = getattr(trainer.strategy, "precision_plugin", None)
            if hasattr(plugin, "scheduled_by"):
                plugin.scheduled_by = self

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.driver.begin_step(trainer.global_step)  # optimizer steps done so far = this step's 0-based index

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.driver.end_step(trainer.global_step - 1)

    return FP8ScheduleCallback


def _precision_class(base: type, dtype_config: type, callback: type) -> type:
    class FP8RecipePrecision(base):
        """``MegatronMixedPrecision`` built from a recipe (pack name, YAML path, mapping or Recipe).

        ``owner`` says who runs FP8: "native" (Megatron-Core, from the config fields) or "plugin" (the
        FP8ScheduleCallback from ``callbacks()``, with the model built BF16). Other keyword arguments go to
        MegatronMixedPrecision (e.g. ``params_dtype``, ``fp8_param_gather``)."""

        def __init__(self, recipe: RecipeRef, *, precision: str = "bf16-mixed",
                     compute_capability: tuple[int, int] | None = None, num_layers: int | None = None,
                     max_steps: int | None = None, **kwargs: Any):
            self.recipe = as_recipe(recipe)
            self.scheduled_by: Any = None
            self._max_steps = max_steps
            try:
                mp = megatron_precision(self.recipe, compute_capability=compute_capability, num_layers=num_layers)
            except NeedsPluginOwned:
                plugin_owned_plan(self.recipe, compute_capability=compute_capability, num_layers=num_layers)
                self.owner = "plugin"
                super().__init__(precision=precision, **kwargs)
                return
            self.owner = "native"
            super().__init__(precision=precision, **{k: v for k, v in mp.fields.items() if k in _NEMO_ARGS},
                             **kwargs)
            self.dtype_config = with_fields(self.dtype_config, dtype_config,
                                            {k: v for k, v in mp.fields.items() if k in EXTRA_FIELDS})
            activate_quantizer_factory(mp)
            log_applied(mp, self.recipe, "NeMo 2")

        def callbacks(self) -> list[Any]:
            """What the trainer needs besides this plugin: [FP8ScheduleCallback] when plugin-owned, else []."""
            return [callback(self.recipe, max_steps=self._max_steps)] if self.owner == "plugin" else []

        def train_step_context(self) -> Any:
            if self.owner == "plugin" and self.scheduled_by is None:
                raise RuntimeError(f"FP8RecipePrecision('{self.recipe.name}') runs FP8 from FP8ScheduleCallback, "
                                   f"which is not in the trainer's callbacks; pass callbacks=precision.callbacks()")
            return super().train_step_context()

    return FP8RecipePrecision


@lru_cache(maxsize=1)
def _classes() -> dict[str, type]:
    """NeMo's and Lightning's base classes are imported here, on first use, and the subclasses built once."""
    import dataclasses

    from lightning.pytorch import Callback
    from nemo.lightning.pytorch.plugins import MegatronMixedPrecision
    from nemo.lightning.pytorch.plugins.mixed_precision import DtypeConfig

    @dataclasses.dataclass
    class FP8RecipeDtypeConfig(DtypeConfig):
        """DtypeConfig + the Megatron-Core fields a recipe may need that NeMo's config lacks."""

        fp8_quantizer_factory: str | None = None
        tp_only_amax_red: bool = False

    callback = _schedule_callback_class(Callback)
    out = {"FP8RecipeDtypeConfig": FP8RecipeDtypeConfig, "FP8ScheduleCallback": callback,
           "FP8RecipePrecision": _precision_class(MegatronMixedPrecision, FP8RecipeDtypeConfig, callback)}
    for name, cls in out.items():
        cls.__module__, cls.__qualname__ = __name__, name  # importable by path (NeMo's io / fiddle configs)
    return out


def __getattr__(name: str) -> type:
    if name in ("FP8RecipePrecision", "FP8ScheduleCallback", "FP8RecipeDtypeConfig"):
        return _classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
