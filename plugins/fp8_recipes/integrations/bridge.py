"""Megatron-Bridge: a recipe as Bridge's ``MixedPrecisionConfig``, or as a training callback (plugin-owned).

    from fp8_recipes.integrations.bridge import apply_recipe
    callbacks = apply_recipe(cfg, "hybrid")          # cfg: megatron.bridge.training.config.ConfigContainer
    pretrain(cfg, forward_step, callbacks=callbacks)

:func:`apply_recipe` picks the way (``common`` explains both): when Megatron-Core's own config can say the whole
recipe, ``cfg.mixed_precision`` becomes :func:`mixed_precision_config` (BF16 + the recipe's fp8 fields, ``custom``
+ our quantizer factory for per-role mixes) and no callback is needed; otherwise (BF16 warmup, stages, BF16
module patterns, first/last-layer BF16 with delayed scaling) ``cfg.mixed_precision`` is plain BF16 and the
returned :class:`FP8RecipeCallback` runs the recipe through our TE backend from Bridge's step hooks
(``on_train_start``: wrap the layers; ``on_train_step_start``: the plan's stage for
``state.train_state.step``; ``on_train_step_end``: requantize weights next step).

Bridge's MixedPrecisionConfig has no ``fp8_quantizer_factory`` / ``tp_only_amax_red``; :class:`FP8MixedPrecisionConfig`
(a subclass with them) makes Bridge's own ``update_config_with_precision_overrides`` copy them onto the model.
Checked against megatron-bridge 0.6.2 (``training/mixed_precision.py``, ``training/callbacks.py``,
``training/train.py``). Bridge is imported on first use only (``pip install fp8-recipes[bridge]``).
"""

from __future__ import annotations

import logging
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

from fp8_recipes.integrations.common import (
    EXTRA_FIELDS, NeedsPluginOwned, ScheduleDriver, activate_quantizer_factory, as_recipe, log_applied,
    megatron_precision, plugin_owned_graphs_problem, plugin_owned_plan, with_fields,
)
from fp8_recipes.megatron.model_config import (GRAPH_KEYS, MODEL_OPTIONAL, MODEL_REQUIRED, MOE_KEYS, check_model_cfg,
                                              config_layout, moe_config_fields, read_model_conf)
from fp8_recipes.plan.precision import ModelLayout
from fp8_recipes.recipe.schema import Recipe, RecipeError

__all__ = ["FP8MixedPrecisionConfig", "FP8RecipeCallback", "apply_moe", "apply_recipe", "mixed_precision_config",
           "use_prebuilt_dataset_helpers"]

RecipeRef = Recipe | str | Path | Mapping[str, Any]
log = logging.getLogger("fp8_recipes.integrations")


@lru_cache(maxsize=1)
def _classes() -> dict[str, type]:
    """Bridge's base classes are imported here, on first use, and the subclasses built once."""
    import dataclasses

    from megatron.bridge.training.callbacks import Callback
    from megatron.bridge.training.mixed_precision import MixedPrecisionConfig

    @dataclasses.dataclass(kw_only=True)
    class FP8MixedPrecisionConfig(MixedPrecisionConfig):
        """MixedPrecisionConfig + the Megatron-Core fields a recipe may need that Bridge's config lacks."""

        fp8_quantizer_factory: str | None = None
        """'pkg.mod.func' Megatron-Core imports when fp8_recipe == "custom" (ours: common.FACTORY_PATH)."""
        tp_only_amax_red: bool = False
        """amax_reduction: tensor (reduce delayed-scaling amaxes over the tensor-parallel group only)."""

    class FP8RecipeCallback(Callback):
        """Plugin-owned precision in Bridge's loop: BF16 warmup, stages, per-layer and per-module BF16.

        Needs the model built without fp8 (``apply_recipe`` sets plain BF16) and the TE layer spec (Bridge's default
        with TE installed); with pipeline stages, every chunk of the rank runs its layers' part of the whole plan."""

        def __init__(self, recipe: RecipeRef, *, max_steps: int | None = None, router_padding: bool = False):
            self.driver = ScheduleDriver(recipe, max_steps=max_steps, router_padding=router_padding)

        def on_train_start(self, context: Any) -> None:
            self.driver.attach(context.model)

        def on_train_step_start(self, context: Any) -> None:
            # train_state.step counts finished steps: Bridge adds 1 after on_train_step_end
            self.driver.begin_step(context.state.train_state.step)

        def on_train_step_end(self, context: Any) -> None:
            self.driver.end_step(context.state.train_state.step, skipped=bool(context.skipped_iter))

    for cls in (FP8MixedPrecisionConfig, FP8RecipeCallback):
        cls.__module__, cls.__qualname__ = __name__, cls.__name__  # importable by path (Bridge's YAML dumps)
    return {"FP8MixedPrecisionConfig": FP8MixedPrecisionConfig, "FP8RecipeCallback": FP8RecipeCallback}


