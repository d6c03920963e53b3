"""Attaching the Transformer Engine backend to a Megatron-Core GPTModel built with the TE layer spec.

    model = build_gpt_model(cfg.model, use_te_spec=True, params_dtype=torch.bfloat16)   # no fp8 in its config
    plan = PrecisionPlan(recipe, model_layout(model), Hardware.detect())
    precision = attach_te_backend(model, plan)                                          # the loop's Precision

The TE spec builds linear_qkv / linear_fc1 as TELayerNormColumnParallelLinear (TE's LayerNormLinear) and
linear_proj / linear_fc2 as TERowParallelLinear (TE's Linear) under the local spec's names, so the plan's
ModelLayout is the same for both specs. The model's own config must not set ``fp8``: the backend owns every
autocast (Megatron-Core's would nest with ours).

The LM head. Megatron-Core builds ``output_layer`` as its plain ColumnParallelLinear (a TE module only for MXFP8
with ``fp8_output_proj``, and then without tied embeddings). When the plan runs the head in FP8
(``layers.fp8_output_layer: true``), :class:`TEOutputLayer` re-classes it in place: its GEMM runs through a
``te.Linear`` that holds no weight of its own but is handed, at each call, the weight Megatron-Core passes (the
head's own, or the word embedding's when embeddings are tied), so parameters, state dict, DDP buffers and the
tied-embedding wiring stay Megatron-Core's. A head the plan keeps BF16 is left exactly as built.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

from fp8_recipes.backends.groups import amax_reduction_group
from fp8_recipes.backends.te import TEPrecision
from fp8_recipes.megatron.model import (named_linear_modules, replace_output_layer_class, transformer_layers,
                                        unwrap_model)
from fp8_recipes.plan import PrecisionPlan
from fp8_recipes.schema import Attention

__all__ = ["TEOutputLayer", "attach_te_backend", "head_runs_fp8"]


class TEOutputLayer(ColumnParallelLinear):
    """Megatron-Core's LM head (a ColumnParallelLinear) whose GEMM runs in a ``te.Linear``, so TE's autocast
    quantizes it like any other linear: the input (activations), the weight (weights; the embedding when tied)
    and the logits' gradient (gradients). Tensor and sequence parallelism are TE's column mode over the head's
    tp group (input all-gather with SP, dgrad all-reduce without). Set up by :func:`replace_output_layer_class`
    (no ``__init__``): ``te_linear`` is built in ``_after_class_swap`` and kept outside the module tree."""

    def _after_class_swap(self) -> None:
        import transformer_engine.pytorch as te

        if self.embedding_activation_buffer is not None or self.grad_output_buffer is not None:
            raise ValueError("te backend: an FP8 LM head does not support defer_embedding_wgrad_compute; set "
                             "layers.fp8_output_layer: false")
        lin = te.Linear(self.input_size, self.output_size, bias=False, params_dtype=self.config.params_dtype,
                        parallel_mode="column", tp_group=self.tp_group, sequence_parallel=self.sequence_parallel,
                        device="meta", name="output_layer")  # meta: its own weight is never allocated
        lin.is_first_microbatch = True  # quantize the weight on a step's first micro-batch, reuse it after
        self.__dict__["te_linear"] = lin  # not a submodule: its parameter is the head's (or embedding's)

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        lin: Any = self.__dict__["te_linear"]
        weight = self.weight if weight is None else weight
        if lin._parameters.get("weight") is not weight:
            lin._parameters["weight"] = weight
        lin.training = self.training
        out = lin(input_, is_first_microbatch=lin.is_first_microbatch)
        lin.is_first_microbatch = False
        if self.gather_output if runtime_gather_output is None else runtime_gather_output:
            out = gather_from_tensor_model_parallel_region(out, group=self.tp_group)
        return out, None


def head_runs_fp8(plan: PrecisionPlan) -> bool:
    """Whether the plan runs the LM head in FP8 at any stage of the run."""
    return "output_layer" in plan.layout.module_names and any(
        plan.at(first).modules["output_layer"].te is not None for first, _, _ in plan.stages())


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
    if "output_layer" in linears and head_runs_fp8(plan):
        head = linears["output_layer"]
        if not isinstance(head, TEOutputLayer):
            head = replace_output_layer_class(next(g for g in gpts if getattr(g, "output_layer", None) is head),
                                              TEOutputLayer)
        te_linears["output_layer"] = head.te_linear
    layers = transformer_layers(chunks)
    # TE's DotProductAttention modules, whose delayed state the controller keeps when the recipe runs attention in
    # FP8 (under a delayed autocast TE gives them a state even with fp8_dpa off: never used, so not kept then)
    attention = {i: layer.self_attention.core_attention for i, layer in layers.items()
                 if plan.recipe.attention is Attention.FP8
                 and isinstance(getattr(layer.self_attention, "core_attention", None), TransformerEngineBaseModule)}
    # The outer autocast of delayed scaling spans the whole chunk (its layers and, on the last stage, the head).
    return TEPrecision(plan, layers=layers, linears=te_linears, chunks=gpts, attention=attention,
                       amax_group=amax_reduction_group(plan.recipe.amax_reduction), count=count)
