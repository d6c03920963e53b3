"""A recipe as Megatron-Core precision settings, shared by the Megatron-Bridge and NeMo 2 adapters.

    fields = megatron_fp8_fields(recipe, compute_capability=(9, 0))   # TransformerConfig fields, a plain dict
    TransformerConfig(**model_fields, **fields)                        # what Bridge and NeMo copy onto the model

Two ways to run a recipe inside someone else's training loop:

- **native**: Megatron-Core's own FP8 path. :func:`megatron_fp8_fields` gives ``fp8`` (e4m3 | hybrid),
  ``fp8_recipe`` (delayed | tensorwise | blockwise | mxfp8, or ``custom`` with ``fp8_quantizer_factory`` pointing
  at :func:`fp8_quantizer_factory` when the recipe mixes scalings per role or sets options Megatron's named recipes
  do not pass to TE), margin / history / algorithm, and first/last-layer BF16 counts. What a config cannot say
  (BF16 warmup, staged enablement, BF16 module patterns inside layers, first/last-layer BF16 with delayed scaling,
  forward-only FP8) is refused in one line that names the key and points at the other way.
- **plugin-owned**: the model is built without ``fp8`` and :class:`ScheduleDriver` runs our TE backend
  (``backends/te.py``: one ``te.autocast`` per layer, chosen from the PrecisionPlan per step), driven by the
  framework's step hooks. Everything a recipe can say runs this way, as fast as the native path (docs/facts.md, "Plugin-owned precision").

Both resolve the recipe with the same PrecisionPlan the training script uses, for the GPU the job runs on: the
same substitutions (``hybrid`` on an H200 runs Float8BlockScaling), the same refusals for ``backend: te``.

Megatron-Core imports ``fp8_quantizer_factory`` by its dotted path and calls it once per quantizer with TE's
role, so the recipe travels in an environment variable (:data:`QUANTIZER_ENV`, set by
:func:`activate_quantizer_factory`): every rank runs the training script, which sets it before the first forward.
Nothing here imports Transformer Engine, Megatron-Bridge or NeMo at module level.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

from fp8_recipes.plan.precision import Hardware, ModelLayout, PrecisionPlan, Substitution, TERecipe
from fp8_recipes.plan.format import format_plan
from fp8_recipes.plan.te import TERecipeKind, te_recipe_for
from fp8_recipes.recipe.pack import load_recipe
from fp8_recipes.recipe.schema import (
    DEFAULT_BLOCK, ROLES, AmaxAlgo, AmaxReduction, Attention, Backend, Recipe, RecipeError, Scaling,
)

__all__ = [
    "EXTRA_FIELDS", "FACTORY_PATH", "QUANTIZER_ENV", "MegatronPrecision", "NeedsPluginOwned", "ScheduleDriver",
    "activate_quantizer_factory", "as_recipe", "fp8_quantizer_factory", "log_applied", "megatron_fp8_fields",
    "megatron_precision", "named_recipe_gaps", "plugin_owned_graphs_problem", "plugin_owned_plan", "runtime_only_keys",
    "target_hardware", "te_recipe_fields", "with_fields",
]

log = logging.getLogger("fp8_recipes.integrations")

FACTORY_PATH = "fp8_recipes.integrations.common.fp8_quantizer_factory"
"""What ``TransformerConfig.fp8_quantizer_factory`` names when ``fp8_recipe == "custom"``."""
QUANTIZER_ENV = "FP8_RECIPES_QUANTIZERS"
"""JSON ``{"recipe": {...}, "compute_capability": [9, 0]}`` that :func:`fp8_quantizer_factory` builds from."""
NATIVE_FIX = ("run it plugin-owned: build the model without fp8 and add the fp8-recipes schedule callback "
              "(Bridge: FP8RecipeCallback, NeMo 2: FP8ScheduleCallback), see docs/nemo.md")

# The recipes Megatron-Core builds by name (it passes only the format and, for delayed scaling, margin / history /
# algorithm; the rest are TE's defaults, e.g. DEFAULT_BLOCK): a recipe that needs anything else goes through "custom".
_NAMED = {TERecipeKind.DELAYED: "delayed", TERecipeKind.CURRENT: "tensorwise", TERecipeKind.BLOCK: "blockwise",
          TERecipeKind.MXFP8: "mxfp8"}


def as_recipe(recipe: Recipe | str | Path | Mapping[str, Any]) -> Recipe:
    """A Recipe from itself, a pack name, a YAML path or a mapping (the adapters accept all four)."""
    return recipe if isinstance(recipe, Recipe) else load_recipe(recipe)


def target_hardware(compute_capability: tuple[int, int] | None) -> Hardware:
    """The GPU the job runs on, as the plan sees it: this machine's when not given (a CUDA GPU is needed then)."""
    if compute_capability is None:
        hw = Hardware.detect()
        if hw.device != "cuda":
            raise RecipeError(["compute_capability: no CUDA GPU here to read it from; pass the GPU the job runs on, "
                               "e.g. compute_capability=(9, 0) for H100/H200 or (10, 0) for B200"])
        return Hardware("cuda", hw.compute_capability, hw.te_version or "target", hw.name)
    return Hardware.target(compute_capability)  # te_version: TE is assumed where the job runs


