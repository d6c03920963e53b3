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

Mixture-of-Experts. Megatron-Core's TE spec builds an MoE layer's routed experts as ``TEGroupedMLP`` (model
``moe_grouped_gemm: true``: one TE ``GroupedLinear`` per fc, running a GEMM per local expert, named
``mlp.experts.linear_fc1``) or as ``SequentialMLP`` (an MLP of TE linears per expert, named as the plan's rows).
A grouped linear stands for the plan rows of its experts (:func:`grouped_expert_rows`): they must share one TE
recipe at every stage (one autocast runs the module), else the attach refuses in one line. TE's FP8 GEMMs need
each expert's token count to be a multiple of 16 (32 for MXFP8); Megatron-Core pads them only when its config
sets ``fp8``, which ours never does, so :func:`_pad_expert_tokens` gives the experts of each MoE layer the plan
runs in FP8 a config of their own that says FP8 (read only for that padding: TEGroupedMLP's ``Fp8Padding``, or
SequentialMLP's per-expert zero rows), and, with model ``moe_router_padding_for_quantization: true``, the token
dispatcher too (it pads the routing map instead, so the experts' own padding has nothing left to do).

FP8 weights (recipe ``fp8_param: true``). :class:`FP8ParamInit` is ``build_gpt_model``'s ``layer_init``: each layer the
plan stores in FP8 is built inside TE's ``quantized_model_init(recipe=)`` with the TE recipe object that layer's
autocast then runs under (handed to :func:`attach_te_backend`), so its TE linears hold their weights as FP8 tensors
(Megatron-Core's ``get_fp8_context(is_init=True)``, per layer from the plan, on a model built without ``fp8`` in its
config). Megatron-Core's DDP and distributed optimizer keep them (``fp8_param_gather``, training/engine.py).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

from fp8_recipes.checks import ConfigError
from fp8_recipes.backends.groups import te_amax_reduction_group, te_expert_amax_reduction_group
from fp8_recipes.backends.te import TEPrecision, te_recipe
from fp8_recipes.megatron.model import (grouped_expert_rows, named_linear_modules, replace_output_layer_class,
                                        transformer_layers, unwrap_model)
from fp8_recipes.plan.precision import PrecisionPlan, TERecipe
from fp8_recipes.plan.te import TERecipeKind
from fp8_recipes.recipe.schema import AmaxReduction, Attention, RecipeError, Scaling

__all__ = ["FP8ParamInit", "TEOutputLayer", "attach_te_backend", "fp8_param_recipe", "head_runs_fp8"]


class TEOutputLayer(ColumnParallelLinear):
    """Megatron-Core's LM head (a ColumnParallelLinear) whose GEMM runs in a ``te.Linear``, so TE's autocast
    quantizes it like any other linear: the input (activations), the weight (weights; the embedding when tied)
    and the logits' gradient (gradients). Tensor and sequence parallelism are TE's column mode over the head's
    tp group (input all-gather with SP, dgrad all-reduce without). Set up by :func:`replace_output_layer_class`
    (no ``__init__``): ``te_linear`` is built in ``_after_class_swap`` and kept outside the module tree."""

    def _after_class_swap(self) -> None:
        import transformer_engine.pytorch as te

        if self.embedding_activation_buffer is not None or self.grad_output_buffer is not None:
            raise ConfigError("te backend: an FP8 LM head does not support defer_embedding_wgrad_compute; set "
                             "layers.fp8_output_layer: false")
        # (gradient_accumulation_fusion: TE's wgrad GEMM accumulates into DDP's main_grad, as the layers' do)
        lin = te.Linear(self.input_size, self.output_size, bias=False, params_dtype=self.config.params_dtype,
                        parallel_mode="column", tp_group=self.tp_group, sequence_parallel=self.sequence_parallel,
                        fuse_wgrad_accumulation=self.config.gradient_accumulation_fusion,
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


# Megatron-Core's name of each TE recipe class whose weights can be FP8 parameters (its OptimizerConfig.fp8_recipe:
# the distributed optimizer shards a delayed-scaling weight by view, the others through their quantizer)
_MEGATRON_RECIPE = {TERecipeKind.DELAYED: "delayed", TERecipeKind.CURRENT: "tensorwise",
                    TERecipeKind.BLOCK: "blockwise", TERecipeKind.MXFP8: "mxfp8"}


def fp8_param_recipe(plan: PrecisionPlan) -> str | None:
    """Megatron-Core's ``fp8_recipe`` name of the plan's FP8-stored weights (recipe ``fp8_param: true``), or None when
    no weight is stored in FP8: what its optimizer and DDP are told (training/engine.py)."""
    kinds = {te.recipe for te in plan.fp8_param_layers().values()}
    return _MEGATRON_RECIPE[kinds.pop()] if kinds else None


class FP8ParamInit:
    """``build_gpt_model(layer_init=...)`` for recipe ``fp8_param: true``: the layers the plan stores in FP8 are built
    inside TE's ``quantized_model_init`` with their TE recipe; the others as usual. ``recipes`` (TERecipe -> TE recipe
    object) goes to :func:`attach_te_backend`, so a layer runs under the very object its weights were quantized with.
    The BF16 initial values stay (on the CPU) until the distributed optimizer makes its fp32 main params from them, so
    those start where a BF16-stored run's do (as Megatron-Core's ``get_fp8_context(is_init=True)`` asks TE to)."""

    def __init__(self, plan: PrecisionPlan):
        problem = plan.fp8_param_problem()
        if problem is not None:
            raise RecipeError([problem])
        self.layers: dict[int, TERecipe] = plan.fp8_param_layers()
        self.recipes: dict[TERecipe, Any] = {}
        self._reduce_amax = plan.recipe.amax_reduction is not AmaxReduction.NONE

    def __call__(self, layer: int) -> contextlib.AbstractContextManager:
        choice = self.layers.get(layer)
        if choice is None:
            return contextlib.nullcontext()
        import transformer_engine.pytorch as te

        if choice not in self.recipes:
            self.recipes[choice] = te_recipe(choice, reduce_amax=self._reduce_amax)
        return te.quantized_model_init(enabled=True, recipe=self.recipes[choice],
                                       preserve_high_precision_init_val=torch.is_grad_enabled())


def _fp8_params(linears: dict[str, torch.nn.Module]) -> dict[str, torch.nn.Parameter]:
    """The FP8-stored weights (TE QuantizedTensors) of ``linears`` by ``<linear name>.<param name>``."""
    from transformer_engine.pytorch.tensor import QuantizedTensor

    return {f"{name}.{p}": param for name, m in linears.items() for p, param in m.named_parameters(recurse=False)
            if isinstance(param, QuantizedTensor)}


def head_runs_fp8(plan: PrecisionPlan) -> bool:
    """Whether the plan runs the LM head in FP8 at any stage of the run."""
    return "output_layer" in plan.layout.module_names and any(
        plan.at(first).modules["output_layer"].te is not None for first, _, _ in plan.stages())


def _align(choice: TERecipe) -> int:
    """The token multiple TE's FP8 GEMMs need under ``choice``: 32 with an MXFP8 operand, else 16."""
    mxfp8 = choice.recipe is TERecipeKind.MXFP8 or any(
        p.scaling is Scaling.MXFP8 for p in (choice.weights, choice.activations, choice.gradients))
    return 32 if mxfp8 else 16


def _pad_expert_tokens(gpts: list[torch.nn.Module], plan: PrecisionPlan, router_padding: bool) -> None:
    """Each MoE layer whose experts the plan runs in FP8 at some stage pads every expert's tokens to TE's multiple
    (see the module docstring): its experts module (and, with ``router_padding``, its token dispatcher) get a
    shallow copy of the model's config with ``fp8`` set, which Megatron-Core reads there for that padding alone."""
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    for gpt in gpts:
        for layer in gpt.decoder.layers:
            mlp = layer.mlp
            if not hasattr(mlp, "token_dispatcher"):
                continue
            prefix = f"decoder.layers.{layer.layer_number - 1}.mlp.experts.local_experts."
            rows = [n for n in plan.layout.module_names if n.startswith(prefix)]
            choices = {c for _, stage in plan.te_choices(rows) for c in stage if c is not None}
            if not choices:
                continue
            align = max(_align(c) for c in choices)
            config = copy.copy(mlp.experts.config)
            config.fp8, config.fp8_recipe = "e4m3", "mxfp8" if align == 32 else "tensorwise"
            config.moe_router_padding_for_quantization = router_padding
            mlp.experts.config = config
            if isinstance(mlp.experts, TEGroupedMLP):
                from transformer_engine.pytorch import Fp8Padding, Fp8Unpadding

                n = mlp.experts.num_local_experts
                mlp.experts.quantization_padding = Fp8Padding(n, align_size=align)
                mlp.experts.quantization_unpadding = Fp8Unpadding(n, align_size=align)
            if router_padding:
                mlp.token_dispatcher.config = config


def _hook_new_modules(chunks: list[torch.nn.Module]) -> None:
    """Chunks already wrapped in Megatron-Core's DDP with its forward pre-hooks on (``overlap_param_gather`` with the
    distributed optimizer; Megatron-Bridge's callback attaches after wrapping): the modules the attach added to the
    tree (the experts' Fp8Padding / Fp8Unpadding) get DDP's hook as its own modules have it, and a module no longer
    in the tree loses its own. DDP's ``disable_forward_pre_hook`` looks every module up and raised ``KeyError:
    Fp8Padding()`` in Bridge's pretrain (the H100, 2026-12-06)."""
    for chunk in chunks:
        handles = getattr(chunk, "remove_forward_pre_hook_handles", None)
        if not handles:  # not DDP, or its hooks are off: enable_forward_pre_hook will hook every module then
            continue
        modules = list(chunk.module.modules())
        for module in set(handles) - set(modules):
            handles.pop(module).remove()
        for module in modules:
            if module not in handles:
                handles[module] = module.register_forward_pre_hook(chunk._make_forward_pre_hook())


def attach_te_backend(model: torch.nn.Module | list[torch.nn.Module], plan: PrecisionPlan, *,
                      count: bool = True, recipes: dict[TERecipe, Any] | None = None,
                      router_padding: bool = False) -> TEPrecision:
    """Wrap the layers and TE linears of `model` (a GPTModel or this rank's pipeline chunks) in plan-driven
    autocasts; return the controller. The plan is the whole model's: each stage runs its own layers' part.
    ``recipes``: the TE recipe objects the model's FP8 weights were quantized with (:class:`FP8ParamInit`).
    ``router_padding``: model ``moe_router_padding_for_quantization`` (the dispatcher pads, see the module doc)."""
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    gpts = [unwrap_model(c) for c in chunks]
    if getattr(gpts[0].config, "fp8", None):
        raise ValueError(f"te backend: the model was built with fp8={gpts[0].config.fp8!r} in its "
                         "TransformerConfig; build it without (the backend chooses each layer's autocast)")
    linears = dict(named_linear_modules(chunks))
    grouped = grouped_expert_rows(chunks)
    if not {grouped.get(n, (n,))[0] for n in linears} <= set(plan.layout.module_names):
        raise ValueError("te backend: the plan was made for another model layout; build the plan from "
                         "model_layout(model)")
    problem = plan.grouped_experts_problem(grouped) if grouped else None
    if problem is not None:
        raise ConfigError(f"te backend: {problem}")
    _pad_expert_tokens(gpts, plan, router_padding)
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
    fp8_params = _fp8_params({n: m for n, m in te_linears.items() if n != "output_layer"})
    stored = {n.rsplit(".", 1)[0] for n in fp8_params}
    expected = {n for n in te_linears if plan.layout.layer_of(n) in plan.fp8_param_layers()}
    if stored != expected:  # the model was not built with FP8ParamInit(plan), or with another plan's
        odd = min(stored ^ expected)
        raise ValueError(f"te backend: {odd} {'holds' if odd in stored else 'lacks'} FP8 weights against the plan "
                         f"(recipe fp8_param: {str(plan.recipe.fp8_param).lower()}); build the model with "
                         f"layer_init=FP8ParamInit(plan)")
    kind = plan.recipe.amax_reduction
    experts = te_expert_amax_reduction_group(kind) if plan.layout.experts else None
    _hook_new_modules(chunks)
    return TEPrecision(plan, layers=layers, linears=te_linears, chunks=gpts, attention=attention,
                       amax_group=te_amax_reduction_group(kind), count=count, recipes=recipes,
                       fp8_params=fp8_params, rows={n: grouped[n] for n in te_linears if n in grouped},
                       expert_amax_group=experts)
