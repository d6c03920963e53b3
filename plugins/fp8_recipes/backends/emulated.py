"""The emulated FP8 backend: Megatron-Core linear layers whose GEMM operands are fake-quantized per the plan.

Each GEMM sees its operands exactly as an FP8 GEMM would (codes x scales, per the role's policy, quantized along
the GEMM's reduction dimension), and multiplies them in the layer's dtype:

    fprop  y  = q(x, activations) @ q(w, weights)^T          blocks along in_features
    dgrad  dx = q(dy, gradients) @ q(w, weights, columnwise)   blocks along out_features
    wgrad  dw = q(dy, gradients, columnwise)^T @ q(x, activations, columnwise)   blocks along tokens

so any per-role mix, any block shape and MXFP8 run on any device. Delayed scaling keeps one DelayedScaler per
module and role; its scale is updated after each optimizer step, with the amax MAX-reduced over the recipe's
``amax_reduction`` group when distributed. Nothing here decides precision: :class:`EmulatedPrecision` hands each
layer its :class:`~fp8_recipes.plan.ModulePlan` for the step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from fp8_recipes.backends.groups import amax_reduction_group
from fp8_recipes.numerics import DelayedScaler, block_for, dequantize, quantize
from fp8_recipes.plan import Gemm, ModulePlan, PrecisionPlan
from fp8_recipes.schema import ROLES, AmaxReduction, Role, Scaling, TensorPolicy

__all__ = ["EmulatedLinearState", "EmulatedPrecision", "emulated_linear"]


class EmulatedLinearState:
    """Per-module precision state: the plan for the current step and the delayed-scaling scalers."""

    def __init__(self, name: str):
        self.name = name
        self.plan: ModulePlan | None = None
        self.scalers: dict[Role, DelayedScaler] = {}
        self.amax_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.enabled = True  # False inside EmulatedPrecision.high_precision()
        # Delayed scaling records amaxes in training only: evaluation reads the scales but must not steer them
        # (and a resumed run stays bit-exact). The layer sets this from module.training at each forward.
        self.record_amax = True
        self.observer: Callable[..., None] | None = None  # statistics hook: (state, gemm, role, hp, fq)

    def policy(self, gemm: Gemm, role: Role) -> TensorPolicy | None:
        if self.plan is None or not self.enabled:
            return None
        return self.plan.gemms[gemm].policy(role)

    def reusable(self, earlier: Gemm, later: Gemm, role: Role, shape) -> bool:
        """Whether `later`'s columnwise copy of this role's operand equals `earlier`'s rowwise one."""
        p = self.policy(earlier, role)
        return (p is not None and p == self.policy(later, role)
                and block_for(p, shape) == block_for(p, shape, columnwise=True))

    def reused(self, fq: torch.Tensor, hp: torch.Tensor, gemm: Gemm, role: Role) -> torch.Tensor:
        """An earlier GEMM's copy, reused by `gemm` (the observer still sees it as this GEMM's operand)."""
        if self.observer is not None:
            self.observer(self, gemm, role, hp, fq)
        return fq

    def quantized(self, t: torch.Tensor, gemm: Gemm, role: Role, columnwise: bool) -> torch.Tensor:
        policy = self.policy(gemm, role)
        if policy is None:
            return t
        q = quantize(t, policy, columnwise=columnwise, scaler=self.scalers.get(role),
                     amax_reduce=self.amax_reduce if policy.scaling is Scaling.TENSORWISE else None,
                     record_amax=self.record_amax)
        out = dequantize(q)  # fake_quant(), keeping the scales for the observer
        if self.observer is not None:
            self.observer(self, gemm, role, t, out, q)
        return out


