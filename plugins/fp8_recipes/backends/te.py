"""The Transformer Engine backend: TE recipe objects built from the plan, and per-layer ``te.autocast`` driven by it.

    precision = attach_te_backend(model, plan)        # fp8_recipes.megatron.te_layers: finds layers and linears
    stage = precision.begin_step(step)                 # applies plan.at(step): which layers run FP8, under what

How it runs (docs/facts.md, "Plugin-owned precision"): the Megatron-Core model is built with the TE layer spec and no
``fp8`` in its config; each TransformerLayer's forward runs inside our own ``te.autocast(enabled, recipe)``
chosen from the plan for that layer and step (as fast as Megatron-Core's own path). A linear kept BF16 inside an
FP8 layer (a ``bf16_modules`` pattern) runs under its own ``te.autocast(enabled=False)``. When a step has
delayed scaling anywhere, one more ``te.autocast`` spans the model chunk (its layers and, when it runs FP8, the LM
head), as Megatron-Core's spans its decoder: TE reduces and
updates amax histories when the *outermost* autocast exits (forward) and after the first FP8 module's backward,
so per-layer autocasts alone would roll every history once per layer (why Megatron-Core refuses first/last-layer
BF16 with delayed scaling). Nested inside one outer autocast it is exact once the "first FP8 module" flag, which
each inner autocast's exit would restore, stays consumed (``_wrap``): one forward and one backward reduce-and-update
per chunk and micro-batch, as under Megatron-Core's single autocast.

State across stage changes: one TE recipe object per distinct :class:`~fp8_recipes.plan.precision.TERecipe`, built once.
TE keeps a module's delayed-scaling state (scale, amax history) when the next recipe has the same class
(``set_meta_tensor`` returns early; a CustomRecipe rebuild hands it over through ``inherit_state_from``); only a
change of recipe class starts afresh, which the plan never asks for (delayed roles keep one carrier).

A new plan mid-run (:meth:`TEPrecision.replan`: the autopilot changed the recipe between steps) is another matter:
a module's new recipe may differ from its old one in format, margin or history within the same class, which TE
would not pick up, or in class. At the first step of the new plan each linear whose TE recipe changed is rebuilt
for it, its delayed amaxes carried slot by slot, and TE's amax buffers are emptied so every module registers
again under its recipe now (backends/te_state.py).

Checkpoints: TE would pickle each module's recipe and delayed state into ``_extra_state``; TE 2.20 refuses to
load that without NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1, and our callables would be pickled with it. So the TE
modules' extra state stays empty and the delayed-scaling tensors travel in :meth:`TEPrecision.state_dict` as
plain tensors, put back before the module's next FP8 forward (TE's own way: ``init_fp8_meta_tensors``, then copy).
FP8-stored weights (recipe ``fp8_param: true``) travel there too, as their exact bytes (FP8 data and scale inverses:
the model's state dict holds their BF16 values, training/checkpoint.py), copied back into the very tensors the DDP
buffer holds, so a resumed run computes with the weights the uninterrupted one would.

TE is imported inside functions only: a broken TE must not break importing this package.
"""

from __future__ import annotations

import contextlib
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from fp8_recipes.backends.te_state import (SLOT_ROLES, StepSnapshot, delayed_tensors, move_delayed, reregister,
                                           restore_delayed)
from fp8_recipes.checks import ConfigError
from fp8_recipes.numerics.scaling import delayed_scale_update, history_percentile
from fp8_recipes.plan.precision import PrecisionPlan, StepPlan, TERecipe
from fp8_recipes.plan.te import DELAYED_ANCHOR, TERecipeKind
from fp8_recipes.recipe.schema import AmaxAlgo, AmaxReduction, Format, Role, Scaling, TensorPolicy

__all__ = ["DelayedScaleUpdate", "PercentileAmax", "RoleQuantizers", "TEPrecision", "te_available", "te_recipe",
           "what_ran"]

FP8, FP8_FWD, BF16 = "fp8", "fp8 fwd", "bf16"  # what a TE linear ran, as counted by TEPrecision


