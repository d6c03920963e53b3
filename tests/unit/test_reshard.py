"""training/reshard.py without processes: cutting a whole tensor for each TP rank and joining the parts back is the
identity for every kind of split, a saved optimizer state maps back to its parameters through its index, and a rank
reads only the saved pipeline stages that hold its tensors."""

from __future__ import annotations

import pytest
import torch

from fp8_recipes.training.reshard import (
    expert_global, join_shards, join_tp, rank_slice, saved_ep_ranks, saved_param_states, stages_holding,
)

NAMES = ["decoder.layers.3.mlp.linear_fc1.weight", "decoder.layers.0.self_attention.linear_qkv.weight",
         "decoder.layers.1.self_attention.linear_proj.weight", "decoder.layers.1.mlp.linear_fc2.weight",
         "embedding.word_embeddings.weight", "output_layer.weight", "decoder.layers.2.input_layernorm.weight",
         # an MoE layer's MLPs are split as the dense one: shared experts, each routed expert, TE's grouped experts
         "decoder.layers.1.mlp.shared_experts.linear_fc1.weight", "decoder.layers.1.mlp.shared_experts.linear_fc2.weight",
         "decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.weight",
         "decoder.layers.1.mlp.experts.local_experts.5.linear_fc2.weight",
         "decoder.layers.1.mlp.experts.linear_fc1.weight3", "decoder.layers.1.mlp.experts.linear_fc2.weight3",
         "decoder.layers.1.mlp.router.weight"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_cut_and_join_is_the_identity(name, tp):
    whole = torch.arange(8 * 8, dtype=torch.float32).view(8, 8) if "norm" not in name else torch.arange(8.0)
    parts = [rank_slice(name, whole, tp, r) for r in range(tp)]
    assert torch.equal(join_tp(name, parts), whole)
    if tp == 2 and ".linear_fc1.weight" in name:  # [gate_r; up_r]: rank 1 holds gate rows 2-3 and up rows 6-7
        assert parts[1][:, 0].tolist() == [16, 24, 48, 56]
    if tp == 2 and (name.endswith("linear_proj.weight") or ".linear_fc2.weight" in name):  # row-parallel: columns
        assert parts[1].shape == (8, 4)
    if tp == 2 and name.endswith("router.weight"):  # replicated
        assert parts[1].shape == (8, 8)


def test_saved_state_maps_to_parameters():
    """A distributed optimizer's gathered buffer (two params back to back) and a plain optimizer's param-group slots
    (an fp32 main copy) give each parameter its main param and moments, shaped as the parameter."""
    world = {key: torch.arange(10.0) + i for i, key in enumerate(("param", "exp_avg", "exp_avg_sq"))}
    distributed = {"state_dict": {}, "param_state": [{"buckets_coalesced": True, 0: {torch.float32: {
        **world, "numel_unpadded": 10}}}],
        "param_index": [{"buffers": {0: [(0, "a.weight", 0, 6, (2, 3)), (0, "b.weight", 6, 4, (4,))]}}]}
    states = saved_param_states(distributed)
    assert states[(0, "b.weight")]["exp_avg"].tolist() == [7.0, 8.0, 9.0, 10.0]
    assert states[(0, "a.weight")]["param"].shape == (2, 3)
    plain = {"state_dict": {"optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2, 2),
                                                        "exp_avg_sq": torch.zeros(2, 2)}},
                                          "param_groups": [{"params": [0]}]},
                            "fp32_from_fp16_params": [[torch.full((2, 2), 5.0)]]},
             "param_index": [{"groups": [[(1, "c.weight", 0, (2, 2))]]}]}
    state = saved_param_states(plain)[(1, "c.weight")]
    assert sorted(state) == ["exp_avg", "exp_avg_sq", "param"] and state["param"][0, 0] == 5.0