# ---------------------------------------------------------------------------------------------------------------
# What a TransformerConfig can say


def runtime_only_keys(plan: PrecisionPlan) -> list[str]:
    """The recipe keys only plugin-owned precision can run (empty: the native fields say everything)."""
    recipe, layout = plan.recipe, plan.layout
    s = recipe.schedule
    keys = []
    if s.bf16_warmup_steps:
        keys.append("schedule.bf16_warmup_steps")
    keys += [f"schedule.enable.{r}" for r in ROLES if s.enable[r] and s.role_start(r) > s.bf16_warmup_steps]
    if s.full_precision_eval_interval:
        keys.append("schedule.full_precision_eval_interval")
    if any(plan.bf16_reason(n) and plan.bf16_reason(n).startswith("bf16_modules") for n in layout.module_names
           if layout.layer_of(n) is not None):  # the LM head is BF16 in Megatron-Core anyway
        keys.append("layers.bf16_modules")
    if "output_layer" in layout.module_names and plan.bf16_reason("output_layer") is None:
        keys.append("layers.fp8_output_layer")  # Megatron-Core's head is FP8 only under MXFP8 (fp8_output_proj)
    if recipe.attention is Attention.FP8:
        keys.append("attention")  # per layer and stage, as the plan says (Megatron's flag is one for every layer)
    return keys


@dataclass(frozen=True)
class MegatronPrecision:
    """A recipe resolved for Megatron-Core on one GPU type."""

    fields: dict[str, Any]
    """TransformerConfig fields (fp8, fp8_recipe, ...); ``{"fp8": None}`` for a BF16 recipe."""
    te: TERecipe | None
    """What an FP8 layer runs under on TE (after substitutions), None for BF16."""
    substitutions: tuple[Substitution, ...]
    """Settings TE runs differently from the recipe (``backend: auto`` only; ``te`` refuses them)."""
    payload: str | None
    """The :data:`QUANTIZER_ENV` value when ``fp8_recipe`` is custom, else None."""


class NeedsPluginOwned(RecipeError):
    """The recipe is fine, but only plugin-owned precision (the schedule callback) can run it."""


def _refuse(problem: str) -> RecipeError:
    return (NeedsPluginOwned if NATIVE_FIX in problem else RecipeError)([problem])


def _layout(recipe: Recipe, num_layers: int | None, layout: ModelLayout | None = None) -> ModelLayout:
    if layout is not None:  # the framework's model config, MoE layers included (config_layout)
        return layout
    n = num_layers or recipe.layers.bf16_first + recipe.layers.bf16_last + 2
    return ModelLayout.gpt(n)