def te_available() -> bool:
    """Whether Transformer Engine's PyTorch part imports here (any failure, e.g. no cuDNN, means no)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


# ---------------------------------------------------------------------------------------------------------------
# TE recipes from the plan's TERecipe


class PercentileAmax:
    """``DelayedScaling.amax_compute_algo`` for ``percentile``: per quantizer, the p-th percentile of the recorded
    (positive) amaxes of the window, 0 when none (TE then keeps the scale): DelayedScaler's rule, vectorized."""

    def __init__(self, percentile: float):
        self.percentile = percentile

    def __call__(self, amax_history: torch.Tensor) -> torch.Tensor:  # (history_len, n) -> (n,)
        return history_percentile(amax_history, self.percentile)

    # TE requires the DelayedScalingRequests of one module to be equal: compare by value, not identity
    def __eq__(self, other: object) -> bool:
        return isinstance(other, PercentileAmax) and other.percentile == self.percentile

    def __hash__(self) -> int:
        return hash(("PercentileAmax", self.percentile))

    def __repr__(self) -> str:
        return f"PercentileAmax({self.percentile:g})"


class DelayedScaleUpdate:
    """``DelayedScaling.scaling_factor_compute_algo``: TE's default update (fp8_max / amax / 2^margin, kept when
    amax is 0 or not finite, float32 max when it overflows), optionally rounded down to a power of two.

    Needed for ``pow2_scales``, and whenever the amax algorithm is a callable (percentile): TE then leaves its
    exact fused C++ update for a torch.jit-fused Python one whose division can be one ulp off (measured on the
    H200); this one divides exactly, as DelayedScaler does."""

    def __init__(self, pow2: bool):
        self.pow2 = pow2

    def __call__(self, amax: torch.Tensor, scale: torch.Tensor, fp8_max: float, recipe: Any) -> torch.Tensor:
        return delayed_scale_update(amax, scale, fp8_max, recipe.margin, pow2=self.pow2)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DelayedScaleUpdate) and other.pow2 == self.pow2

    def __hash__(self) -> int:
        return hash(("DelayedScaleUpdate", self.pow2))

    def __repr__(self) -> str:
        return f"DelayedScaleUpdate(pow2={self.pow2})"


def _scale_algo(p: TensorPolicy) -> DelayedScaleUpdate | None:
    """None keeps TE's exact fused update; ours when pow2 or a callable amax algorithm needs it."""
    if p.pow2_scales or p.amax_compute_algo is AmaxAlgo.PERCENTILE:
        return DelayedScaleUpdate(p.pow2_scales)
    return None


def _amax_algo(p: TensorPolicy) -> str | Callable:
    if p.amax_compute_algo is AmaxAlgo.PERCENTILE:
        return PercentileAmax(p.percentile)
    return str(p.amax_compute_algo)


def _te_dtype(fmt: Format):
    import transformer_engine_torch as tex

    return tex.DType.kFloat8E4M3 if fmt is Format.E4M3 else tex.DType.kFloat8E5M2


_BOUNDARY = {"output": True, "grad_input": False}
"""A TE linear's boundary slots by tensor type (when a parent module names them), and whether each is forward."""


