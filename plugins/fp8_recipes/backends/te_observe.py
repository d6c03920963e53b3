"""Numerics statistics and dumps on the Transformer Engine backend: the recorder's observer protocol, fed by hooks.

    states = te_observer_states(precision)      # name -> TEObservedLinear, hooks on each TE linear
    recorder.attach(states)                     # the same NumericsRecorder as the emulated backend's

TE quantizes a linear's operands inside its fused autograd functions and hands none of them out. Our numerics
core reproduces TE's quantization bit for bit (tests/gpu/test_te_numerics.py: current, delayed and block scaling),
and so does the recorder's fused statistics kernel (tests/gpu/test_fused_stats_gpu.py), so the operands are quantized
again by the recorder, from the tensors the GEMMs read, with the policy the plan gives the module this step
(``ModulePlan.gemms``: what TE really runs, after substitutions) and, for delayed scaling, the scale TE holds for
that operand. The hooks hand over the high-precision operands:

- forward hook (after the module ran, so only when it really ran FP8: ``module.fp8``): the activations (input;
  for ``LayerNormLinear`` the normalisation is recomputed from the module's own parameters, see
  :func:`_gemm_input`) and the weight, for fprop and for the backward GEMMs that read them columnwise;
- a hook on the output tensor's gradient (before the module's backward): the gradients, for dgrad and wgrad.

Delayed scales are read from ``fp8_meta`` at those moments: TE updates forward scales when the outermost autocast
exits and backward scales after the last module's backward, so both reads see the scale the GEMMs used. Current
scaling's amax is each rank's own, except under sequence parallelism, where TE MAX-reduces it over the
tensor-parallel ranks for the operands it all-gathers in FP8 (a column-parallel linear's input, a row-parallel
one's output gradient: ``set_quantizer_amax_reduction_group`` in TE 2.20.2's linear modules); the recorder is handed
the same reduction for those roles (``amax_reducers``), so its copy has TE's scale.

Grouped experts (Megatron-Core's TEGroupedMLP: one TE GroupedLinear runs a GEMM per local expert) are observed per
expert, as the plan's rows: the input and the output gradient are split by the forward's ``m_splits`` (the token
counts after FP8 padding, so an expert's split holds its padding's zero rows as TE quantizes them), expert ``e``'s
weight is ``weight{e}``, and its delayed scales are TE's slots ``3e`` (input), ``3e+1`` (weight) and ``2e``
(grad_output); an expert that got no token this micro-batch hands over its weight alone (TE quantizes nothing else
for it), as the emulated backend's rows do.

Only a run with a ``debug`` section creates these hooks; between due steps they return at once (observer None).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fp8_recipes.backends.groups import max_reducer
from fp8_recipes.backends.te_state import delayed_column, delayed_tensors
from fp8_recipes.plan.precision import Gemm, ModulePlan
from fp8_recipes.recipe.schema import Role, Scaling

__all__ = ["TEObservedExpert", "TEObservedLinear", "te_observer_states"]

_FORWARD_OPERANDS = ((Gemm.FPROP, Role.ACTIVATIONS), (Gemm.FPROP, Role.WEIGHTS), (Gemm.DGRAD, Role.WEIGHTS),
                     (Gemm.WGRAD, Role.ACTIVATIONS))
_BACKWARD_OPERANDS = ((Gemm.DGRAD, Role.GRADIENTS), (Gemm.WGRAD, Role.GRADIENTS))
_WEIGHT_OPERANDS = ((Gemm.FPROP, Role.WEIGHTS), (Gemm.DGRAD, Role.WEIGHTS))


class _TEScale:
    """The delayed scale TE holds for one operand (a DelayedScaler's ``scale``, read only): its column in the
    module's state under the TE recipe it runs this step (backends/te_state.delayed_column: a CustomRecipe keeps
    only its delayed roles' columns)."""

    def __init__(self, module: torch.nn.Module, role: Role, gemm: int, choice: Callable[[], Any]):
        self.module, self.role, self.gemm, self._choice = module, role, gemm, choice

    @property
    def scale(self) -> torch.Tensor:
        gemms = (getattr(self.module, "fp8_meta", None) or {}).get("num_gemms", getattr(self.module, "num_gemms", 1))
        where = delayed_column(self._choice(), gemms, self.role, self.gemm)
        scale = delayed_tensors(self.module).get(where[0]) if where is not None else None
        if scale is None:  # not allocated before the module's first FP8 forward: TE's 1.0
            return torch.ones((), dtype=torch.float32)
        return scale[where[1]]


class TEObservedLinear:
    """One TE linear as the recorder sees it (EmulatedLinearState's observer slots): ``name``, ``plan`` (the
    module's plan this step), ``scalers``, ``amax_reducers``, ``record_amax`` and ``observer``."""

    def __init__(self, name: str, module: torch.nn.Module, step_plan: Callable[[], Any], gemm: int = 0):
        self.name = name
        self.module = module
        self._step_plan = step_plan
        self.scalers = {role: _TEScale(module, role, gemm, lambda: self.plan.te) for role in Role}
        self.amax_reducers = _sequence_parallel_reducers(module)
        self.record_amax = True
        self.observer: Callable[..., None] | None = None
        if type(self) is TEObservedLinear:
            module.register_forward_hook(self._after_forward)

    @property
    def plan(self) -> ModulePlan:
        return self._step_plan().modules[self.name]

    def _emit(self, operands: tuple[tuple[Gemm, Role], ...], tensors: dict[Role, torch.Tensor]) -> None:
        """Hand each (GEMM, role) operand to the observer, unquantized (``fq`` None): the recorder quantizes it as
        TE did (:func:`~fp8_recipes.observe.stats.measure`: the policy of the plan, and for delayed scaling the
        scale TE holds, from ``scalers``; one Triton kernel on the GPU). Both GEMMs' operands of a role are the
        same tensor object, so the recorder measures a copy once when the two are quantized alike."""
        for gemm, role in operands:
            if self.observer is None:
                return
            if self.plan.gemms[gemm].policy(role) is not None:
                self.observer(self, gemm, role, tensors[role], None)

    def _after_forward(self, module, args, output) -> None:
        if self.observer is None or not module.training or not getattr(module, "fp8", False):
            return
        te = self.plan.te  # TE's fused norm + FP8 cast (see _gemm_input): a delayed input quantizer, FP8 backward
        fused = te is not None and te.activations.scaling is Scaling.DELAYED and not te.forward_only
        self._emit(_FORWARD_OPERANDS, {Role.ACTIVATIONS: _gemm_input(module, args[0], fused),
                                       Role.WEIGHTS: module.weight.detach()})
        out = output[0] if isinstance(output, tuple) else output
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self._on_grad)

    def _on_grad(self, grad: torch.Tensor) -> None:
        if self.observer is not None:
            self._emit(_BACKWARD_OPERANDS, {Role.GRADIENTS: grad.detach()})


