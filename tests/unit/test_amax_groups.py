"""backends/groups.py: which of Megatron-Core's process groups each ``amax_reduction`` names. The context-parallel
ranks of a replica (same weights, other tokens of the same sequences) are in every group, as in Megatron-Core's own
FP8 context (``get_amax_reduction_group(with_context_parallel=True, tp_only_amax_red=...)``); at CP = 1 they are
the plain data / tensor groups. Checked against a fake parallel_state: CP > 1 needs two GPUs."""

from __future__ import annotations

import pytest

from fp8_recipes.backends.groups import (amax_reduction_group, expert_amax_reduction_group, te_amax_reduction_group,
                                         te_expert_amax_reduction_group)
from fp8_recipes.recipe.schema import AmaxReduction

ps = pytest.importorskip("megatron.core.parallel_state")


@pytest.fixture
def asked(monkeypatch):
    """Each group Megatron-Core is asked for, as (function, keyword arguments); every group has two ranks."""
    import torch.distributed as dist

    calls: list[tuple[str, dict]] = []

    def recorder(name):
        def get(**kwargs):
            calls.append((name, kwargs))
            return name
        return get

    for name in ("get_amax_reduction_group", "get_data_parallel_group", "get_tensor_model_parallel_group"):
        monkeypatch.setattr(ps, name, recorder(name))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    return calls


@pytest.mark.parametrize("kind, function, kwargs", [
    (AmaxReduction.DATA_TENSOR, "get_amax_reduction_group", {"with_context_parallel": True, "tp_only_amax_red": False}),
    (AmaxReduction.DATA, "get_data_parallel_group", {"with_context_parallel": True}),
    (AmaxReduction.TENSOR, "get_amax_reduction_group", {"with_context_parallel": True, "tp_only_amax_red": True}),
])
def test_every_amax_reduction_spans_the_context_parallel_ranks(asked, kind, function, kwargs):
    assert amax_reduction_group(kind) == function
    assert asked == [(function, kwargs)]


def test_no_reduction_asks_for_no_group(asked):
    assert amax_reduction_group(AmaxReduction.NONE) is None and asked == []


@pytest.mark.parametrize("kind", [AmaxReduction.DATA_TENSOR, AmaxReduction.DATA, AmaxReduction.TENSOR])
def test_te_gets_a_one_rank_group_never_none(asked, monkeypatch, kind):
    """PP=2 on two GPUs: each stage's amax group holds one rank. The emulated backend then reduces nothing (None);
    TE must get the group itself, since TE reads None as the world and would all-reduce across the two stages."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2 if group is None else 1)
    assert amax_reduction_group(kind) is None
    assert te_amax_reduction_group(kind) is not None


def test_te_gets_no_group_without_reduction_or_torch_distributed(asked, monkeypatch):
    import torch.distributed as dist

    assert te_amax_reduction_group(AmaxReduction.NONE) is None and asked == []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    assert te_amax_reduction_group(AmaxReduction.DATA_TENSOR) is None and asked == []


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_emulated_current_scaling_takes_each_ranks_own_amax(monkeypatch, recipe):
    """amax_reduction is delayed scaling's: the emulated backend reduces delayed amaxes over the recipe's group and
    quantizes current-scaling (tensorwise) operands with each rank's own amax, as TE does without sequence
    parallelism (docs/distributed.md). Before, every emulated layer reduced its tensorwise amaxes over the group."""
    import torch

    from fp8_recipes.backends import emulated
    from fp8_recipes.backends.emulated import EmulatedLinearState, EmulatedPrecision
    from fp8_recipes.plan.precision import Hardware, ModelLayout, PrecisionPlan
    from fp8_recipes.recipe.pack import load_recipe

    calls = []

    def reduce(amax: torch.Tensor) -> torch.Tensor:
        calls.append(float(amax.max()))
        return amax * 4  # what a MAX over another rank with a 4x larger amax would return

    monkeypatch.setattr(emulated, "_amax_reducer", lambda kind: reduce)
    layout = ModelLayout.gpt(1)
    plan = PrecisionPlan(load_recipe(recipe), layout, Hardware())
    states = {n: EmulatedLinearState(n) for n in layout.module_names}
    precision = EmulatedPrecision(plan, states)
    precision.begin_step(10_000)
    assert all(not s.amax_reducers for s in states.values())
    state = next(s for n, s in states.items() if n.endswith("linear_fc1"))
    x = torch.randn(8, 32)
    state.quantized(x, emulated.Gemm.FPROP, emulated.Role.ACTIVATIONS, columnwise=False)
    assert calls == []  # no operand's amax is reduced while quantizing: current scaling's is its own
    precision.after_optimizer_step(10_000)
    if recipe == "delayed":  # delayed: each scaler's newest amax is reduced when the scales update
        assert len(calls) == sum(len(s.scalers) for s in states.values()) and max(calls) == float(x.abs().max())
    else:
        assert calls == []


@pytest.mark.parametrize("kind, expert_tp, function", [
    (AmaxReduction.DATA, 1, "get_expert_data_parallel_group"),
    (AmaxReduction.TENSOR, 2, "get_expert_tensor_parallel_group"),
    (AmaxReduction.DATA_TENSOR, 1, "get_expert_data_parallel_group"),
])
def test_an_experts_amaxes_are_reduced_over_the_ranks_holding_it(asked, monkeypatch, kind, expert_tp, function):
    """A routed expert's group is Megatron-Core's expert grid's (expert TP x EP x expert DP x PP): at EP = 2 the
    dense data-parallel ranks hold other experts, so the dense groups would mix two experts' amaxes."""
    for name in ("get_expert_data_parallel_group", "get_expert_tensor_parallel_group"):
        monkeypatch.setattr(ps, name, lambda name=name, **kwargs: asked.append((name, kwargs)) or name)
    monkeypatch.setattr(ps, "get_expert_tensor_parallel_world_size", lambda: expert_tp)
    assert expert_amax_reduction_group(kind) == function
    assert [name for name, _ in asked] == [function]
    assert expert_amax_reduction_group(AmaxReduction.NONE) is None