class RoleQuantizers:
    """CustomRecipe ``qfactory``: each tensor a TE linear quantizes gets its role's policy (input -> activations,
    weight -> weights, grad_output -> gradients). The boundary slots (output, grad_input: used only with
    fp8_output / fp8_grad, which Megatron-Core's linears never ask for) stay high precision, except in the direction
    a one-sided delayed recipe gives :data:`~fp8_recipes.plan.te.DELAYED_ANCHOR` state (``TERecipe.delayed_anchor``).
    TE passes a boundary slot no role (None, unless a parent module sets one: then its tensor type says it) and asks
    for a GEMM's slots in order (input, weight, output; then grad_output, grad_input), so the role asked for just
    before tells a boundary slot's direction."""

    def __init__(self, choice: TERecipe, reduce_amax: bool):
        self.choice = choice
        self.reduce_amax = reduce_amax
        self._previous: Role | None = None  # the role of the linear slot asked for before

    def __call__(self, role: Any) -> Any:
        import transformer_engine.pytorch as te

        if role is None or getattr(role, "tensor_type", None) in _BOUNDARY:
            return self._boundary(te, None if role is None else _BOUNDARY[role.tensor_type])
        self._previous = SLOT_ROLES.get(getattr(role, "tensor_type", None))
        linear = getattr(role, "module_type", "") in ("linear", "grouped_linear", "")
        r = SLOT_ROLES.get(role.tensor_type) if linear else None  # attention (dpa): BF16
        p = self.choice.policy(r) if r is not None else None
        if p is None or not p.is_fp8:
            return te.IdentityQuantizer()
        if p.scaling is Scaling.DELAYED:  # TE allocates the state and reduces it with the built-in recipes'
            return self._delayed_request(te, p)
        dtype = _te_dtype(p.format)
        if p.scaling is Scaling.TENSORWISE:
            return te.Float8CurrentScalingQuantizer(dtype, torch.device("cuda"), force_pow_2_scales=p.pow2_scales,
                                                    amax_epsilon=p.amax_epsilon)
        if p.scaling is Scaling.BLOCKWISE:
            return te.Float8BlockQuantizer(dtype, rowwise=True, columnwise=True, amax_epsilon=p.amax_epsilon,
                                           force_pow_2_scales=p.pow2_scales,
                                           block_scaling_dim=1 if p.block[0] == 1 else 2)
        return te.MXFP8Quantizer(dtype)

    def _boundary(self, te: Any, forward: bool | None) -> Any:
        if forward is None and self._previous is not None:  # (a role-less slot: after its GEMM's other slots)
            forward = self._previous is not Role.GRADIENTS
        anchor = self.choice.delayed_anchor
        if anchor is not None and forward is anchor:
            return self._delayed_request(te, DELAYED_ANCHOR)
        return te.IdentityQuantizer()

    def _delayed_request(self, te: Any, p: TensorPolicy) -> Any:
        from transformer_engine.common.recipe import Format as TEFormat

        return te.DelayedScalingRequest(
            fp8_format=TEFormat[self.choice.fp8_format], margin=p.margin, amax_history_len=p.amax_history_len,
            amax_compute_algo=_amax_algo(p), scaling_factor_compute_algo=_scale_algo(p),
            reduce_amax=self.reduce_amax and p is not DELAYED_ANCHOR)  # (the anchor's amax is 0 on every rank)

    def __repr__(self) -> str:
        return f"RoleQuantizers({self.choice.describe()})"


def te_recipe(choice: TERecipe, *, reduce_amax: bool = True) -> Any:
    """The TE recipe object for one TERecipe (every argument explicit: TE reads defaults from NVTE_* variables)."""
    from transformer_engine.common import recipe as R

    override = "high_precision" if choice.forward_only else None
    if choice.recipe is TERecipeKind.NVFP4:  # (the 4over6 and row-scaled variants are TE's post-training options)
        return R.NVFP4BlockScaling(**choice.nvfp4_switches(), row_scaled_activation=False, nvfp4_4over6="none",
                                   backward_override=override)
    fmt = R.Format[choice.fp8_format]
    w, a, g = choice.weights, choice.activations, choice.gradients
    if choice.recipe is TERecipeKind.DELAYED:
        return R.DelayedScaling(fp8_format=fmt, margin=w.margin, amax_history_len=w.amax_history_len,
                                amax_compute_algo=_amax_algo(w),
                                scaling_factor_compute_algo=_scale_algo(w),
                                reduce_amax=reduce_amax, backward_override=None, fp8_dpa=choice.fp8_dpa)
    if choice.recipe is TERecipeKind.MXFP8:
        return R.MXFP8BlockScaling(fp8_format=fmt, backward_override=override)
    if choice.recipe is TERecipeKind.CUSTOM:
        return R.CustomRecipe(qfactory=RoleQuantizers(choice, reduce_amax), fp8_format=fmt, backward_override=override)
    if choice.recipe is TERecipeKind.CURRENT:
        out = R.Float8CurrentScaling(fp8_format=fmt, use_power_2_scales=a.pow2_scales, backward_override=override,
                                     fp8_dpa=choice.fp8_dpa)
    else:  # TERecipeKind.BLOCK, the last kind (TERecipe refuses any other name when it is built)
        dim = lambda p: 1 if not p.is_fp8 or p.block[0] == 1 else 2  # noqa: E731
        out = R.Float8BlockScaling(fp8_format=fmt, x_block_scaling_dim=dim(a), w_block_scaling_dim=dim(w),
                                   grad_block_scaling_dim=dim(g), backward_override=override)
    # Per-role scale options: class-level QParams in TE (not constructor fields); TE's linears read them per role.
    out.fp8_quant_fwd_inp = R.QParams(power_2_scale=a.pow2_scales, amax_epsilon=a.amax_epsilon)
    out.fp8_quant_fwd_weight = R.QParams(power_2_scale=w.pow2_scales, amax_epsilon=w.amax_epsilon)
    if g.is_fp8:
        out.fp8_quant_bwd_grad = R.QParams(power_2_scale=g.pow2_scales, amax_epsilon=g.amax_epsilon)
    return out