def _plan(recipe: Recipe, hw: Hardware, layout: ModelLayout) -> PrecisionPlan:
    if recipe.backend is Backend.EMULATED:
        raise _refuse("backend: 'emulated' runs in fp8-recipes' own training loop only; Megatron-Core (Bridge, NeMo) "
                      "runs FP8 through Transformer Engine: set backend: auto or te")
    if recipe.modules:
        raise _refuse("modules: per-module policies run in fp8-recipes' own training loop (scripts/train.py) only so "
                      "far, not through the Bridge / NeMo adapters: remove modules:")
    nvfp4 = next((r for r in ROLES if recipe.policy(r).scaling is Scaling.NVFP4), None)
    if nvfp4 is not None:  # (Megatron-Core 0.19's fp4_recipe builds NVFP4BlockScaling with its defaults only)
        raise _refuse(f"{nvfp4}.scaling: 'nvfp4' runs in fp8-recipes' own training loop (scripts/train.py) only so "
                      f"far, not through the Bridge / NeMo adapters; train it with scripts/train.py")
    plan = PrecisionPlan(recipe, layout, hw)  # backend te: refuses a substitution in one line here
    if plan.te is None:
        why = plan.backend_reason.removeprefix("auto: the emulated backend runs the whole model as asked, ")
        raise _refuse(f"backend: no FP8 GEMM of '{recipe.name}' can run on Transformer Engine ({why})")
    return plan


# ---------------------------------------------------------------------------------------------------------------
# One TE recipe as Megatron-Core's fp8 fields (the adapters and bench/train.py's NAME:raw configs)


def named_recipe_gaps(te: TERecipe, recipe: Recipe) -> list[str]:
    """Why Megatron-Core's named recipe of this TE class is not exactly `te` (empty: the named one is; else
    ``fp8_recipe="custom"`` says it, or nothing does)."""
    w, a, g = te.weights, te.activations, te.gradients
    fp8 = [p for p in (w, a, g) if p.is_fp8]
    out = []
    if te.recipe is TERecipeKind.CUSTOM:
        out.append("per-role quantizers")
    elif te.recipe is TERecipeKind.DELAYED:
        if w.amax_compute_algo is AmaxAlgo.PERCENTILE or w.pow2_scales:
            out.append("percentile amax or power-of-two delayed scales (callables)")
        if recipe.amax_reduction is AmaxReduction.NONE:
            out.append("amax_reduction: none")
    elif te.recipe is TERecipeKind.CURRENT:
        if any(p.pow2_scales or p.amax_epsilon for p in fp8):
            out.append("pow2_scales / amax_epsilon")
    elif te.recipe is TERecipeKind.BLOCK:
        if any(not p.pow2_scales or p.amax_epsilon for p in fp8):
            out.append("non-power-of-two block scales / amax_epsilon")
        if any(p.block != DEFAULT_BLOCK[r] for r, p in zip(ROLES, (w, a, g)) if p.is_fp8):
            out.append("block shapes other than 128x128 weights, 1x128 activations and gradients")
    return out


def te_recipe_fields(te: TERecipe, custom: bool = False) -> dict[str, Any]:
    """The TransformerConfig fields under which Megatron-Core builds `te` for its FP8 layers: ``fp8`` (e4m3 |
    hybrid), ``fp8_recipe`` (its named recipe of te's class, or ``custom`` with our quantizer factory: see
    :func:`named_recipe_gaps`), delayed scaling's margin / history / algorithm, and FP8 attention."""
    w = te.weights
    out: dict[str, Any] = {"fp8": te.fp8_format.lower(), "fp8_recipe": "custom" if custom else _NAMED[te.recipe]}
    if custom:
        out["fp8_quantizer_factory"] = FACTORY_PATH
    if te.recipe is TERecipeKind.DELAYED and not custom:
        out.update(fp8_margin=w.margin, fp8_amax_history_len=w.amax_history_len,
                   fp8_amax_compute_algo=str(w.amax_compute_algo))
    if te.fp8_dpa:
        out["fp8_dot_product_attention"] = True
    return out


