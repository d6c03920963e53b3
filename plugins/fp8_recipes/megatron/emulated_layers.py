"""Megatron-Core layers that run the emulated FP8 backend, and attaching the backend to a GPTModel.

The linear subclasses replace only the local GEMM (``_forward_impl``); Megatron-Core's tensor-parallel collectives
stay where they are. The core attention subclass (``attention: fp8``) runs Megatron-Core's own forward with FP8
attention's quantization points inserted. When the plan has nothing in FP8 for a module at the step,
Megatron-Core's own path runs, so BF16 stages are bit-identical to a plain Megatron-Core model.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.dot_product_attention import DotProductAttention

from fp8_recipes.backends.emulated import (
    EmulatedAttentionState, EmulatedLinearState, EmulatedPrecision, attention_fake_quant, emulated_linear,
)
from fp8_recipes.megatron.model import (  # model_layout: re-exported
    model_layout, named_linear_modules, transformer_layers,
)
from fp8_recipes.plan.precision import PrecisionPlan
from fp8_recipes.recipe.schema import Attention

__all__ = [
    "EmulatedColumnParallelLinear", "EmulatedDotProductAttention", "EmulatedRowParallelLinear",
    "attach_emulated_backend", "model_layout",
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


class EmulatedDotProductAttention(DotProductAttention):
    """Megatron-Core's local core attention (softmax(Q K^T) V) with FP8 attention's quantization points when the
    plan runs this layer's attention in FP8 at the step (backends/emulated.py): Megatron-Core 0.19.2's forward,
    step for step, with QKV/dQKV after the GQA expansion, dP on the scaled scores before the softmax, S on the
    probabilities after dropout, O/dO on the output (where TE's UnfusedDotProductAttention puts them)."""

    _fp8_state: EmulatedAttentionState | None = None  # set by attach_emulated_backend

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        state = self._fp8_state
        if state is None or not state.active or packed_seq_params is not None or attention_bias is not None:
            # (Megatron-Core's own forward refuses packed sequences and attention bias in its words)
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        state.record_amax = self.training  # backward (training only) records as this forward did
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1:  # [sk, b, ng, hn] -> [sk, b, np, hn]
            key = key.repeat_interleave(groups, dim=2)
            value = value.repeat_interleave(groups, dim=2)
        query, key, value = attention_fake_quant(state, "QKV", "dQKV", query, key, value)

        output_size = (query.size(1), query.size(2), query.size(0), key.size(0))  # [b, np, sq, sk]
        query = query.reshape(output_size[2], output_size[0] * output_size[1], -1)  # [sq, b * np, hn]
        key = key.view(output_size[3], output_size[0] * output_size[1], -1)  # [sk, b * np, hn]
        matmul_input_buffer = parallel_state.get_global_memory_buffer().get_tensor(
            (output_size[0] * output_size[1], output_size[2], output_size[3]), query.dtype, "mpu")
        matmul_result = torch.baddbmm(matmul_input_buffer, query.transpose(0, 1),
                                      key.transpose(0, 1).transpose(1, 2), beta=0.0, alpha=self.softmax_scale)
        attention_scores = matmul_result.view(*output_size)
        attention_scores, = attention_fake_quant(state, None, "dP", attention_scores)

        attention_probs = self.scale_mask_softmax(attention_scores, attention_mask, self.softmax_offset)
        if not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                attention_probs = self.attention_dropout(attention_probs)
        else:
            attention_probs = self.attention_dropout(attention_probs)

        output_size = (value.size(1), value.size(2), query.size(0), value.size(3))  # [b, np, sq, hn]
        value = value.view(value.size(0), output_size[0] * output_size[1], -1)  # [sk, b * np, hn]
        attention_probs = attention_probs.view(output_size[0] * output_size[1], output_size[2], -1)
        attention_probs, = attention_fake_quant(state, "S", None, attention_probs)
        context = torch.bmm(attention_probs, value.transpose(0, 1))  # [b * np, sq, hn]
        context = context.view(*output_size).permute(2, 0, 1, 3).contiguous()  # [sq, b, np, hn]
        context = context.view(*context.size()[:-2], self.hidden_size_per_partition)  # [sq, b, hp]
        context, = attention_fake_quant(state, "O", "dO", context)
        return context


def attach_emulated_backend(model: torch.nn.Module | list[torch.nn.Module], plan: PrecisionPlan,
                            seed: int = 0) -> EmulatedPrecision:
    """Give every emulated linear and core attention of `model` (a GPTModel or this rank's pipeline chunks) its
    state and return the controller that drives them. The plan is the whole model's; a pipeline stage runs its own
    modules' part. `seed`: the run's (NVFP4's stochastic rounding draws from it)."""
    states = {}
    for name, module in named_linear_modules(model):
        if not isinstance(module, _EmulatedGemmMixin):
            raise ValueError(f"emulated backend: module {name} is a {type(module).__name__}; build the model with "
                             f"the emulated linear classes (build_gpt_model(column_linear=..., row_linear=...))")
        module._fp8_state = states[name] = EmulatedLinearState(name)
    if not set(states) <= set(plan.layout.module_names):
        raise ValueError("emulated backend: the plan was made for another model layout; build the plan from "
                         "model_layout(model)")
    attention = {}
    for number, layer in transformer_layers(model).items():
        core = layer.self_attention.core_attention
        if isinstance(core, EmulatedDotProductAttention):
            core._fp8_state = attention[number] = EmulatedAttentionState(
                f"decoder.layers.{number}.self_attention.core_attention", number)
        elif plan.recipe.attention is Attention.FP8:
            raise ValueError(f"emulated backend: attention: fp8, but layer {number}'s core attention is a "
                             f"{type(core).__name__}; build the model with "
                             f"build_gpt_model(core_attention=EmulatedDotProductAttention)")
    return EmulatedPrecision(plan, states, attention, seed)