# ---------------------------------------------------------------------------------------------------------------
# FP8-stored weights


_FP8_ROWWISE = ("data", "fp8_scale_inv", "rowwise_data", "rowwise_scale_inv")  # TE's get_metadata() keys


def _fp8_data(param: Any) -> dict[str, torch.Tensor]:
    """The tensors a TE QuantizedTensor is made of (FP8 data, scale inverses, transposes: whichever it holds)."""
    return {k: v for k, v in param.get_metadata().items() if isinstance(v, torch.Tensor)}


def _empty_extra_state() -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


# ---------------------------------------------------------------------------------------------------------------
# The controller


def _kind(choice: TERecipe | None) -> str:
    return BF16 if choice is None else (FP8_FWD if choice.forward_only else FP8)


def what_ran(module: torch.nn.Module) -> str:
    """BF16, FP8 or FP8_FWD (FP8 forward, BF16 backward) for a TE linear's last forward, from its own flags."""
    if not getattr(module, "fp8", False):
        return BF16
    return FP8_FWD if module.fp8_meta["recipe"].backward_override is not None else FP8


class TEPrecision:
    """Executes a PrecisionPlan on Transformer Engine modules (the training loop's precision controller).

    ``layers``: this rank's TransformerLayers by global layer number (plan layer i = layers[i]; a pipeline stage
    holds some of them); ``linears``: its TE linear modules by plan name (the LM head's when it runs FP8; a grouped
    expert linear by its own name, ``rows`` naming the experts' plan rows it runs);
    ``chunks``: per model chunk, the module spanning its TE modules, the GPTModel (the outer autocast of delayed
    scaling: per chunk, as Megatron-Core's own FP8 path does, with the LM head inside it).
    ``count``: record what each TE linear really ran (``step_kinds``, ``module_kinds``, ``mismatches`` against
    the plan) with a forward hook reading the module's own ``fp8`` flag and recipe (off for benchmarks).
    """

    def __init__(self, plan: PrecisionPlan, *, layers: Mapping[int, torch.nn.Module],
                 linears: Mapping[str, torch.nn.Module], chunks: Sequence[torch.nn.Module], amax_group: Any = None,
                 count: bool = True, attention: Mapping[int, torch.nn.Module] | None = None,
                 recipes: Mapping[TERecipe, Any] | None = None,
                 fp8_params: Mapping[str, torch.nn.Parameter] | None = None,
                 rows: Mapping[str, tuple[str, ...]] | None = None, expert_amax_group: Any = None):
        import transformer_engine.pytorch as te
        from transformer_engine.common.recipe import Float8CurrentScaling

        if plan.te is None:
            raise ValueError(f"te backend: the plan resolved backend {plan.backend!s} ({plan.backend_reason})")
        self.plan = plan
        self.full_precision_eval_interval = plan.recipe.schedule.full_precision_eval_interval
        self.linears = dict(linears)
        self.attention = {f"decoder.layers.{i}.self_attention.core_attention": m for i, m in (attention or {}).items()}
        """This rank's TE DotProductAttention modules by name: their delayed-scaling state when attention runs FP8."""
        self._attention_layer = {n: i for i, n in zip((attention or {}), self.attention)}
        self._layer_choices: dict[int, TERecipe | None] = {}
        self._autocast = te.autocast
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager

        self._fp8_state_manager = FP8GlobalStateManager  # (its quantization_state is replaced by reset(): read per call)
        self._group = amax_group
        # the routed experts' delayed amaxes: reduced over the ranks holding the same experts (their own autocast)
        self._expert_group = amax_group if expert_amax_group is None else expert_amax_group
        self._reduce_amax = plan.recipe.amax_reduction is not AmaxReduction.NONE
        # Disabled autocasts get a stateless recipe and no group: never the key of any delayed-scaling buffer.
        self._off = (False, Float8CurrentScaling(), None)
        self._recipes: dict[TERecipe, Any] = dict(recipes or {})  # those the FP8 weights were quantized with
        self.fp8_params = dict(fp8_params or {})
        """This rank's FP8-stored weights (TE QuantizedTensors) by ``<linear name>.<param>``: their bytes are state."""
        self.rows = {n: tuple((rows or {}).get(n, (n,))) for n in self.linears}
        """The plan rows each linear runs: its own name, or a grouped expert linear's experts (one TE recipe)."""
        self._layer_of = {n: plan.layout.layer_of(r[0]) for n, r in self.rows.items()}
        self._experts = {n for n, r in self.rows.items() if plan.layout.expert_of(r[0]) is not None}
        self._layer_ctx: dict[int, tuple | None] = dict.fromkeys(layers, self._off)
        self._module_ctx: dict[str, tuple | None] = {}
        self._outer: tuple | None = None
        self._graphed: str | None = None
        """The stage Megatron-Core's CUDA graphs were captured in (graph_capture), or None."""
        self._choices: dict[str, TERecipe | None] = {}
        self._expected: dict[str, str] = {}
        self._roles: frozenset[Role] | None = None
        self._step = 0
        self.step_plan: StepPlan | None = None
        """This step's plan (set by begin_step; the statistics hooks of backends/te_observe.py read it)."""
        self._pending: dict[str, dict[str, torch.Tensor]] = {}
        self._replanned = False  # replan() gave a new plan: the next _apply moves the changed modules' state
        self._dropped: set[str] = set()  # linears a replan put in BF16: their state is not carried past it
        self._te_modules = [*self.linears.values()]  # every TE module with FP8 state (the LM head's is outside)
        self._snapshot = StepSnapshot()  # the delayed state at the start of a step, for skip_step
        self.step_kinds: dict[int, Counter] = defaultdict(Counter)
        self.module_kinds: Counter = Counter()
        self.mismatches: Counter = Counter()
        for i, layer in layers.items():
            self._wrap(layer, lambda i=i: self._layer_ctx[i])
            if hasattr(layer, "_te_cuda_graph_replay"):  # Megatron-Core's TE graph replay: not through forward
                self._wrap(layer, lambda i=i: self._layer_ctx[i], "_te_cuda_graph_replay")
        for name, module in self.linears.items():
            self._wrap(module, lambda name=name: self._module_ctx.get(name))
            if count:
                module.register_forward_hook(self._counter(name))
        for chunk in chunks:
            self._wrap(chunk, lambda: self._outer)
            for module in chunk.modules():  # every TE module (linears, attention): see the module docstring
                if hasattr(module, "fp8_meta"):  # TE's TransformerEngineBaseModule and only it carries fp8_meta
                    module.get_extra_state = _empty_extra_state
                    self._te_modules.append(module)
        self._te_modules = list({id(m): m for m in self._te_modules}.values())  # (the linears are in the chunks too)
        self._cached_weights = [m for m in self.linears.values() if hasattr(m, "is_first_microbatch")]

    # -- wiring ----------------------------------------------------------------------------------------------------
    def _wrap(self, module: torch.nn.Module, context: Callable[[], tuple | None], attr: str = "forward") -> None:
        inner, autocast, manager = getattr(module, attr), self._autocast, self._fp8_state_manager

        def forward(*args, **kwargs):
            ctx = context()
            if ctx is None:
                return inner(*args, **kwargs)
            with autocast(enabled=ctx[0], recipe=ctx[1], amax_reduction_group=ctx[2]):
                out = inner(*args, **kwargs)
                consumed = not manager.quantization_state.is_first_fp8_module
            # TE's autocast restores on exit the flag "the next FP8 module is the first one", which an FP8 module
            # inside consumed: a nested autocast would re-arm it, and every layer's first FP8 module would then
            # reduce and roll every backward amax history after its backward (L + 2 times per micro-batch, not 1).
            # Nested in the outer autocast, the flag stays consumed, as under one autocast (Megatron-Core's).
            state = manager.quantization_state
            if consumed and state.autocast_depth > 0:
                state.is_first_fp8_module = False
            return out

        setattr(module, attr, forward)

    def _counter(self, name: str) -> Callable:
        from megatron.core.transformer.cuda_graphs import is_graph_capturing

        def hook(module, args, output):
            if is_graph_capturing():  # (the graphs' warmup and capture: no step's forward; replays are not counted)
                return
            got = what_ran(module)
            expected = self._expected.get(name, BF16)
            if got != expected:
                self.mismatches[(name, expected, got)] += 1
            if module.training:
                self.step_kinds[self._step][got] += 1
                self.module_kinds[(name, got)] += 1
        return hook

    def te_recipe(self, choice: TERecipe) -> Any:
        """The TE recipe object of `choice`, built once (docs/facts.md: one object per layer or shared: same speed)."""
        if choice not in self._recipes:
            self._recipes[choice] = te_recipe(choice, reduce_amax=self._reduce_amax)
        return self._recipes[choice]

    def _ctx(self, choice: TERecipe | None, group: Any = None) -> tuple:
        return self._off if choice is None else (True, self.te_recipe(choice), self._group if group is None else group)

    def _apply(self, sp: StepPlan) -> None:
        """Derive every autocast of a stage from the plan: per layer its own TE recipe (``StepPlan.layers_te``), per
        linear an override where it differs (a ``modules:`` policy, a BF16 pattern), its own for a linear outside the
        layers (the LM head), and the outer autocast when any choice has delayed state."""
        if self._graphed is not None:
            raise ValueError(f"te backend: CUDA graphs were captured in stage {self._graphed!r} and replay its "
                             f"recipe; the plan's stage {sp.stage!r} would need them captured again")
        choices = {n: sp.modules[self.rows[n][0]].te for n in self.linears}  # (a grouped linear's rows agree)
        by_layer: dict[int | None, list[str]] = defaultdict(list)
        for name in self.linears:
            by_layer[self._layer_of[name]].append(name)
        for n in by_layer.pop(None, []):
            self._module_ctx[n] = self._ctx(choices[n])
        old_layers = dict(self._layer_choices)
        for i in self._layer_ctx:
            names = by_layer.get(i, [])
            layer_choice = sp.layers_te.get(i)
            self._layer_choices[i] = layer_choice  # its attention runs under it (FP8 when its fp8_dpa is set)
            self._layer_ctx[i] = self._ctx(layer_choice)
            for n in names:  # (an expert's own autocast also where its amaxes reduce over other ranks)
                group = self._expert_group if n in self._experts else self._group
                same = choices[n] == layer_choice and group is self._group
                self._module_ctx[n] = None if same else self._ctx(choices[n], group)
        delayed = next((c for c in choices.values() if c is not None and c.delayed), None)
        self._outer = None if delayed is None else self._ctx(delayed)
        for name, choice in choices.items():  # a cached FP8 weight belongs to the old quantizer: drop it
            if name in self._choices and self._choices[name] != choice:
                getattr(self.linears[name], "_fp8_workspaces", {}).clear()
        if self._replanned:
            self._move_states(choices, old_layers)
            self._replanned = False
        self._choices = choices
        self._expected = {n: _kind(c) for n, c in choices.items()}
        self._restore_pending()

    def _restore_pending(self) -> None:
        for name in list(self._pending):
            if name in self.attention:
                choice = self._layer_choices.get(self._attention_layer[name])
                if choice is not None and choice.delayed and choice.fp8_dpa:
                    restore_delayed(name, self.attention[name], self._pending.pop(name), self.te_recipe(choice),
                                     num_gemms=3)
                continue
            choice = self._choices.get(name)
            if choice is not None and choice.delayed:
                module = self.linears[name]
                restore_delayed(name, module, self._pending.pop(name), self.te_recipe(choice),
                                 num_gemms=getattr(module, "num_gemms", 1))  # a GroupedLinear: one per expert

    def _move_states(self, choices: Mapping[str, TERecipe | None], old_layers: Mapping[int, TERecipe | None]) -> None:
        """After a replan, at the first step it applies to: every linear whose TE recipe changed gets its new
        recipe's quantizers and state, its delayed amaxes carried (backends/te_state.py); one put in BF16 keeps its
        state untouched and starts afresh when it runs FP8 again (as the emulated backend drops and recreates its
        scalers). FP8 attention of a layer whose recipe changed is rebuilt by TE, which keeps its delayed state
        where the shapes agree. Then every module joins TE's amax buffers again, under its recipe now."""
        for name, choice in choices.items():
            old = self._choices.get(name)
            if name not in self._choices or old == choice:
                continue
            if choice is None:
                self._dropped.add(name)
                continue
            _, recipe, group = self._ctx(choice, self._expert_group if name in self._experts else None)
            move_delayed(self.linears[name], recipe, None if name in self._dropped else old, choice,
                         lambda r=recipe, g=group: self._autocast(enabled=True, recipe=r, amax_reduction_group=g))
            self._dropped.discard(name)
        for name, module in self.attention.items():
            layer = self._attention_layer[name]
            if old_layers.get(layer) != self._layer_choices.get(layer):
                module.fp8_meta_tensors_initialized = False
        reregister(self._fp8_state_manager, self._te_modules)

    def replan(self, plan: PrecisionPlan) -> None:
        """Run `plan` from the next begin_step on (the autopilot changed the recipe between steps; the same model
        layout): there each TE module whose recipe changed is moved to it (:meth:`_move_states`)."""
        if plan.te is None:
            raise ValueError(f"te backend: replan needs a TE plan (this one resolved {plan.backend!s})")
        if plan.layout.module_names != self.plan.layout.module_names:
            raise ValueError("te backend: replan needs a plan of the same model layout")
        if self.fp8_params:
            raise ValueError("te backend: FP8-stored weights are quantized with their layer's recipe: no replan")
        self.plan, self._roles, self._replanned = plan, None, True
        self.full_precision_eval_interval = plan.recipe.schedule.full_precision_eval_interval

    # -- the Precision protocol ------------------------------------------------------------------------------------
    def begin_step(self, step: int) -> str:
        self._step = step
        sp = self.step_plan = self.plan.at(step)
        if sp.roles_fp8 != self._roles:
            self._apply(sp)
            self._roles = sp.roles_fp8
        self._weights_changed()
        if self._outer is not None:  # (a step with delayed scaling somewhere: its state, for skip_step)
            self._snapshot.take(self._te_modules)
        return sp.stage

    def _weights_changed(self) -> None:
        # Megatron-Core's TE linears quantize the weight on the first micro-batch and reuse it until told again
        # (its schedules call set_is_first_microbatch(), which acts only when config.fp8 is set: not here).
        for m in self._cached_weights:
            m.is_first_microbatch = True

    def graph_capture(self, layers: Sequence[int]) -> dict[str, Any]:
        """TE make_graphed_callables' quantization arguments for capturing ``layers`` (plan layer numbers, in the
        callables' order) in this step's stage, where Megatron-Core's TECudaGraphHelper would take them from its
        own FP8 config: per layer FP8 or not, the one TE recipe (this backend's object: the delayed state TE
        registers under it is the eager steps'), cached FP8 weights, the amax group. The replay runs under the
        layer's own autocast (``_wrap`` wraps Megatron-Core's replay as it wraps the forward): TE's replay reads
        the autocast (its "first FP8 module" flag, weight caching, delayed amax updates), and so do the layer
        parts a partial graph leaves eager (a dropless MoE's experts). ValueError (one line) when the layers
        differ in recipe or a linear inside runs its own (a ``modules:`` policy, a BF16 pattern), or later when
        the stage changes (_apply)."""
        problem = self.step_plan.graph_problem(layers)
        inside = [n for n, i in self._layer_of.items() if i in set(layers) and self._module_ctx.get(n) is not None]
        if problem is None and inside:  # (the plan agrees, but the experts reduce amaxes over a group of their own)
            problem = (f"CUDA graphs capture a layer under one autocast; {inside[0]} runs its own (its amaxes "
                       f"reduce over the ranks holding its expert)")
        if problem is not None:
            raise ValueError(f"te backend: {problem}")
        choice = next((c for i in layers if (c := self._layer_choices.get(i)) is not None), None)
        self._graphed = self.step_plan.stage
        if choice is None:
            return {"fp8_enabled": False}
        return {"fp8_enabled": tuple(self._layer_choices.get(i) is not None for i in layers),
                "fp8_recipe": self.te_recipe(choice), "fp8_weight_caching": True, "fp8_group": self._group}

    def graphs_captured(self) -> None:
        """After the capture: put back the delayed state the step found. TE's capture runs warmup forwards and
        backwards on the graphs' static inputs and uninitialised output gradients, whose amaxes reach the histories;
        TE saves and restores that state only for its DelayedScaling recipe, not for the CustomRecipe of a per-role
        mix (plan/te.py)."""
        if self._outer is not None:
            self._snapshot.restore(self._te_modules)

    @contextlib.contextmanager
    def high_precision(self) -> Iterator[None]:
        saved = (dict(self._layer_ctx), self._module_ctx, self._outer, self._expected)
        self._layer_ctx = dict.fromkeys(self._layer_ctx, self._off)
        self._module_ctx, self._outer = {}, None
        self._expected = dict.fromkeys(self.linears, BF16)
        try:
            yield
        finally:
            self._layer_ctx, self._module_ctx, self._outer, self._expected = saved

    def after_optimizer_step(self, step: int) -> None:
        # TE updates delayed scales itself (autocast exit, backward); the weights changed: requantize them next.
        self._weights_changed()

    def skip_step(self, step: int) -> None:
        # The weights did not change, so cached FP8 weights stay valid. TE has rolled the skipped step's amaxes into
        # its histories (and updated scales from them between micro-batches): put back the state the step found,
        # as the emulated backend forgets them (backends/te_state.StepSnapshot).
        if self._outer is not None:
            self._snapshot.restore(self._te_modules)

    def scales(self) -> dict[str, dict[str, list[float]]]:
        """This rank's delayed scales per TE linear: forward (input, weight) and backward (grad_output) as TE keeps
        them (for the multi-rank checks: one amax-reduction group must agree)."""
        out = {}
        for name, module in self.linears.items():
            tensors = delayed_tensors(module)
            if tensors:
                out[name] = {k: tensors[f"scale_{k}"].float().flatten().tolist() for k in ("fwd", "bwd")}
        return out

    def state_dict(self) -> dict:
        delayed = dict(self._pending)  # not put back yet (the module has not run FP8 since loading): keep them
        for name, module in {**self.linears, **self.attention}.items():
            tensors = delayed_tensors(module)
            if tensors:
                delayed[name] = {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}
        out = {"recipe": self.plan.recipe.name, "delayed": delayed}
        if self.fp8_params:
            out["fp8_params"] = {name: {k: v.detach().to("cpu", copy=True) for k, v in _fp8_data(p).items()}
                                 for name, p in self.fp8_params.items()}
        return out

    def load_state_dict(self, state: dict) -> None:
        self._pending = {n: dict(t) for n, t in state.get("delayed", {}).items()
                         if n in self.linears or n in self.attention}
        if self._roles is not None:
            self._restore_pending()
        # (a checkpoint without them was saved with BF16 weights: the model's state dict quantized them already)
        self._restore_fp8_params(state.get("fp8_params") or {})

    def _restore_fp8_params(self, saved: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """The FP8 weights' exact bytes, in place (their storage is the DDP buffer's), then what TE derives from them
        after Megatron-Core's param all-gather (the transpose or column-wise copy) made again."""
        restored = []
        for name, param in self.fp8_params.items():
            if name not in saved:
                continue
            current = _fp8_data(param)
            with torch.no_grad():
                for key, value in saved[name].items():
                    have = tuple(current[key].shape) if key in current else None
                    if have == tuple(value.shape):
                        current[key].copy_(value)
                    elif key in _FP8_ROWWISE:  # (a column-wise copy TE holds at one time and not at another is
                        #                        made again below, or by the next quantization)
                        raise ConfigError(f"{name}: FP8 weight {key} has shape {tuple(value.shape)} in the checkpoint "
                                         f"and {have} here; resume with the recipe it was saved with")
            restored.append(param)
        if restored:
            from transformer_engine.pytorch.tensor.utils import post_all_gather_processing

            post_all_gather_processing(restored)

    # -- what ran ----------------------------------------------------------------------------------------------------
    def execution_summary(self) -> dict[str, Any]:
        """Training forwards of TE linears by kind (fp8 / fp8 fwd / bf16), per stage, and mismatches vs the plan."""
        by_stage: dict[str, Counter] = defaultdict(Counter)
        for step, kinds in self.step_kinds.items():
            by_stage[self.plan.at(step).stage].update(kinds)
        total = Counter()
        for (_, kind), n in self.module_kinds.items():
            total[kind] += n
        return {"module_forwards": dict(total), "by_stage": {s: dict(c) for s, c in by_stage.items()},
                "plan_mismatches": sum(self.mismatches.values()),
                "mismatch_examples": [f"{n}: planned {e}, ran {g}" for (n, e, g) in list(self.mismatches)[:5]]}
