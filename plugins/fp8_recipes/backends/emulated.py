"""The emulated FP8 backend: Megatron-Core linear layers whose GEMM operands are fake-quantized per the plan.

Each GEMM sees its operands exactly as an FP8 GEMM would (codes x scales, per the role's policy, quantized along
the GEMM's reduction dimension), and multiplies them in the layer's dtype:

    fprop  y  = q(x, activations) @ q(w, weights)^T          blocks along in_features
    dgrad  dx = q(dy, gradients) @ q(w, weights, columnwise)   blocks along out_features
    wgrad  dw = q(dy, gradients, columnwise)^T @ q(x, activations, columnwise)   blocks along tokens

so any per-role mix, any block shape, MXFP8 and NVFP4 run on any device. NVFP4 operands are TE's NVFP4 GEMMs'
(its reference quantizer, bit for bit): 1x16 blocks (16x16 weights) along each GEMM's reduction dim, the RHT on the
two wgrad copies where the plan keeps it (along the tokens wgrad sums over: the rotation cancels in the product;
a token count that is not a multiple of 16 is zero-padded to one there),
and stochastic rounding of gradients seeded by (run seed, step, module, GEMM, micro-batch), so a resumed run
draws the same numbers. Delayed scaling keeps one DelayedScaler per
module and role; its scale is updated after each optimizer step, with the amax MAX-reduced over the recipe's
``amax_reduction`` group when distributed. Nothing here decides precision: :class:`EmulatedPrecision` hands each
layer its :class:`~fp8_recipes.plan.precision.ModulePlan` for the step.

The core attention (recipe ``attention: fp8``, in the layers ``StepPlan.attention`` names) is quantized where
Transformer Engine's own FP8 attention emulation quantizes it (docs/facts.md, "Transformer Engine 2.20.2"):

    forward   QKV (Q, K and V together: one amax, one scale), S (the softmax output after dropout), O (the output)
    backward  dO (the output's gradient), dP (the pre-softmax scores' gradient), dQKV (dQ, dK, dV together)

each one fake-quantized (quantize, dequantize) with a per-tensor scale: the forward tensors with the activations'
policy, the backward ones with the gradients'; the other direction passes straight through. Tensorwise scaling
takes each tensor's own amax; delayed scaling keeps one DelayedScaler per layer and tensor, updated and reduced
with the linears'.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import torch

from fp8_recipes.backends.groups import amax_reduction_group, expert_amax_reduction_group, max_reducer
from fp8_recipes.checks import ConfigError
from fp8_recipes.numerics import DelayedScaler, dequantize, fake_quant, quantize
from fp8_recipes.numerics.nvfp4 import NVFP4_BLOCK, stochastic_rounding_seed
from fp8_recipes.plan.precision import Gemm, ModelLayout, ModulePlan, PrecisionPlan
from fp8_recipes.recipe.schema import ROLES, AmaxReduction, Attention, Role, Scaling, TensorPolicy

logger = logging.getLogger(__name__)

__all__ = [
    "ATTENTION_TENSORS", "EmulatedAttentionState", "EmulatedLinearState", "EmulatedPrecision",
    "attention_fake_quant", "emulated_linear",
]


class EmulatedLinearState:
    """Per-module precision state: the plan for the current step and the delayed-scaling scalers."""

    def __init__(self, name: str):
        self.name = name
        self.plan: ModulePlan | None = None
        self.scalers: dict[Role, DelayedScaler] = {}
        self.amax_reducers: dict[Role, Callable[[torch.Tensor], torch.Tensor]] = {}
        """Per role, the MAX-reduction of a current-scaling (tensorwise) amax; none on the CPU (see below)."""
        self.enabled = True  # False inside EmulatedPrecision.high_precision()
        # Delayed scaling records amaxes in training only: evaluation reads the scales but must not steer them
        # (and a resumed run stays bit-exact). The layer sets this from module.training at each forward.
        self.record_amax = True
        self.observer: Callable[..., None] | None = None  # statistics hook: (state, gemm, role, hp, fq)
        # Where NVFP4's stochastic rounding draws come from: the run's seed and step (set by EmulatedPrecision),
        # the backward pass of the step (micro-batches: one more each) and the GEMM
        self.run_seed = 0
        self.step = 0
        self.backwards = 0

    def sr_seed(self, gemm: Gemm) -> int:
        return stochastic_rounding_seed(self.run_seed, self.step, self.name, gemm, self.backwards)

    def policy(self, gemm: Gemm, role: Role) -> TensorPolicy | None:
        if self.plan is None or not self.enabled:
            return None
        return self.plan.gemms[gemm].policy(role)

    def reusable(self, earlier: Gemm, later: Gemm, role: Role) -> bool:
        """Whether `later`'s columnwise copy of this role's operand equals `earlier`'s rowwise one."""
        p = self.policy(earlier, role)
        return p is not None and p == self.policy(later, role) and p.one_copy_both_ways

    def reused(self, fq: torch.Tensor, hp: torch.Tensor, gemm: Gemm, role: Role) -> torch.Tensor:
        """An earlier GEMM's copy, reused by `gemm` (the observer still sees it as this GEMM's operand)."""
        if self.observer is not None:
            self.observer(self, gemm, role, hp, fq)
        return fq

    def quantized(self, t: torch.Tensor, gemm: Gemm, role: Role, columnwise: bool) -> torch.Tensor:
        policy = self.policy(gemm, role)
        if policy is None:
            return t
        amax_reduce = self.amax_reducers.get(role) if policy.scaling is Scaling.TENSORWISE else None
        seed = self.sr_seed(gemm) if policy.stochastic_rounding else None
        if self.observer is None:  # the values alone (NVFP4: without its codes, compiled on a GPU)
            return fake_quant(t, policy, columnwise=columnwise, scaler=self.scalers.get(role),
                              amax_reduce=amax_reduce, record_amax=self.record_amax, seed=seed)
        q = quantize(t, policy, columnwise=columnwise, scaler=self.scalers.get(role),
                     amax_reduce=amax_reduce, record_amax=self.record_amax, seed=seed)
        out = dequantize(q)  # fake_quant(), keeping the scales for the observer
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
        keep_xq = state.reusable(Gemm.FPROP, Gemm.WGRAD, Role.ACTIVATIONS)
        keep_wq = state.reusable(Gemm.FPROP, Gemm.DGRAD, Role.WEIGHTS)
        ctx.kept = (keep_xq, keep_wq)
        ctx.save_for_backward(x, w, xq if keep_xq else None, wq if keep_wq else None)
        return torch.matmul(xq, wq.t())

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w, xq_f, wq_f = ctx.saved_tensors
        keep_xq, keep_wq = ctx.kept
        state: EmulatedLinearState = ctx.state
        state.backwards += 1  # (a micro-batch's stochastic rounding draws its own numbers)
        dx = dw = dyq = None
        dy2 = dy.reshape(-1, dy.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        if ctx.needs_input_grad[0]:
            dyq = state.quantized(dy2, Gemm.DGRAD, Role.GRADIENTS, columnwise=False)
            wq = state.reused(wq_f, w, Gemm.DGRAD, Role.WEIGHTS) if keep_wq else \
                state.quantized(w, Gemm.DGRAD, Role.WEIGHTS, columnwise=True)
            dx = torch.matmul(dyq, wq).reshape(*dy.shape[:-1], w.shape[1])
        if ctx.needs_input_grad[1]:
            x2, dy2, padded = _rht_tokens(state, x2, dy2)
            if dyq is not None and not padded and state.reusable(Gemm.DGRAD, Gemm.WGRAD, Role.GRADIENTS):
                dyq_w = state.reused(dyq, dy2, Gemm.WGRAD, Role.GRADIENTS)
            else:
                dyq_w = state.quantized(dy2, Gemm.WGRAD, Role.GRADIENTS, columnwise=True)
            if keep_xq and not padded:
                xq = state.reused(xq_f.reshape(x2.shape), x2, Gemm.WGRAD, Role.ACTIVATIONS)
            else:
                xq = state.quantized(x2, Gemm.WGRAD, Role.ACTIVATIONS, columnwise=True)
            dw = torch.matmul(dyq_w.t(), xq)
        return dx, dw, None


def _rht_tokens(state: EmulatedLinearState, x2: torch.Tensor, dy2: torch.Tensor):
    """(x2, dy2, padded): the wgrad GEMM's operands, with zero tokens up to a multiple of 16 where its copies are
    RHT'd along the tokens (NVFP4 ``rht``) and the count is not (an expert's share, an odd seq x micro-batch): what
    a run that pads its tokens computes; the rotation still cancels, block by block, and the zeros add nothing."""
    policy = state.policy(Gemm.WGRAD, Role.ACTIVATIONS)
    pad = -x2.shape[0] % NVFP4_BLOCK if policy is not None and policy.rht else 0
    if not pad:
        return x2, dy2, False
    return torch.nn.functional.pad(x2, (0, 0, 0, pad)), torch.nn.functional.pad(dy2, (0, 0, 0, pad)), True


def emulated_linear(x: torch.Tensor, w: torch.Tensor, state: EmulatedLinearState) -> torch.Tensor:
    """y = x @ w^T with the three GEMMs quantized as `state.plan` says (bias is added by the caller)."""
    return _EmulatedGemm.apply(x, w, state)


ATTENTION_TENSORS = ("QKV", "S", "O", "dO", "dP", "dQKV")
"""The tensors FP8 attention quantizes, by Transformer Engine's quantizer names; the first three forward."""
_FORWARD_TENSORS = frozenset(ATTENTION_TENSORS[:3])


class EmulatedAttentionState:
    """One layer's core attention: whether the step runs it in FP8, the six tensors' policies and delayed scalers."""

    def __init__(self, name: str, layer: int):
        self.name = name
        self.layer = layer  # global 0-based layer number, as the plan's StepPlan.attention holds them
        self.fp8 = False  # set per step from the plan
        self.enabled = True  # False inside EmulatedPrecision.high_precision()
        self.record_amax = True  # training forwards only (see EmulatedLinearState)
        self.policies: dict[str, TensorPolicy] = {}
        self.scalers: dict[str, DelayedScaler] = {}
        self.observer: Callable[..., None] | None = None  # statistics hook: (state, tensor, hp tuple, fq tuple)

    @property
    def active(self) -> bool:
        return self.fp8 and self.enabled and bool(self.policies)

    def quantized(self, tensor: str, hp: tuple[torch.Tensor, ...], record_amax: bool) -> tuple[torch.Tensor, ...]:
        """`hp` fake-quantized together: one amax over all of them (TE concatenates Q, K and V and quantizes them
        with one quantizer), one scale, each back in its own shape and dtype."""
        flat = hp[0].reshape(-1) if len(hp) == 1 else torch.cat([t.reshape(-1) for t in hp])
        fq_flat = dequantize(quantize(flat, self.policies[tensor], scaler=self.scalers.get(tensor),
                                      record_amax=record_amax))
        fq = tuple(part.view(t.shape) for part, t in zip(fq_flat.split([t.numel() for t in hp]), hp))
        if self.observer is not None:
            self.observer(self, tensor, hp, fq)
        return fq


class _AttentionFakeQuant(torch.autograd.Function):
    """Fake-quantizes its tensors as `forward_tensor` (None: pass through) and their gradients as `backward_tensor`
    (None: pass through). Pass-through outputs are copies: Megatron-Core's softmax masks its input in place."""

    @staticmethod
    def forward(ctx, state: EmulatedAttentionState, forward_tensor: str | None, backward_tensor: str | None,
                *hp: torch.Tensor):
        ctx.state, ctx.backward_tensor, ctx.record_amax = state, backward_tensor, state.record_amax
        if forward_tensor is None:
            return tuple(t.clone() for t in hp)
        return state.quantized(forward_tensor, hp, state.record_amax)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        if ctx.backward_tensor is not None:
            grads = ctx.state.quantized(ctx.backward_tensor, grads, ctx.record_amax)
        return (None, None, None, *grads)


def attention_fake_quant(state: EmulatedAttentionState, forward_tensor: str | None, backward_tensor: str | None,
                         *hp: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One of FP8 attention's quantization points, e.g. ``("QKV", "dQKV", q, k, v)`` or ``(None, "dP", scores)``."""
    return _AttentionFakeQuant.apply(state, forward_tensor, backward_tensor, *hp)


def _amax_reducer(kind: AmaxReduction, expert: bool = False) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """MAX all-reduce over the recipe's group (for a routed expert's GEMMs, over the ranks that hold the same
    expert: backends/groups.py), or None when there is nothing to reduce over."""
    group = expert_amax_reduction_group(kind) if expert else amax_reduction_group(kind)
    return None if group is None else max_reducer(group)


class EmulatedPrecision:
    """Drives every emulated layer from the plan (the training loop's precision controller)."""

    def __init__(self, plan: PrecisionPlan, states: dict[str, EmulatedLinearState],
                 attention: dict[int, EmulatedAttentionState] | None = None, seed: int = 0):
        unknown = set(states) - set(plan.layout.module_names)  # a pipeline stage holds a subset of the plan's
        if unknown:
            raise ValueError(f"emulated backend: the plan does not name these modules: {sorted(unknown)[:3]}")
        self.plan = plan
        self.states = states
        for state in states.values():
            state.run_seed = seed  # NVFP4 stochastic rounding: the run's seed (trainer.seed)
        self.attention = attention or {}
        """This rank's core attentions by global layer number (their scalers only with ``attention: fp8``)."""
        self._attention_policies()
        self.full_precision_eval_interval = plan.recipe.schedule.full_precision_eval_interval
        self._step: int | None = None  # the step begun last (replan gives its modules their new plans)
        # amax_reduction is delayed scaling's: current scaling takes each rank's own amax, as TE does (it reduces
        # one only for a sequence-parallel operand, over the TP ranks; no sequence parallelism on the CPU), so each
        # state's amax_reducers stay empty
        dense = _amax_reducer(plan.recipe.amax_reduction)
        # (decided by the plan, the same on every rank: the expert group may be built here, by every rank at once)
        expert = _amax_reducer(plan.recipe.amax_reduction, expert=True) if plan.layout.experts else None
        # Each state's delayed amaxes are reduced over the ranks that hold its module: a routed expert's over the
        # expert grid's group (at EP > 1 the dense data-parallel ranks hold other experts), the rest over the recipe's
        self._reducers: dict[int, Callable[[torch.Tensor], torch.Tensor] | None] = {}
        for name, state in states.items():  # (a module's own policies: the recipe's, or its modules: override's)
            state.scalers = _carried_scalers({}, plan.module_policies(name))
            self._reducers[id(state)] = expert if ModelLayout.expert_of(name) is not None else dense
        for state in self.attention.values():
            self._reducers[id(state)] = dense

    def _attention_policies(self) -> None:
        """The core attentions' policies and delayed scalers from the recipe (``attention: fp8``): the forward
        tensors with the activations' policy, the backward ones with the gradients'; a scaler kept where its policy
        is unchanged, resized where only its delayed settings changed."""
        recipe = self.plan.recipe
        if recipe.attention is not Attention.FP8:
            return
        forward, backward = recipe.policy(Role.ACTIVATIONS), recipe.policy(Role.GRADIENTS)
        for state in self.attention.values():
            state.policies = {t: forward if t in _FORWARD_TENSORS else backward for t in ATTENTION_TENSORS}
            state.scalers = _carried_scalers(state.scalers, state.policies)

    def replan(self, plan: PrecisionPlan) -> None:
        """Run `plan` from now on (the autopilot changed the recipe between steps; the same model layout): each
        module's delayed state carried where its policy is unchanged, resized where only the history or another
        delayed setting changed (:meth:`DelayedScaler.resized`), new for a role that turns delayed, dropped for one
        that stops being delayed. The step that decided it is over (its optimizer step taken), but an evaluation may
        follow it: the modules take their plans of that step from `plan` too, matching their new scalers."""
        if plan.layout.module_names != self.plan.layout.module_names:
            raise ValueError("emulated backend: replan needs a plan of the same model layout")
        self.plan = plan
        for name, state in self.states.items():
            state.scalers = _carried_scalers(state.scalers, plan.module_policies(name))
        self._attention_policies()
        if self._step is not None:
            self._step_plans(plan.at(self._step))

    def begin_step(self, step: int) -> str:
        self._step = step
        step_plan = self.plan.at(step)
        self._step_plans(step_plan)
        for state in self.states.values():
            state.step, state.backwards = step, 0
        return step_plan.stage

    def _step_plans(self, step_plan) -> None:
        """Each module's and attention's plan of one step."""
        for name, state in self.states.items():
            state.plan = step_plan.modules[name]
        for layer, attention in self.attention.items():
            attention.fp8 = layer in step_plan.attention

    def _all_states(self) -> list[EmulatedLinearState | EmulatedAttentionState]:
        return [*self.states.values(), *self.attention.values()]

    @contextlib.contextmanager
    def high_precision(self) -> Iterator[None]:
        states = self._all_states()
        saved = [s.enabled for s in states]
        for s in states:
            s.enabled = False
        try:
            yield
        finally:
            for s, enabled in zip(states, saved):
                s.enabled = enabled

    def after_optimizer_step(self, step: int) -> None:
        # (every rank of a reduction group holds the same modules: the same all-reduces in the same order; an expert's
        # group holds the same experts, a dense module's every rank of the stage)
        # An expert that got no token this step keeps its history and scale, as TE's GroupedLinear does on one GPU;
        # with an amax reduction every rank of its group updates (the same collectives on every rank of the group)
        for state in self._all_states():
            reduce = self._reducers[id(state)]
            for scaler in state.scalers.values():
                scaler.update(reduce, skip_unobserved=reduce is None)

    def skip_step(self, step: int) -> None:
        # The skipped step's amaxes (slot 0, maybe inf/NaN) never reach a scale: torch.maximum would keep a NaN
        # there into the next step, and an inf would pin the scale for a whole history window.
        for state in self._all_states():
            for scaler in state.scalers.values():
                scaler.history[0] = 0.0
                scaler.observed = False

    def scales(self) -> dict[str, dict[str, float]]:
        """The current delayed scales per module and role (for logging and the multi-rank checks)."""
        return {n: {str(r): float(sc.scale) for r, sc in s.scalers.items()} for n, s in self.states.items()}

    def state_dict(self) -> dict:
        out = {"recipe": self.plan.recipe.name,
               "scalers": {n: {str(r): sc.state_dict() for r, sc in s.scalers.items()}
                           for n, s in self.states.items() if s.scalers}}
        attention = {s.name: {t: sc.state_dict() for t, sc in s.scalers.items()}
                     for s in self.attention.values() if s.scalers}
        if attention:  # (absent without delayed FP8 attention: such checkpoints look as they always did)
            out["attention"] = attention
        return out

    def load_state_dict(self, state: dict) -> None:
        """The checkpoint's scaling state; a checkpoint of an autopilot run (its ``autopilot`` entry, when no
        AutopilotPrecision took it first: an evaluation, a resume with the autopilot off) replans to the recipe
        its applied actions made, so its scalers and GEMMs are the ones it trained with."""
        if (state.get("autopilot") or {}).get("applied"):
            from fp8_recipes.observe.autopilot import Autopilot  # (pure: the one reader of its saved state)
            from fp8_recipes.observe.autopilot_config import AutopilotConfig

            pilot = Autopilot.from_state_dict(AutopilotConfig(), self.plan.recipe, state["autopilot"])
            self.replan(PrecisionPlan(pilot.recipe, self.plan.layout, self.plan.hardware))
            logger.warning("resume: the checkpoint's run had the autopilot on: its %d action(s) applied to the "
                           "recipe (the plan it trained with); no further actions without autopilot=on",
                           len(pilot.actions))
        for name, per_role in state.get("scalers", {}).items():
            if name not in self.states:
                continue
            for role, sd in per_role.items():
                scaler = self.states[name].scalers.get(Role(role))
                if scaler is not None:
                    _load_scaler(f"{name} {role}", scaler, sd)
        by_name = {s.name: s for s in self.attention.values()}
        for name, per_tensor in state.get("attention", {}).items():
            for tensor, sd in per_tensor.items():
                scaler = by_name[name].scalers.get(tensor) if name in by_name else None
                if scaler is not None:
                    _load_scaler(f"{name} {tensor}", scaler, sd)


def _carried_scalers(old: dict, policies: dict) -> dict:
    """{key: DelayedScaler} for the delayed ones of `policies`, from the `old` scalers where they exist."""
    out = {}
    for key, policy in policies.items():
        if policy.scaling is not Scaling.DELAYED:
            continue
        before = old.get(key)
        out[key] = (before if before is not None and before.policy == policy else
                    before.resized(policy) if before is not None else DelayedScaler(policy))
    return out


def _load_scaler(where: str, scaler, state: dict) -> None:
    """A checkpoint's scaler state into ``scaler``; one that does not fit (the recipe changed its amax history) is
    a user error naming the way out."""
    try:
        scaler.load_state_dict(state)
    except ValueError as e:
        raise ConfigError(f"resume: {where}: {str(e).split(';')[0]}; resume with the recipe the checkpoint was "
                          f"written with, or set trainer.reset_scaling_state=true to start the scaling state "
                          f"fresh") from None
