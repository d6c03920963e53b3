"""Attaching the Transformer Engine backend to a Megatron-Core GPTModel built with the TE layer spec.

    model = build_gpt_model(cfg.model, use_te_spec=True, params_dtype=torch.bfloat16)   # no fp8 in its config
    plan = PrecisionPlan(recipe, model_layout(model), Hardware.detect())
    precision = attach_te_backend(model, plan)                                          # the loop's Precision

The TE spec builds linear_qkv / linear_fc1 as TELayerNormColumnParallelLinear (TE's LayerNormLinear) and
linear_proj / linear_fc2 as TERowParallelLinear (TE's Linear) under the local spec's names, so the plan's
ModelLayout is the same for both specs. The LM head stays Megatron-Core's ColumnParallelLinear, in BF16. The
model's own config must not set ``fp8``: the backend owns every autocast (Megatron-Core's would nest with ours).
"""

from __future__ import annotations

import torch

from fp8_recipes.backends.groups import amax_reduction_group
from fp8_recipes.backends.te import TEPrecision
from fp8_recipes.megatron.model import named_linear_modules, transformer_layers, unwrap_model
from fp8_recipes.plan import PrecisionPlan

__all__ = ["attach_te_backend"]


def attach_te_backend(model: torch.nn.Module | list[torch.nn.Module], plan: PrecisionPlan, *,
                      count: bool = True) -> TEPrecision:
    """Wrap the layers and TE linears of `model` (a GPTModel or this rank's pipeline chunks) in plan-driven
    autocasts; return the controller. The plan is the whole model's: each stage runs its own layers' part."""
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    gpts = [unwrap_model(c) for c in chunks]
    if getattr(gpts[0].config, "fp8", None):
        raise ValueError(f"te backend: the model was built with fp8={gpts[0].config.fp8!r} in its "
                         "TransformerConfig; build it without (the backend chooses each layer's autocast)")
    linears = dict(named_linear_modules(chunks))
    if not set(linears) <= set(plan.layout.module_names):
        raise ValueError("te backend: the plan was made for another model layout; build the plan from "
                         "model_layout(model)")
    te_linears = {n: m for n, m in linears.items() if isinstance(m, TransformerEngineBaseModule)}
    missing = [n for n in linears if plan.layout.layer_of(n) is not None and n not in te_linears]
    if missing:
        raise ValueError(f"te backend: {missing[0]} is a {type(linears[missing[0]]).__name__}, not a Transformer "
                         f"Engine module; build the model with build_gpt_model(..., use_te_spec=True)")
    return TEPrecision(plan, layers=transformer_layers(chunks), linears=te_linears,
                       decoders=[g.decoder for g in gpts], amax_group=amax_reduction_group(plan.recipe.amax_reduction),
                       count=count)