def _fields(te: TERecipe, recipe: Recipe, custom: bool) -> dict[str, Any]:
    """te's fields and what the recipe adds for every layer: first/last-layer BF16, the amax reduction group."""
    out = te_recipe_fields(te, custom)
    rules = recipe.layers
    out["first_last_layers_bf16"] = bool(rules.bf16_first or rules.bf16_last)
    out["num_layers_at_start_in_bf16"] = rules.bf16_first
    out["num_layers_at_end_in_bf16"] = rules.bf16_last
    if recipe.amax_reduction is AmaxReduction.TENSOR:
        out["tp_only_amax_red"] = True
    return out


def megatron_precision(recipe: Recipe | str | Path | Mapping[str, Any], *,
                       compute_capability: tuple[int, int] | None = None, num_layers: int | None = None,
                       layout: ModelLayout | None = None) -> MegatronPrecision:
    """Resolve `recipe` for Megatron-Core's native FP8 path on a GPU of `compute_capability`.

    Raises a one-line :class:`RecipeError` (naming the key and the fix) for what Megatron-Core's config cannot
    express or TE cannot run. `num_layers` lets ``bf16_modules`` patterns be checked against the real model;
    `layout` (the model config's, :func:`~fp8_recipes.megatron.model_config.config_layout`) against its MoE layers
    too: experts, shared experts, routers.
    """
    recipe = as_recipe(recipe)
    if not recipe.is_fp8:
        return MegatronPrecision({"fp8": None}, None, (), None)
    hw = target_hardware(compute_capability)
    plan = _plan(recipe, hw, _layout(recipe, num_layers, layout))
    keys = runtime_only_keys(plan)
    if keys:
        raise _refuse(f"{', '.join(keys)}: Megatron-Core's config has no BF16 warmup, stages, per-module BF16, "
                      f"full-precision evaluation, FP8 LM head on this GPU or per-layer FP8 attention; {NATIVE_FIX}")
    te = te_recipe_for(plan.te, frozenset(r for r in ROLES if recipe.policy(r).is_fp8))
    if te.forward_only:
        raise _refuse("gradients.scaling: 'none' makes a forward-only FP8 recipe (backward_override), which "
                      f"Megatron-Core's recipes never set; give gradients a scaling, or {NATIVE_FIX}")
    if te.delayed and recipe.amax_reduction is AmaxReduction.DATA:
        raise _refuse("amax_reduction: 'data' with delayed scaling: Megatron-Core reduces amaxes over the data x "
                      f"tensor parallel ranks (data_tensor) or the tensor-parallel ones (tensor); set one of those, or "
                      f"{NATIVE_FIX}")
    if te.delayed and (recipe.layers.bf16_first or recipe.layers.bf16_last):
        raise _refuse("layers.bf16_first/bf16_last with delayed scaling: Megatron-Core refuses first_last_layers_bf16 "
                      "with delayed scaling (one autocast per layer rolls every amax history once per layer); "
                      f"remove them, use tensorwise, or {NATIVE_FIX} (it nests the layers in one outer autocast)")
    reasons = named_recipe_gaps(te, recipe)
    if reasons and te.delayed:
        key = next(f"{r}.scaling" for r in ROLES if te.policy(r).scaling is Scaling.DELAYED)
        raise _refuse(f"{key}: 'delayed' in a recipe Megatron-Core must build as fp8_recipe='custom' "
                      f"({', '.join(reasons)}): its per-layer CustomRecipe leaves delayed-scaling state unallocated "
                      f"(TypeError in TE 2.20.2, measured on an H200); {NATIVE_FIX}")
    custom = bool(reasons)
    if recipe.fp8_param and plan.fp8_param_problem():
        raise _refuse(plan.fp8_param_problem())
    payload = json.dumps({"recipe": recipe.to_dict(), "compute_capability": list(hw.compute_capability)},
                         sort_keys=True) if custom else None
    fields = _fields(te, recipe, custom)
    if recipe.fp8_param:  # Megatron-Core's own FP8 weights (its DDP config needs fp8_param_gather=True as well)
        fields["fp8_param"] = True
    return MegatronPrecision(fields, te, plan.substitutions, payload)