def _held(pp: int, vpp: int | None, layers_per_chunk: int, head: bool = True) -> dict[int, list[tuple[int, str]]]:
    """Per saved pipeline rank, its (chunk, local name)s: each chunk's layers, the embedding on the first stage, the
    final norm and (``head``: untied) the LM head on the last."""
    held = {}
    for p in range(pp):
        names = [(v, f"decoder.layers.{i}.mlp.linear_fc2.weight") for v in range(vpp or 1)
                 for i in range(layers_per_chunk)]
        if p == 0:
            names.append((0, "embedding.word_embeddings.weight"))
        if p == pp - 1:
            names += [((vpp or 1) - 1, "decoder.final_layernorm.weight")] + (
                [((vpp or 1) - 1, "output_layer.weight")] if head else [])
        held[p] = names
    return held


def _layers(*numbers: int) -> set[str]:
    return {f"decoder.layers.{i}.mlp.linear_fc2.weight" for i in numbers}


def test_a_rank_reads_only_the_stages_holding_its_tensors():
    pp4 = _held(4, None, 2)  # 8 layers, 2 per stage
    assert stages_holding(pp4, (1, 4, None), 8, {*_layers(0, 1, 2, 3), "embedding.word_embeddings.weight"}) == [0, 1]
    assert stages_holding(pp4, (1, 4, None), 8, {*_layers(4, 5, 6, 7), "decoder.final_layernorm.weight",
                                                 "output_layer.weight"}) == [2, 3]
    vpp = _held(2, 2, 1)  # 4 layers, one per chunk: stage 0 holds layers 0 and 2, stage 1 layers 1 and 3
    assert stages_holding(vpp, (1, 2, 2), 4, _layers(2)) == [0]
    assert stages_holding(vpp, (1, 2, 2), 4, _layers(0, 1)) == [0, 1]
    tied = _held(2, None, 2, head=False)  # a tied head saved nowhere: its state is the embedding's, on stage 0
    assert stages_holding(tied, (1, 2, None), 4, {*_layers(2, 3), "output_layer.weight"}) == [0, 1]
    read = []
    join_shards(lambda t, p, e: read.append((t, p, e)) or {"model": [{}]}, (2, 4, None), 8, stages=[3, 1])
    # every tensor-parallel part of the stages asked for, in order
    assert read == [(0, 1, None), (1, 1, None), (0, 3, None), (1, 3, None)]


def _main_params_and_steps(engine) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    inner = [opt.optimizer for opt in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])]
    return ([p.detach().clone() for opt in inner for g in opt.param_groups for p in g["params"]],
            [s["step"] for opt in inner for s in opt.state.values()])


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_loaded_distributed_optimizer_continues_as_the_saved_one():
    """Megatron-Core's distributed optimizer, loaded on the CPU (torch's AdamW), once shared one ``step`` tensor
    between all parameters, so the first step after a resume counted it once per parameter (the bias correction of
    step 3 + 27 at the TP=1 tiny model: a resumed run's losses left the uninterrupted run's from the second resumed
    step on). Loaded at its own layout and resharded, the optimizer now takes the step the saved one takes."""
    import itertools

    from fp8_recipes.megatron.model import unwrap_model
    from fp8_recipes.training.reshard import load_optimizer_resharded, optimizer_param_index
    from tiny_engine import BATCH, batches, tiny_engine

    cfg = {"micro_batch_size": BATCH, "global_batch_size": BATCH, "lr": 1e-2, "use_distributed_optimizer": True}
    with tiny_engine(cfg) as engine:
        data = batches()
        for _ in range(2):
            engine.train_step(data)
        weights = [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in unwrap_model(c).state_dict().items()}
                   for c in engine.models]
        saved = engine.optimizer_state_dict()
        saved["param_index"] = optimizer_param_index(engine.models, engine.optimizer)
        engine.train_step(data)
        want, _ = _main_params_and_steps(engine)
    _, whole = join_shards(lambda t, p, _: {"model": weights, "optimizer": saved}, (1, 1, None), 1, optimizer=True)
    for load in ("own layout", "resharded"):
        with tiny_engine(cfg) as engine:
            for chunk, state in zip(engine.models, weights):
                unwrap_model(chunk).load_state_dict(state)
            if load == "own layout":
                engine.load_optimizer_state_dict(saved)
            else:
                load_optimizer_resharded(engine.models, engine.optimizer, whole, 2, tp=1, tp_rank=0)
            engine.train_step(itertools.islice(batches(), 2, None))
            got, steps = _main_params_and_steps(engine)
        assert len({id(s) for s in steps}) == len(steps) and {float(s) for s in steps} == {3.0}, load
        assert all(torch.equal(a, b) for a, b in zip(got, want)), load


