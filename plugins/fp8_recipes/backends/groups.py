"""The process group a recipe's ``amax_reduction`` names, shared by both backends (the emulated one all-reduces
over it itself; te_layers.py hands it to ``te.autocast(amax_reduction_group=...)``)."""

from __future__ import annotations

from typing import Any

from fp8_recipes.schema import AmaxReduction

__all__ = ["amax_reduction_group"]


def _megatron_group(kind: AmaxReduction) -> Any:
    from megatron.core import parallel_state as ps

    if kind is AmaxReduction.DATA_TENSOR:
        # What Megatron-Core's own FP8 context passes TE (fp8_utils.get_fp8_context): the data x tensor (x context)
        # parallel ranks of one pipeline stage. with_context_parallel=True as there: CP ranks see other tokens.
        return ps.get_amax_reduction_group(with_context_parallel=True, tp_only_amax_red=False)
    if kind is AmaxReduction.DATA:
        return ps.get_data_parallel_group()
    return ps.get_tensor_model_parallel_group()


def amax_reduction_group(kind: AmaxReduction) -> Any:
    """data_tensor -> Megatron-Core's amax reduction group (data x tensor parallel), data -> its data-parallel
    group, tensor -> its tensor-parallel group; None when there is nothing to reduce over (none, no
    torch.distributed, or a group of one rank)."""
    import torch.distributed as dist

    if kind is AmaxReduction.NONE or not dist.is_available() or not dist.is_initialized():
        return None
    group = _megatron_group(kind)
    return group if dist.get_world_size(group) > 1 else None