def megatron_fp8_fields(recipe: Recipe | str | Path | Mapping[str, Any], *,
                        compute_capability: tuple[int, int] | None = None,
                        num_layers: int | None = None) -> dict[str, Any]:
    """The TransformerConfig precision fields of `recipe` (see :func:`megatron_precision`)."""
    return megatron_precision(recipe, compute_capability=compute_capability, num_layers=num_layers).fields


def plugin_owned_plan(recipe: Recipe | str | Path | Mapping[str, Any], *,
                      compute_capability: tuple[int, int] | None = None, num_layers: int | None = None,
                      layout: ModelLayout | None = None) -> PrecisionPlan:
    """The plan plugin-owned precision will run, checked now (one-line RecipeError) rather than at train start."""
    recipe = as_recipe(recipe)
    if recipe.fp8_param:
        raise _refuse("fp8_param: true with plugin-owned precision: the framework builds the model before the plugin "
                      "attaches, so its layers cannot be built with FP8 weights; use Megatron-Core's native fields "
                      "(megatron_precision sets fp8_param) or set fp8_param: false")
    return _plan(recipe, target_hardware(compute_capability), _layout(recipe, num_layers, layout))


def plugin_owned_graphs_problem(model_config: Any) -> str | None:
    """Why plugin-owned precision cannot run under the framework's CUDA graphs, or None: Megatron-Core's graph helper
    (Bridge's and NeMo's training loops use it) captures under the model config's own ``fp8`` fields, which
    plugin-owned precision leaves unset, so every graphed layer would replay BF16 kernels whatever the plan says."""
    impl = getattr(model_config, "cuda_graph_impl", "none")
    if impl in (None, "none"):
        return None
    return (f"model cuda_graph_impl={impl!r} with plugin-owned precision: the framework captures CUDA graphs under "
            f"Megatron-Core's own fp8 config, which the plugin leaves unset, so the graphed layers would run BF16; set "
            f"cuda_graph_impl='none', or use a recipe Megatron-Core runs natively (no BF16 warmup, stages or BF16 "
            f"patterns)")


def log_applied(mp: MegatronPrecision, recipe: Recipe, where: str) -> None:
    """Say what was applied and every substitution (STYLE: log each overridden field)."""
    log.info("fp8-recipes: %s runs recipe '%s' natively: %s", where, recipe.name,
             ", ".join(f"{k}={v!r}" for k, v in mp.fields.items()))
    for s in mp.substitutions:
        log.warning("fp8-recipes: %s: %s", s.key, s.line())


def with_fields(config: Any, cls: type, extra: Mapping[str, Any]) -> Any:
    """`config` (a dataclass instance) as an instance of its subclass `cls`, with `extra` set on top.

    Bridge's MixedPrecisionConfig and NeMo's DtypeConfig are copied onto the model config field by field (only the
    fields the model config has); ``fp8_quantizer_factory`` and ``tp_only_amax_red`` are not among their fields, so
    a subclass that adds them makes the framework's own copy carry them too."""
    import dataclasses

    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    return cls(**{**values, **extra})


EXTRA_FIELDS = ("fp8_quantizer_factory", "tp_only_amax_red")
"""Megatron-Core fields the recipe may set that Bridge's and NeMo's precision configs do not have."""


# ---------------------------------------------------------------------------------------------------------------
# fp8_recipe="custom": the factory Megatron-Core imports


def activate_quantizer_factory(mp: MegatronPrecision) -> None:
    """Make :func:`fp8_quantizer_factory` build `mp`'s quantizers in this process (and the ones it starts)."""
    if mp.payload is not None:
        os.environ[QUANTIZER_ENV] = mp.payload