class _EmulatedGemm(torch.autograd.Function):
    """Each operand is quantized once per GEMM that reads it, along that GEMM's reduction dim. When the columnwise
    copy a backward GEMM needs equals the rowwise one an earlier GEMM made (same policy, a per-tensor scale or a
    square block), the earlier copy is reused: the same values, one pass fewer (TE keeps one copy for both too)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, state: EmulatedLinearState):
        ctx.state = state
        xq = state.quantized(x, Gemm.FPROP, Role.ACTIVATIONS, columnwise=False)
        wq = state.quantized(w, Gemm.FPROP, Role.WEIGHTS, columnwise=False)
        keep_xq = state.reusable(Gemm.FPROP, Gemm.WGRAD, Role.ACTIVATIONS, x.shape)
        keep_wq = state.reusable(Gemm.FPROP, Gemm.DGRAD, Role.WEIGHTS, w.shape)
        ctx.kept = (keep_xq, keep_wq)
        ctx.save_for_backward(x, w, xq if keep_xq else None, wq if keep_wq else None)
        return torch.matmul(xq, wq.t())

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w, xq_f, wq_f = ctx.saved_tensors
        keep_xq, keep_wq = ctx.kept
        state: EmulatedLinearState = ctx.state
        dx = dw = dyq = None
        dy2 = dy.reshape(-1, dy.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        if ctx.needs_input_grad[0]:
            dyq = state.quantized(dy2, Gemm.DGRAD, Role.GRADIENTS, columnwise=False)
            wq = state.reused(wq_f, w, Gemm.DGRAD, Role.WEIGHTS) if keep_wq else \
                state.quantized(w, Gemm.DGRAD, Role.WEIGHTS, columnwise=True)
            dx = torch.matmul(dyq, wq).reshape(*dy.shape[:-1], w.shape[1])
        if ctx.needs_input_grad[1]:
            if dyq is not None and state.reusable(Gemm.DGRAD, Gemm.WGRAD, Role.GRADIENTS, dy2.shape):
                dyq_w = state.reused(dyq, dy2, Gemm.WGRAD, Role.GRADIENTS)
            else:
                dyq_w = state.quantized(dy2, Gemm.WGRAD, Role.GRADIENTS, columnwise=True)
            xq = state.reused(xq_f.reshape(x2.shape), x2, Gemm.WGRAD, Role.ACTIVATIONS) if keep_xq else \
                state.quantized(x2, Gemm.WGRAD, Role.ACTIVATIONS, columnwise=True)
            dw = torch.matmul(dyq_w.t(), xq)
        return dx, dw, None


def emulated_linear(x: torch.Tensor, w: torch.Tensor, state: EmulatedLinearState) -> torch.Tensor:
    """y = x @ w^T with the three GEMMs quantized as `state.plan` says (bias is added by the caller)."""
    return _EmulatedGemm.apply(x, w, state)


def _amax_reducer(kind: AmaxReduction) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """MAX all-reduce over the recipe's group, or None when there is nothing to reduce over."""
    import torch.distributed as dist

    group = amax_reduction_group(kind)
    if group is None:
        return None

    def reduce(amax: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        return amax

    return reduce


class EmulatedPrecision:
    """Drives every emulated layer from the plan (the training loop's precision controller)."""

    def __init__(self, plan: PrecisionPlan, states: dict[str, EmulatedLinearState]):
        unknown = set(states) - set(plan.layout.module_names)  # a pipeline stage holds a subset of the plan's
        if unknown:
            raise ValueError(f"emulated backend: the plan does not name these modules: {sorted(unknown)[:3]}")
        self.plan = plan
        self.states = states
        self.full_precision_eval_interval = plan.recipe.schedule.full_precision_eval_interval
        reduce = _amax_reducer(plan.recipe.amax_reduction)
        for state in states.values():
            state.amax_reduce = reduce
            state.scalers = {r: DelayedScaler(plan.recipe.policy(r)) for r in ROLES
                             if plan.recipe.policy(r).scaling is Scaling.DELAYED}
        self._reduce = reduce

    def begin_step(self, step: int) -> str:
        step_plan = self.plan.at(step)
        for name, state in self.states.items():
            state.plan = step_plan.modules[name]
        return step_plan.stage

    @contextlib.contextmanager
    def high_precision(self) -> Iterator[None]:
        saved = {n: s.enabled for n, s in self.states.items()}
        for s in self.states.values():
            s.enabled = False
        try:
            yield
        finally:
            for n, s in self.states.items():
                s.enabled = saved[n]

    def after_optimizer_step(self, step: int) -> None:
        for state in self.states.values():
            for scaler in state.scalers.values():
                scaler.update(self._reduce)

    def skip_step(self, step: int) -> None:
        # The skipped step's amaxes (slot 0, maybe inf/NaN) never reach a scale: torch.maximum would keep a NaN
        # there into the next step, and an inf would pin the scale for a whole history window.
        for state in self.states.values():
            for scaler in state.scalers.values():
                scaler.history[0] = 0.0

    def scales(self) -> dict[str, dict[str, float]]:
        """The current delayed scales per module and role (for logging and the multi-rank checks)."""
        return {n: {str(r): float(sc.scale) for r, sc in s.scalers.items()} for n, s in self.states.items()}

    def state_dict(self) -> dict:
        return {"recipe": self.plan.recipe.name,
                "scalers": {n: {str(r): sc.state_dict() for r, sc in s.scalers.items()}
                            for n, s in self.states.items() if s.scalers}}

    def load_state_dict(self, state: dict) -> None:
        for name, per_role in state.get("scalers", {}).items():
            if name not in self.states:
                continue
            for role, sd in per_role.items():
                scaler = self.states[name].scalers.get(Role(role))
                if scaler is not None:
                    scaler.load_state_dict(sd)