class TEObservedExpert(TEObservedLinear):
    """One expert GEMM of a grouped expert linear (plan row ``name``: GEMM ``gemm`` of ``module``), fed by
    :class:`_GroupedHooks` with its own split of the tokens."""

    def __init__(self, name: str, module: torch.nn.Module, step_plan: Callable[[], Any], gemm: int):
        super().__init__(name, module, step_plan, gemm)
        self.gemm = gemm

    def forward_operands(self, x: torch.Tensor) -> None:
        if self.observer is None:
            return
        # an expert without tokens: TE still quantizes its weight (its history rolls), not its empty input
        operands = _FORWARD_OPERANDS if x.shape[0] > 0 else _WEIGHT_OPERANDS
        self._emit(operands, {Role.ACTIVATIONS: x, Role.WEIGHTS: getattr(self.module, f"weight{self.gemm}").detach()})

    def backward_operands(self, grad: torch.Tensor) -> None:
        if self.observer is not None and grad.shape[0] > 0:
            self._emit(_BACKWARD_OPERANDS, {Role.GRADIENTS: grad})


class _GroupedHooks:
    """A grouped expert linear's forward hook and output-gradient hook, splitting by ``m_splits`` per expert."""

    def __init__(self, module: torch.nn.Module, experts: list[TEObservedExpert]):
        self.experts = experts
        module.register_forward_hook(self._after_forward)

    def _after_forward(self, module, args, output) -> None:
        if all(e.observer is None for e in self.experts) or not module.training or not getattr(module, "fp8", False):
            return
        splits = [int(m) for m in args[1]]
        for expert, x in zip(self.experts, torch.split(args[0].detach(), splits)):
            expert.forward_operands(x)
        out = output[0] if isinstance(output, tuple) else output
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad: self._on_grad(grad, splits))

    def _on_grad(self, grad: torch.Tensor, splits: list[int]) -> None:
        for expert, g in zip(self.experts, torch.split(grad.detach(), splits)):
            expert.backward_operands(g)


