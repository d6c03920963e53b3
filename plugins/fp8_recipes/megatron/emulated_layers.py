"""Megatron-Core linear layers that run the emulated FP8 backend, and attaching the backend to a GPTModel.

The subclasses replace only the local GEMM (``_forward_impl``); Megatron-Core's tensor-parallel collectives
stay where they are. When the module's plan has no FP8 GEMM for the step, Megatron-Core's own path runs,
so BF16 stages are bit-identical to a plain Megatron-Core model.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

from fp8_recipes.backends.emulated import EmulatedLinearState, EmulatedPrecision, emulated_linear
from fp8_recipes.megatron.model import model_layout, named_linear_modules  # model_layout: re-exported
from fp8_recipes.plan import PrecisionPlan

__all__ = [
    "EmulatedColumnParallelLinear", "EmulatedRowParallelLinear", "attach_emulated_backend", "model_layout",
]


class _EmulatedGemmMixin:
    """Overrides Megatron-Core's ``_forward_impl(input, weight, bias, ..., allreduce_dgrad, sequence_parallel)``."""

    _fp8_state: EmulatedLinearState | None = None  # set by attach_emulated_backend (class swaps skip __init__)

    def _forward_impl(self, input, weight, *args, **kwargs):
        state = self._fp8_state
        if state is None or state.plan is None or not state.enabled or not state.plan.any_fp8:
            return super()._forward_impl(input, weight, *args, **kwargs)
        if kwargs.get("sequence_parallel"):
            raise ValueError("emulated backend: sequence parallelism is not supported; set "
                             "model.sequence_parallel: false")
        if kwargs.get("allreduce_dgrad"):
            # Megatron-Core skipped copy_to_tensor_model_parallel_region because its fused GEMM all-reduces
            # the input gradient itself; ours does not, so the copy (identity forward, all-reduce backward) does.
            input = copy_to_tensor_model_parallel_region(input, group=kwargs.get("tp_group"))
        state.record_amax = self.training  # backward (training only) records as this forward did
        out = emulated_linear(input, weight, state)
        bias = kwargs.get("bias")
        return out + bias if bias is not None else out


class EmulatedColumnParallelLinear(_EmulatedGemmMixin, ColumnParallelLinear):
    """ColumnParallelLinear (attention qkv, MLP fc1, LM head) with plan-driven fake-quantized GEMMs."""


class EmulatedRowParallelLinear(_EmulatedGemmMixin, RowParallelLinear):
    """RowParallelLinear (attention proj, MLP fc2) with plan-driven fake-quantized GEMMs."""


def attach_emulated_backend(model: torch.nn.Module | list[torch.nn.Module], plan: PrecisionPlan) -> EmulatedPrecision:
    """Give every emulated linear of `model` (a GPTModel or this rank's pipeline chunks) its state and return the
    controller that drives them. The plan is the whole model's; a pipeline stage runs its own modules' part."""
    states = {}
    for name, module in named_linear_modules(model):
        if not isinstance(module, _EmulatedGemmMixin):
            raise ValueError(f"emulated backend: module {name} is a {type(module).__name__}; build the model with "
                             f"the emulated linear classes (build_gpt_model(column_linear=..., row_linear=...))")
        module._fp8_state = states[name] = EmulatedLinearState(name)
    if not set(states) <= set(plan.layout.module_names):
        raise ValueError("emulated backend: the plan was made for another model layout; build the plan from "
                         "model_layout(model)")
    return EmulatedPrecision(plan, states)