@pytest.mark.parametrize("expert_ranks, expected", [([0, 1], "get_data_parallel_group"),
                                                     ([0, 2], "get_expert_data_parallel_group")])
def test_te_experts_get_their_own_group_only_where_it_holds_other_ranks(asked, monkeypatch, expert_ranks, expected):
    """The experts' autocast on TE: the expert grid's group where it holds other ranks than the dense one (EP > 1, an
    expert TP other than TP), else the dense group object itself, so TE keys both alike as before (EP = 1)."""
    import torch.distributed as dist

    monkeypatch.setattr(ps, "get_expert_data_parallel_group", lambda **kwargs: "get_expert_data_parallel_group")
    ranks = {"get_data_parallel_group": [1, 0], "get_expert_data_parallel_group": expert_ranks}
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: ranks[group])
    assert te_expert_amax_reduction_group(AmaxReduction.DATA) == expected
    assert te_expert_amax_reduction_group(AmaxReduction.NONE) is None


def test_emulated_experts_reduce_over_their_own_group_and_skip_alone(monkeypatch):
    """The emulated backend hands each delayed scaler its module's reducer: the experts' over the expert grid, the
    rest over the recipe's group. An expert group of one rank (EP = 2 on two ranks) reduces nothing, so an expert
    without tokens keeps its activations' and gradients' histories (``skip_unobserved``) while the dense modules
    reduce over both ranks."""
    import torch

    from fp8_recipes.backends import emulated
    from fp8_recipes.backends.emulated import EmulatedLinearState, EmulatedPrecision
    from fp8_recipes.plan.precision import Hardware, ModelLayout, MoEShape, PrecisionPlan
    from fp8_recipes.recipe.pack import load_recipe
    from fp8_recipes.recipe.schema import Role

    dense_calls = []

    def dense(amax: torch.Tensor) -> torch.Tensor:
        dense_calls.append(amax.clone())
        return amax

    monkeypatch.setattr(emulated, "_amax_reducer", lambda kind, expert=False: None if expert else dense)
    layout = ModelLayout.gpt(1, moe=MoEShape(experts=4, layers=(0,)))
    plan = PrecisionPlan(load_recipe("delayed"), layout, Hardware())
    names = [n for n in layout.module_names if ModelLayout.expert_of(n) in (None, 2, 3)]  # EP rank 1's experts
    states = {n: EmulatedLinearState(n) for n in names}
    precision = EmulatedPrecision(plan, states)
    precision.begin_step(10_000)
    idle = states["decoder.layers.0.mlp.experts.local_experts.2.linear_fc1"]
    for scaler in idle.scalers.values():
        scaler.history[0] = 0.5  # (history[0]: the step's amax slot; a weight is quantized every step)
    idle.scalers[Role.WEIGHTS].observed = True
    before = {r: s.history.clone() for r, s in idle.scalers.items()}
    precision.after_optimizer_step(10_000)
    dense_scalers = sum(len(s.scalers) for n, s in states.items() if ModelLayout.expert_of(n) is None)
    assert len(dense_calls) == dense_scalers  # the experts' amaxes were not reduced over the dense group
    for role in (Role.ACTIVATIONS, Role.GRADIENTS):  # unobserved, reduced over no one: kept as it was
        assert torch.equal(idle.scalers[role].history, before[role]), role
    assert not torch.equal(idle.scalers[Role.WEIGHTS].history, before[Role.WEIGHTS])  # observed: rolled