def _sequence_parallel_reducers(module: torch.nn.Module) -> dict[Role, Callable[[torch.Tensor], torch.Tensor]]:
    """The roles whose current-scaling amax TE reduces over the tensor-parallel group for this module: under
    sequence parallelism, a column-parallel linear's input and a row-parallel linear's output gradient."""
    group = getattr(module, "tp_group", None)
    if not getattr(module, "sequence_parallel", False) or group is None:
        return {}
    role = {"column": Role.ACTIVATIONS, "row": Role.GRADIENTS}.get(getattr(module, "parallel_mode", None))
    if role is None:
        return {}
    return {role: max_reducer(group)}


def _gemm_input(module: torch.nn.Module, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """The tensor the forward GEMM's input quantizer reads. TE's ``LayerNormLinear`` normalises inside its own
    kernel and keeps the result to itself: recompute it in float32 from the module's weights (RMSNorm or
    LayerNorm, ``zero_centered_gamma``). With a delayed-scaling input quantizer and an FP8 backward (`fused`: a
    DelayedScaling recipe, or a CustomRecipe's DelayedScalingRequest, both a Float8Quantizer) TE's kernel casts that
    float32 result straight to FP8 (TE 2.20 normalization.cpp: the fully fused path of Float8Quantizers;
    layernorm_linear.py takes it unless a backward_override is set), so it is returned as is; every other quantizer
    reads the normalised tensor rounded to the input's dtype first."""
    x = x.detach()
    norm = getattr(module, "normalization", None)
    weight = getattr(module, "layer_norm_weight", None)
    if norm is None or weight is None:
        return x
    xf = x.float()
    gamma = weight.float() + (1.0 if getattr(module, "zero_centered_gamma", False) else 0.0)
    if norm == "RMSNorm":
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + module.eps) * gamma
    else:
        y = torch.nn.functional.layer_norm(xf, xf.shape[-1:], eps=module.eps) * gamma
        bias = getattr(module, "layer_norm_bias", None)
        if bias is not None:
            y = y + bias.float()
    return y if fused else y.to(x.dtype)


def te_observer_states(precision) -> dict[str, TEObservedLinear]:
    """Hooks on every TE linear of a :class:`~fp8_recipes.backends.te.TEPrecision`; plan row -> observed state
    (a grouped expert linear: a state per expert)."""
    out: dict[str, TEObservedLinear] = {}
    step_plan = lambda: precision.step_plan  # noqa: E731
    for name, module in precision.linears.items():
        rows = precision.rows.get(name, (name,))
        if rows == (name,):
            out[name] = TEObservedLinear(name, module, step_plan)
            continue
        experts = [TEObservedExpert(row, module, step_plan, e) for e, row in enumerate(rows)]
        _GroupedHooks(module, experts)
        out.update({e.name: e for e in experts})
    return out