def __getattr__(name: str) -> type:
    if name in ("FP8MixedPrecisionConfig", "FP8RecipeCallback"):
        return _classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _bf16_mixed() -> Any:
    from megatron.bridge.training.mixed_precision import bf16_mixed

    return with_fields(bf16_mixed(), _classes()["FP8MixedPrecisionConfig"], {})


def mixed_precision_config(recipe: RecipeRef, *, compute_capability: tuple[int, int] | None = None,
                           num_layers: int | None = None, layout: ModelLayout | None = None) -> Any:
    """Bridge's ``bf16_mixed`` with the recipe's Megatron-Core fp8 fields (an :class:`FP8MixedPrecisionConfig`).

    Raises a one-line RecipeError for what the native path cannot run (:class:`NeedsPluginOwned` when the
    callback can: use :func:`apply_recipe`). For ``fp8_recipe="custom"`` it also points our quantizer factory at
    the recipe in this process (every rank runs the script that calls this)."""
    recipe = as_recipe(recipe)
    mp = megatron_precision(recipe, compute_capability=compute_capability, num_layers=num_layers, layout=layout)
    base = _bf16_mixed()
    fields = {k: v for k, v in mp.fields.items() if hasattr(base, k) or k in EXTRA_FIELDS}
    out = with_fields(base, type(base), fields)
    activate_quantizer_factory(mp)
    log_applied(mp, recipe, "Megatron-Bridge")
    return out


def apply_recipe(config: Any, recipe: RecipeRef, *, compute_capability: tuple[int, int] | None = None) -> list[Any]:
    """Set ``config.mixed_precision`` for `recipe` and return the callbacks ``pretrain`` needs ([] when native).

    `config` is Bridge's ConfigContainer: its model provider's layers and MoE fields (``num_moe_experts``,
    ``moe_layer_freq``, shared experts; :func:`apply_moe` sets ours) check the layer rules and ``bf16_modules``
    patterns, ``train.train_iters`` sizes the printed plan."""
    recipe = as_recipe(recipe)
    num_layers = getattr(config.model, "num_layers", None)
    layout = config_layout(config.model) if num_layers else None
    padding = bool(getattr(config.model, "moe_router_padding_for_quantization", False))
    try:
        config.mixed_precision = mixed_precision_config(recipe, compute_capability=compute_capability,
                                                        num_layers=num_layers, layout=layout)
        if padding and not recipe.is_fp8:  # Megatron-Core refuses the key without fp8; BF16 GEMMs need no padding
            _unpad(config.model, "a BF16 recipe's GEMMs take any token count")
        return []
    except NeedsPluginOwned:
        plan = plugin_owned_plan(recipe, compute_capability=compute_capability, num_layers=num_layers, layout=layout)
    problem = plan.grouped_experts_problem() if getattr(config.model, "moe_grouped_gemm", False) else None
    if problem is not None:  # (what attach would refuse at train start, here before anything is built)
        raise RecipeError([f"recipe: {problem}"])
    graphs = plugin_owned_graphs_problem(config.model)
    if graphs is not None:  # (the callback's attach refuses it too, at train start)
        raise RecipeError([graphs])
    config.mixed_precision = _bf16_mixed()  # fp8 stays unset: the callback owns every autocast
    if padding:  # built BF16, the model leaves the padding to our backend, which pads the FP8 layers' dispatchers
        _unpad(config.model, "built BF16; the schedule callback pads the FP8 layers' tokens")
    max_steps = getattr(getattr(config, "train", None), "train_iters", None)
    return [_classes()["FP8RecipeCallback"](recipe, max_steps=max_steps, router_padding=padding)]