def test_a_vocabulary_padded_otherwise_is_told_from_another_vocabulary():
    """Rows that differ across TP sizes: the TP size's doing when one vocabulary pads to both (257 tokens: 384 rows at
    TP=1, 512 at TP=2), else another vocabulary (640 rows at TP=1 are 513-640 tokens, none 512 rows at TP=2), whose
    error must not advise the checkpoint's TP size."""
    from fp8_recipes.training.checkpoint import _one_vocabulary

    assert _one_vocabulary(384, 1, 512, 2) and _one_vocabulary(512, 2, 384, 1) and _one_vocabulary(512, 2, 512, 1)
    assert not _one_vocabulary(640, 1, 512, 2) and not _one_vocabulary(768, 2, 512, 1)


def test_expert_numbers_become_global():
    """EP rank 1 of EP 2 with 4 experts a layer holds experts 2 and 3 as local 0 and 1, in either expert module."""
    assert expert_global("decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight", 1, 2) == \
        "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight"
    assert expert_global("decoder.layers.0.mlp.experts.linear_fc1.weight0", 1, 2) == \
        "decoder.layers.0.mlp.experts.linear_fc1.weight2"
    for dense in ("decoder.layers.0.mlp.router.weight", "decoder.layers.0.mlp.shared_experts.linear_fc1.weight",
                  "decoder.layers.10.self_attention.linear_qkv.weight"):
        assert expert_global(dense, 1, 2) == dense


def _ep_payload(ep_rank: int, per_rank: int = 2) -> dict:
    """A one-stage EP rank's payload: the dense router and each of its experts' fc1 (values: the global expert
    number; the router's: 100 + the EP rank, so a dense tensor read from EP rank 1 would show) and a distributed
    optimizer's state as Megatron-Core gathers it: the dense buffer at EP rank 0 only, the experts' at each."""
    experts = {f"decoder.layers.0.mlp.experts.local_experts.{i}.linear_fc1.weight":
               torch.full((2, 2), float(ep_rank * per_rank + i)) for i in range(per_rank)}
    model = {"decoder.layers.0.mlp.router.weight": torch.full((4, 2), 100.0 + ep_rank), **experts}
    rows = [(0, name, 4 * i, 4, (2, 2)) for i, name in enumerate(experts)]
    expert_state = {0: {torch.float32: {"exp_avg": torch.cat([t.reshape(-1) for t in experts.values()])}}}
    dense_state = {0: {torch.float32: {"exp_avg": torch.full((8,), 100.0 + ep_rank)}}} if ep_rank == 0 else None
    return {"model": [model], "optimizer": {"state_dict": [{}, {}], "param_state": [dense_state, expert_state],
                                            "param_index": [{"buffers": {0: [(0, "decoder.layers.0.mlp.router.weight",
                                                                              0, 8, (4, 2))]}},
                                                            {"buffers": {0: rows}}]}}


def test_join_shards_gathers_every_ep_ranks_experts():
    """At EP 2 every EP rank's payload is read; its experts get global numbers, weights and optimizer state; the
    dense tensors come from EP rank 0's alone (EP rank 1's optimizer holds no dense state at all)."""
    read = []
    model, states = join_shards(lambda t, p, e: read.append((t, p, e)) or _ep_payload(e), (1, 1, None), 1,
                                optimizer=True, experts=(2, 4))
    assert read == [(0, 0, 0), (0, 0, 1)]
    for e in range(4):
        name = f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc1.weight"
        assert model[name].unique().tolist() == [float(e)] and states[name]["exp_avg"].unique().tolist() == [e]
    assert model["decoder.layers.0.mlp.router.weight"].unique().tolist() == [100.0]
    assert states["decoder.layers.0.mlp.router.weight"]["exp_avg"].unique().tolist() == [100.0]


