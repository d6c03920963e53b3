"""The process group a recipe's ``amax_reduction`` names, shared by both backends (the emulated one all-reduces
over it itself; te_layers.py hands TE the same group, even of one rank, to ``te.autocast(amax_reduction_group=...)``),
and the one MAX all-reduce of an amax that the emulated backend and the TE observer use."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fp8_recipes.recipe.schema import AmaxReduction

if TYPE_CHECKING:
    import torch

__all__ = ["amax_reduction_group", "expert_amax_reduction_group", "max_reducer", "te_amax_reduction_group",
           "te_expert_amax_reduction_group"]


def _megatron_group(kind: AmaxReduction) -> Any:
    from megatron.core import parallel_state as ps

    if kind is AmaxReduction.DATA_TENSOR:
        # What Megatron-Core's own FP8 context passes TE (fp8_utils.get_fp8_context): the data x tensor (x context)
        # parallel ranks of one pipeline stage. with_context_parallel=True as there: CP ranks see other tokens.
        return ps.get_amax_reduction_group(with_context_parallel=True, tp_only_amax_red=False)
    # The context-parallel ranks of a replica hold the same weights and other tokens of the same sequences: they
    # share scales under every choice, as Megatron-Core's FP8 context always passes with_context_parallel=True
    # (--tp-only-amax-red is its tensor x context group). At CP = 1 these are the plain data / tensor groups.
    if kind is AmaxReduction.DATA:
        return ps.get_data_parallel_group(with_context_parallel=True)
    return ps.get_amax_reduction_group(with_context_parallel=True, tp_only_amax_red=True)


def amax_reduction_group(kind: AmaxReduction) -> Any:
    """data_tensor -> Megatron-Core's amax reduction group (data x tensor x context parallel), data -> its
    data x context parallel group, tensor -> its tensor x context parallel group (Megatron-LM's
    --tp-only-amax-red); None when there is nothing to reduce over (none, no torch.distributed, or a group of one
    rank)."""
    import torch.distributed as dist

    group = te_amax_reduction_group(kind)
    return group if group is not None and dist.get_world_size(group) > 1 else None


def te_amax_reduction_group(kind: AmaxReduction) -> Any:
    """The group to hand ``te.autocast(amax_reduction_group=...)``: Megatron-Core's group for ``kind`` whatever its
    size, as Megatron-Core's own FP8 context passes it; None only for ``none`` or without torch.distributed.

    Never None for a group of one rank: TE reads None as the *world* (``reduce_and_update_fp8_tensors``:
    ``dist.get_world_size(group=None) > 1`` -> ``all_reduce(..., group=None)``), so at PP=2 with one rank per stage
    each stage's amax reduction would wait for the other stage (a hang at the first FP8 forward: 1F1B enters it at
    different points on the two stages, with buffers of different sizes); with ``data`` at TP=2 DP=1, or ``tensor``
    at TP=1 DP=2, it would reduce over ranks the recipe excludes. TE skips the reduction of a one-rank group itself."""
    import torch.distributed as dist

    if kind is AmaxReduction.NONE or not dist.is_available() or not dist.is_initialized():
        return None
    return _megatron_group(kind)


def _expert_megatron_group(kind: AmaxReduction) -> Any:
    """The expert-grid twin of :func:`_megatron_group`: the ranks that hold the same routed experts. Megatron-Core lays
    the experts out on a grid of their own (expert TP x EP x expert DP x PP, its context-parallel ranks folded into
    expert DP), so the data-parallel ranks of a dense module hold other experts at EP > 1: reducing an expert's amax
    over them would mix the amaxes of different experts (the same list position on each EP rank)."""
    from megatron.core import parallel_state as ps

    if kind is AmaxReduction.DATA:
        return ps.get_expert_data_parallel_group()
    if kind is AmaxReduction.TENSOR:
        return ps.get_expert_tensor_parallel_group()
    if ps.get_expert_tensor_parallel_world_size() == 1:  # data_tensor at expert TP 1: the expert-DP ranks
        return ps.get_expert_data_parallel_group()
    return _expert_tensor_and_data_group()


_EXPERT_TP_DP: list[Any] = [None, None]  # (the expert-DP group it was built under, the expert TP x DP group)


def _expert_tensor_and_data_group() -> Any:
    """The expert TP x expert DP ranks of this rank's (EP rank, pipeline stage): Megatron-Core builds no such group, so
    it is built here once per parallel state (every rank creates every group, in the same order: torch.distributed's
    rule for new_group), from Megatron-Core's own expert rank grid."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    built_for = ps.get_expert_data_parallel_group()
    if _EXPERT_TP_DP[0] is not built_for:
        grid = ps.RankGenerator(tp=ps.get_expert_tensor_parallel_world_size(),
                                ep=ps.get_expert_model_parallel_world_size(),
                                dp=ps.get_expert_data_parallel_world_size(),
                                pp=ps.get_pipeline_model_parallel_world_size(), cp=1, order="tp-cp-ep-dp-pp")
        mine = None
        for ranks in grid.get_ranks("tp-dp"):
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine = group
        _EXPERT_TP_DP[:] = [built_for, mine]
    return _EXPERT_TP_DP[1]


def expert_amax_reduction_group(kind: AmaxReduction) -> Any:
    """:func:`amax_reduction_group` for a routed expert's GEMMs: data -> Megatron-Core's expert-data-parallel group,
    tensor -> its expert-tensor-parallel group, data_tensor -> both (the expert-DP group at expert TP 1); None when
    there is nothing to reduce over. At EP = 1 and expert TP = TP these are the dense module's groups."""
    import torch.distributed as dist

    if kind is AmaxReduction.NONE or not dist.is_available() or not dist.is_initialized():
        return None
    group = _expert_megatron_group(kind)
    return group if group is not None and dist.get_world_size(group) > 1 else None


def te_expert_amax_reduction_group(kind: AmaxReduction) -> Any:
    """:func:`te_amax_reduction_group` for the routed experts' own autocast on Transformer Engine: the ranks that hold
    the same experts (:func:`_expert_megatron_group`, whatever its size), or the dense group itself where both hold
    the same ranks (EP = 1 and expert TP = TP, context parallelism or not: Megatron-Core folds CP into expert DP), so
    TE keys the experts' amaxes with the dense modules' as before. The emulated backend reduces over the same ranks
    (:func:`expert_amax_reduction_group`)."""
    import torch.distributed as dist

    dense = te_amax_reduction_group(kind)
    if dense is None:
        return None
    expert = _expert_megatron_group(kind)
    same = sorted(dist.get_process_group_ranks(expert)) == sorted(dist.get_process_group_ranks(dense))
    return dense if same else expert


def max_reducer(group: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """An in-place MAX all-reduce of an amax over ``group``, returning it: how the emulated backend shares scales
    over its recipe's group, and how the TE observer follows TE's own sequence-parallel amax reduction."""
    import torch.distributed as dist

    def reduce(amax: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        return amax

    return reduce