def _unpad(provider: Any, why: str) -> None:
    """Megatron-Core pads each expert's tokens only under its own fp8 config, and refuses the key without it."""
    log.warning("fp8-recipes: Megatron-Bridge model provider moe_router_padding_for_quantization: True -> False (%s)",
                why)
    provider.moe_router_padding_for_quantization = False


def apply_moe(provider: Any, model: str | Mapping[str, Any]) -> dict[str, Any]:
    """Put a model group's Mixture-of-Experts keys on Bridge's model provider (a GPTModelProvider, any Megatron-Core
    TransformerConfig: the fields share the keys' names) and return what was set. ``model`` is a conf/model name
    (``"mixtral_8x7b_4l"``: only its MoE keys are taken, the provider keeps its own shape) or a mapping of MoE keys.

    The keys are checked as scripts/train.py checks them, against the provider's shape and tensor-parallel size:
    a bad one is a one-line ValueError naming ``model.<key>``. Each field changed is logged, old -> new."""
    keys = _moe_keys(model)
    shape = {key: getattr(provider, key, None) for key in MODEL_REQUIRED + ("ffn_hidden_size", "num_query_groups")}
    shape["vocab_size"] = shape["vocab_size"] or 1  # (a provider may take it from the tokenizer later)
    shape["seq_length"] = shape["seq_length"] or 1
    check_model_cfg({**{k: v for k, v in shape.items() if v is not None}, **keys},
                    tensor_parallel=int(getattr(provider, "tensor_model_parallel_size", 1) or 1))
    fields = moe_config_fields(keys)
    for key, value in fields.items():
        old = getattr(provider, key, None)
        if old != value:
            log.info("fp8-recipes: Megatron-Bridge model provider %s: %r -> %r", key, old, value)
        setattr(provider, key, value)
    return fields


def _moe_keys(model: str | Mapping[str, Any]) -> dict[str, Any]:
    model = read_model_conf(model, "apply_moe") if isinstance(model, str) else model
    unknown = sorted(set(model) - set(MOE_KEYS) - set(MODEL_REQUIRED + MODEL_OPTIONAL + GRAPH_KEYS))
    if unknown:
        raise ValueError(f"apply_moe: {unknown[0]!r} is not a model key (the MoE keys: {', '.join(MOE_KEYS)})")
    keys = {key: model[key] for key in MOE_KEYS if key in model}
    if keys.get("num_moe_experts") is None:
        raise ValueError("apply_moe: model.num_moe_experts is not set: a dense model has no MoE keys to apply")
    return keys


def use_prebuilt_dataset_helpers() -> bool:
    """Let Bridge start where Megatron-Core came from its wheel. Bridge 0.6.2's ``initialize_megatron`` runs
    ``make`` in ``megatron/core/datasets`` on local rank 0 and exits when it fails; the megatron-core wheel ships
    the helpers compiled (``helpers_cpp``) and no Makefile, so every Bridge run on a pip-installed Megatron-Core
    stops there ("Failed to compile the C++ dataset helper functions", measured on an H200 with megatron-core
    0.19.2). When the compiled helpers import, Bridge's build step is skipped; returns whether it was."""
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:  # a source checkout: Bridge's own build is what is needed
        return False
    import megatron.bridge.training.initialize as initialize

    initialize.compile_helpers = lambda: None
    return True