def test_stages_holding_finds_a_layer_whatever_its_experts():
    """A rank of EP 1 wants experts 2-3 too, which EP rank 0's payload (the index read) names 0-1: the stage that
    holds the layer is read all the same."""
    held = {0: [(0, "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight")],
            1: [(0, "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight")]}  # (layers 0 and 1 of 2)
    wanted = {"decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"}
    assert stages_holding(held, (1, 2, None), 2, wanted) == [1]


def test_scaling_state_joins_ep_ranks_and_resets_grouped_experts_at_another_ep_size():
    """Per-expert entries (the emulated backend's, global numbers) are joined over the EP ranks, dense ones taken
    from EP rank 0 (as the weights are); TE's grouped experts' one entry per layer and fc is this EP rank's where the
    EP size is kept, and left out where it changed."""
    from fp8_recipes.training.checkpoint import _scaling_state

    def state(e):  # (the dense entries differ per EP rank, as amaxes do without a reduction over DP: EP 0's win)
        return {"recipe": "delayed", "scalers": {f"decoder.layers.0.mlp.experts.local_experts.{2 * e}.linear_fc1": e,
                                                 "decoder.layers.0.self_attention.linear_qkv": 7 + e},
                "delayed": {"decoder.layers.0.mlp.experts.linear_fc1": f"ep{e}", "output_layer": 9 + e}}

    shards = {(0, 0, e): state(e) for e in (0, 1)}
    kept, dropped = _scaling_state(shards, 1, 0, ep_rank=1)
    assert dropped == 0 and kept["delayed"] == {"decoder.layers.0.mlp.experts.linear_fc1": "ep1", "output_layer": 9}
    assert kept["scalers"] == {"decoder.layers.0.mlp.experts.local_experts.0.linear_fc1": 0,
                               "decoder.layers.0.self_attention.linear_qkv": 7,
                               "decoder.layers.0.mlp.experts.local_experts.2.linear_fc1": 1}
    changed, dropped = _scaling_state(shards, 1, 0, ep_rank=None)
    assert dropped == 1 and changed["delayed"] == {"output_layer": 9} and changed["scalers"] == kept["scalers"]


def test_live_names_of_grouped_experts_are_global():
    """TE's grouped experts name their GEMMs' weights ``linear_fc1.weight<local>``: an EP rank holding experts 6-7
    of layer 3 (its stage's local layer 0) names them as experts 6 and 7, as it does SequentialMLP's."""
    from types import SimpleNamespace

    from fp8_recipes.training.reshard import live_global_name

    layer = SimpleNamespace(layer_number=4, mlp=SimpleNamespace(local_expert_indices=[6, 7]))
    gpt = SimpleNamespace(decoder=SimpleNamespace(layers=[layer]))
    assert live_global_name(gpt, "decoder.layers.0.mlp.experts.linear_fc2.weight1") == \
        "decoder.layers.3.mlp.experts.linear_fc2.weight7"
    assert live_global_name(gpt, "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight") == \
        "decoder.layers.3.mlp.experts.local_experts.6.linear_fc1.weight"
    assert live_global_name(gpt, "decoder.layers.0.mlp.router.weight") == "decoder.layers.3.mlp.router.weight"


def test_a_rank_reads_the_ep_payloads_holding_its_experts():
    """At EP 4 with 8 experts a layer, a rank of EP 2 holding experts 4-7 reads EP ranks 2 and 3 (and 0, the dense
    tensors), not all four; a dense rank reads EP rank 0 alone."""
    wanted = {"decoder.layers.0.mlp.router.weight", "decoder.layers.0.self_attention.linear_qkv.weight",
              *(f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc1.weight" for e in (4, 5, 6, 7))}
    assert saved_ep_ranks(wanted, (4, 8)) == [0, 2, 3]
    assert saved_ep_ranks({"decoder.layers.1.mlp.experts.linear_fc2.weight1"}, (4, 8)) == [0]
    assert saved_ep_ranks({"output_layer.weight"}, (1, 0)) == [0]
    read = []
    join_shards(lambda t, p, e: read.append(e) or {"model": [{}]}, (1, 1, None), 1, experts=(4, 8), ep_ranks=[0, 3])
    assert read == [0, 3]
