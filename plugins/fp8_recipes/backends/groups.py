"""The process group a recipe's ``amax_reduction`` names, shared by both backends."""

from __future__ import annotations

from typing import Any

from fp8_recipes.schema import AmaxReduction

__all__ = ["amax_reduction_group"]


def amax_reduction_group(kind: AmaxReduction) -> Any:
    """data -> Megatron-Core's data-parallel group, tensor -> its tensor-parallel group; None when there is
    nothing to reduce over (none, no torch.distributed, or a group of one rank)."""
    import torch.distributed as dist

    if kind is AmaxReduction.NONE or not dist.is_available() or not dist.is_initialized():
        return None
    from megatron.core import parallel_state as ps

    group = ps.get_data_parallel_group() if kind is AmaxReduction.DATA else ps.get_tensor_model_parallel_group()
    return group if dist.get_world_size(group) > 1 else None