@lru_cache(maxsize=8)
def _role_quantizers(payload: str) -> Any:
    # torch: only when Megatron-Core calls the factory; the config-time helpers here import neither torch nor megatron
    from fp8_recipes.backends.te import RoleQuantizers

    data = json.loads(payload)
    recipe = Recipe.from_dict(data["recipe"])
    mp = megatron_precision(recipe, compute_capability=tuple(data["compute_capability"]))
    return RoleQuantizers(mp.te, reduce_amax=recipe.amax_reduction is not AmaxReduction.NONE)


def fp8_quantizer_factory(role: Any) -> Any:
    """TE ``CustomRecipe`` qfactory (Megatron-Core: ``fp8_quantizer_factory``): the active recipe's quantizer for
    `role` (input -> activations, weight -> weights, grad_output -> gradients), as ``backends/te.py`` builds it."""
    payload = os.environ.get(QUANTIZER_ENV)
    if not payload:
        raise RuntimeError(f"fp8_quantizer_factory: {QUANTIZER_ENV} is not set; build the precision settings with "
                           f"fp8_recipes.integrations (it sets it), or set it to megatron_precision(...).payload")
    return _role_quantizers(payload)(role)


# ---------------------------------------------------------------------------------------------------------------
# Plugin-owned precision: our TE backend driven by a framework's step hooks


class ScheduleDriver:
    """Runs a recipe on a Megatron-Core model built without ``fp8``: BF16 warmup, stages and per-layer / per-module
    BF16 through ``backends/te.py``, one call per training step. Framework callbacks forward to it.

    ``attach(chunks)`` once the model exists (TE layer spec, ``config.fp8`` unset); ``begin_step(step)`` before each
    step's forward (0-based count of finished steps); ``end_step(step, skipped)`` after its optimizer step.
    With pipeline parallelism ``chunks`` are this rank's model chunks: the plan is the whole model's (global layer
    numbers, megatron/model.py's named_linear_modules), and each stage runs its own layers' part of it.
    """

    def __init__(self, recipe: Recipe | str | Path | Mapping[str, Any], *, max_steps: int | None = None,
                 router_padding: bool = False):
        self.recipe = as_recipe(recipe)
        self.max_steps = max_steps
        self.router_padding = router_padding  # MoE: pad each expert's tokens for FP8 GEMMs (our backend does it)
        self.precision: Any = None
        self.plan: PrecisionPlan | None = None
        self.stage = ""

    def attach(self, chunks: Sequence[Any]) -> None:
        # at the framework's train start only: megatron.core imports Transformer Engine where it is installed, which
        # this module must not do at import (the module docstring)
        from fp8_recipes.megatron.model import model_layout, unwrap_model
        from fp8_recipes.megatron.te_layers import attach_te_backend

        chunks = list(chunks)
        graphs = plugin_owned_graphs_problem(unwrap_model(chunks[0]).config)
        if graphs is not None:
            raise RuntimeError(f"fp8-recipes schedule callback: {graphs}")
        self.plan = PrecisionPlan(self.recipe, model_layout(chunks), Hardware.detect())
        if self.plan.backend is not Backend.TE:
            raise RuntimeError(f"fp8-recipes schedule callback: recipe '{self.recipe.name}' cannot run on Transformer "
                               f"Engine here ({self.plan.backend_reason})")
        self.precision = attach_te_backend(chunks, self.plan, router_padding=self.router_padding)
        if _rank() == 0:
            log.info("fp8-recipes precision plan:\n%s", format_plan(self.plan, self.max_steps))

    def begin_step(self, step: int) -> str:
        if self.precision is None:
            raise RuntimeError("fp8-recipes schedule callback: begin_step before attach (the callback's train-start "
                               "hook did not run)")
        self.stage = self.precision.begin_step(step)
        return self.stage

    def end_step(self, step: int, skipped: bool = False) -> None:
        if skipped:
            self.precision.skip_step(step)
        else:
            self.precision.after_optimizer_step(step)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
